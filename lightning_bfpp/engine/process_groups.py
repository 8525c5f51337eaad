"""Process groups created once per process and reused by every later Trainer that asks for the same.

Each strategy setup needs a device mesh and a few groups of its own (the communication thread's, one per
tie, weight passing's node and rail groups, the asynchronous saver's). torch frees a group only in
``destroy_process_group``, and the strategy cannot destroy its groups at teardown: after ``fit`` the module's
parameters are still DTensors on the mesh, and reading them (``full_tensor()``, a later Trainer's ``test``)
runs collectives on its groups. So a process that set up several Trainers (a sweep, a new Trainer to test, a
test suite's worker running run after run) kept every earlier Trainer's groups: under gloo three threads and
a socket per peer each, whose transport loop wakes every 10 ms (90 idle groups cost a rank 9% of a core; a
test rank held 139 threads and 233 open descriptors by the end of a launch of 14 runs), under NCCL a
communicator with its device buffers each. Here each group is created once, under the current default group,
for what defines it (members and purpose), and a later setup that asks for the same gets the same back; a new
default group (after ``destroy_process_group``) starts afresh.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")

_made: dict[Hashable, Any] = {}
_world: Any = None  # the default group _made's groups belong to


def reused(key: Hashable, create: Callable[[], T]) -> T:
    """``create()``'s result for ``key``, created at the first call under the current default group.

    The first call is a collective when ``create`` is (creating groups is, over the world): every rank asks
    for the same keys in the same order, as it would create the groups. ``key`` names the purpose and
    everything that defines the result (members, sizes, options); two purposes that must not share a group
    (two threads issuing collectives) need two keys."""
    global _world
    world = dist.group.WORLD if dist.is_initialized() else None
    if world is not _world:
        _made.clear()
        _world = world
    if key not in _made:
        _made[key] = create()
    return _made[key]


def reused_subgroup(purpose: str, groups: Sequence[Sequence[int]]) -> dist.ProcessGroup | None:
    """This rank's group among ``groups`` (every group's global ranks; ``new_subgroups_by_enumeration``), created
    once for ``purpose`` and these members (see :func:`reused`); None where this rank is in none of them."""
    members = tuple(tuple(int(rank) for rank in group) for group in groups)
    return reused((purpose, members), lambda: dist.new_subgroups_by_enumeration(members)[0])
