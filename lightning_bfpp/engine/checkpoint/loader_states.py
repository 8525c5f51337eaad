"""Data-loader states, one per data-parallel replica.

torchdata's ``StatefulDataLoader`` states may differ between data-parallel replicas, since each reads its own share
of the data; ``meta.pt`` keeps one per replica (:func:`gather_loader_states`) and each replica gets its own back
(:func:`replica_loader_states`). Under another replica count (a run resumed on fewer machines) a state moves only
where it holds no replica's share: every replica saved the same state, and each sampler in it records its place in
the whole epoch (the adapter's resumable samplers do: :data:`REPLICAS_KEY`, :data:`CONSUMED_KEY`,
:data:`YIELDED_KEY`), so each new replica takes its share of the rest of the epoch from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from lightning_bfpp.engine.same_values import same_values

# torchdata's batch-sampler iterator state (a loader's place in its sampler): samples yielded, its sampler's state
POSITION_KEY = "samples_yielded"
SAMPLER_STATE_KEY = "sampler_state"
# a sampler's place in the whole epoch, whatever the replica count: the replicas it was shared over, the samples of
# the epoch's order read before that, and the samples each replica yielded since
REPLICAS_KEY = "num_replicas"
CONSUMED_KEY = "consumed"
YIELDED_KEY = "yielded"


def sampler_positions(state: Any) -> list[dict[str, Any]]:
    """Every sampler position in a loader state (or a list of them): torchdata's batch-sampler iterator states,
    found wherever the loader keeps them (a multi-worker loader's inside its snapshot)."""
    if isinstance(state, dict):
        if POSITION_KEY in state:
            return [state]
        return [position for value in state.values() for position in sampler_positions(value)]
    if isinstance(state, (list, tuple)):
        return [position for value in state for position in sampler_positions(value)]
    return []


def _places_in_whole_epochs(state: Any) -> bool:
    """Whether every sampler position in ``state`` records its place in the whole epoch (there is at least one)."""
    positions = sampler_positions(state)
    return bool(positions) and all(
        isinstance(sampler := position.get(SAMPLER_STATE_KEY), Mapping)
        and {REPLICAS_KEY, CONSUMED_KEY, YIELDED_KEY} <= sampler.keys()
        for position in positions
    )


# the seeds a multi-worker loader draws per epoch for its workers' generators (from each process's own generator):
# no place in the data, and unequal between replicas of a run that never seeded its processes alike
WORKER_SEED_KEYS = frozenset({"_base_seed", "_shared_seed"})


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
    from an older version) there is only ``saved_by_rank_zero``, one process's states. Under another
    ``data_parallel_size``, every replica gets the saved replicas' common state where it holds no replica's share
    (see the module's docstring). Otherwise a state belongs to one replica's share of the data under one replica
    count and cannot be split or merged for another: nothing is restored, the epoch's data starts over, as with a
    plain DataLoader, and the warning says so.
    """
    if not saved_by_rank_zero:
        return None, None
    if stored is None:
        if data_parallel_size == 1 or _places_in_whole_epochs(saved_by_rank_zero):
            return saved_by_rank_zero, None
        saved, origin = 1, "one process's data-loader state (a single-file checkpoint)"
    else:
        saved = int(stored["data_parallel_size"])
        states = stored["states"]
        if saved == data_parallel_size:
            return states[data_parallel_rank], None
        alike = all(same_values(states[0], other, ignored_keys=WORKER_SEED_KEYS) for other in states[1:])
        if alike and _places_in_whole_epochs(states[0]):
            return states[0], None
        origin = f"one data-loader state per replica for data_parallel_size={saved}"
    return None, (
        f"BFPPStrategy: the checkpoint holds {origin}; this run has data_parallel_size={data_parallel_size}."
        f" Each state is one replica's place in its share of the data (its dataset or sampler keeps a place of"
        " its own, or the checkpoint predates samplers that record their place in the whole epoch) and cannot be"
        f" split or merged for {data_parallel_size} replicas, so the loader states are not restored: resumed"
        " mid-epoch, the epoch's data starts over from its beginning, as with a plain DataLoader (Lightning still"
        " counts the batches already trained, so the epoch ends that many batches early). Resume with"
        f" data_parallel_size={saved} for an exact resume, or use a StatefulDataLoader over a map-style dataset"
        " with Lightning's distributed sampler, whose place moves to any replica count."
    )
