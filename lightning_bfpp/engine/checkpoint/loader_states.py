"""Data-loader states, one per data-parallel replica.

torchdata's ``StatefulDataLoader`` states differ between data-parallel replicas, since each reads its own share
of the data; ``meta.pt`` keeps one per replica (:func:`gather_loader_states`) and each replica gets its own back
(:func:`replica_loader_states`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist


def gather_loader_states(
    local: Any, *, data_parallel_rank: int, pipeline_rank: int, data_parallel_size: int, is_global_zero: bool
) -> dict[str, Any] | None:
    """Every data-parallel replica's loader states, on global rank 0 (``None`` elsewhere, or if there are none).

    A collective. A replica's pipeline ranks read the same batches, so its pipeline rank 0 speaks for it.
    Replicas differ: a sampler or an ``IterableDataset`` sharded by replica, or a dataset with its own state
    (an augmentation generator, a shuffle buffer), is at another place in the data on each, so restoring
    global rank 0's state everywhere would hand every replica rank 0's share.
    """
    entry = (data_parallel_rank, pipeline_rank, local)
    if not (dist.is_available() and dist.is_initialized()):
        gathered = [entry]
    else:
        gathered = [None] * dist.get_world_size() if is_global_zero else None
        dist.gather_object(entry, gathered, dst=0)
    if not is_global_zero or gathered is None:
        return None
    states: list[Any] = [None] * data_parallel_size
    for replica, stage_rank, replica_states in gathered:
        if stage_rank == 0:
            states[replica] = replica_states
    if all(not replica_states for replica_states in states):
        return None
    return {"data_parallel_size": data_parallel_size, "states": states}


def replica_loader_states(
    stored: Mapping[str, Any] | None, saved_by_rank_zero: Any, *, data_parallel_rank: int, data_parallel_size: int
) -> tuple[Any, str | None]:
    """This replica's loader states to restore (``None``: restore none), and a warning when none can be.

    ``stored`` is what :func:`gather_loader_states` kept; without it (a checkpoint file from one process, or
    from an older version) there is only ``saved_by_rank_zero``, one process's states. A state belongs to one
    replica's share of the data under one replica count and cannot be split or merged for another, so under
    another ``data_parallel_size`` nothing is restored and the epoch's data starts over, as with a plain
    DataLoader, and the warning says so.
    """
    if not saved_by_rank_zero:
        return None, None
    if stored is None:
        if data_parallel_size == 1:
            return saved_by_rank_zero, None
        saved, origin = 1, "one process's data-loader state (a single-file checkpoint)"
    else:
        saved = int(stored["data_parallel_size"])
        if saved == data_parallel_size:
            return stored["states"][data_parallel_rank], None
        origin = f"one data-loader state per replica for data_parallel_size={saved}"
    return None, (
        f"BFPPStrategy: the checkpoint holds {origin}; this run has data_parallel_size={data_parallel_size}."
        f" Each state is one replica's place in its share of the data and cannot be split or merged for"
        f" {data_parallel_size} replicas, so the loader states are not restored: resumed mid-epoch, the epoch's"
        " data starts over from its beginning, as with a plain DataLoader (Lightning still counts the batches"
        " already trained, so the epoch ends that many batches early). Resume with"
        f" data_parallel_size={saved} for an exact resume."
    )
