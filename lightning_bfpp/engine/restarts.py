"""Process groups that a restarted attempt of a job can form, and the attempt a process belongs to.

torchrun (``--max-restarts N``) restarts a failed job's whole worker group with the same ``MASTER_ADDR`` and
``MASTER_PORT``: the workers of every attempt meet through the agent's own store (``TORCHELASTIC_USE_AGENT_STORE``),
which keeps what the dead attempt's processes wrote there. A new attempt's ``init_process_group`` then reads those
keys (the ranks' addresses among them) and gloo's mesh fails to connect (``Connection refused``) until the restart
budget is spent. Prefixing the store by the attempt (``TORCHELASTIC_RESTART_COUNT``) gives each attempt keys of its
own, as torch's elastic examples do with their own stores; gloo and NCCL go through the same code.

Written here, not taken from torch or Lightning: both initialize the default group from ``env://`` with the store
as it is.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

ATTEMPT = "TORCHELASTIC_RESTART_COUNT"


def attempt() -> int | None:
    """This process's attempt under torchrun (0 for the first), None outside torchrun."""
    value = os.environ.get(ATTEMPT)
    return int(value) if value is not None and value.isdigit() else None


def init_process_group_for_attempt(
    backend: str, timeout: timedelta, rank: int, world_size: int, device: torch.device
) -> bool:
    """Under torchrun, initialize the default process group on ``env://``'s store prefixed by the attempt; True if it
    did. Outside torchrun, or with a group already initialized, nothing (False): Lightning's own setup goes on.
    ``device``: this process's (an accelerator's is bound to the group, as Lightning binds it)."""
    current = attempt()
    if current is None or not dist.is_available() or dist.is_initialized():
        return False
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    prefixed = dist.PrefixStore(f"lightning_bfpp/attempt_{current}/", store)
    kwargs = {} if device.type == "cpu" else {"device_id": device}
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    return True
