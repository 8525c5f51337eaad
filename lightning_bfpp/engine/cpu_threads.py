"""Each CPU process's share of the node's cores, as torchrun gives it.

torch starts every process with one intra-op thread per core. torchrun sets ``OMP_NUM_THREADS=1`` for each
process it starts. Lightning's subprocess launcher (Lightning 2.6) caps only the process that launches the
others: it sets ``OMP_NUM_THREADS`` after starting them, and they, started with ``LOCAL_RANK`` set, run no
launcher of their own, so every other process of the node keeps one thread per core (measured: 1, 2, 2, 2
threads on 4 processes over 2 cores). Any host-side op on a large tensor then spins their threads against
each other: on the emulated benchmark (4 processes on 2 cores, 1 MiB activations) the step was 790–850 ms
instead of 640–655 ms with one thread each. :func:`share_cores` caps each process at its share unless the
user chose a thread count through ``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch


def threads_per_process(cores: int, local_processes: int) -> int:
    """The intra-op threads each of ``local_processes`` processes gets on ``cores`` cores (at least one)."""
    return max(1, cores // max(1, local_processes))


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. under a container or Slurm), else all."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def share_cores(local_processes: int, environ: Mapping[str, str] = os.environ) -> int | None:
    """Cap torch's intra-op threads at this process's share of the cores; return the new count, or ``None``
    where nothing changed (``OMP_NUM_THREADS`` set, one process, or already at most the share)."""
    if "OMP_NUM_THREADS" in environ or local_processes <= 1:
        return None
    threads = threads_per_process(available_cores(), local_processes)
    if torch.get_num_threads() <= threads:
        return None
    torch.set_num_threads(threads)
    return threads
