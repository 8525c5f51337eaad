"""Parameters tied across pipeline stages (e.g. an output head reusing the input embedding's weight).

One Parameter used by layers on different stages cannot stay one object: each stage is its own FSDP2 unit
(and may live on another rank), and FSDP2 needs every unit to own distinct parameters. So, as Megatron-LM's
embedding group and Fast-LLM's tied weights do, every stage using the parameter gets its own copy, and the
copies are kept equal:

- **detection** (:func:`find_ties`): the users of every Parameter shared by several pipeline layers; the
  *owner* is the user whose name the module's ``named_parameters()`` reports (the first in the module's
  attribute order; normally also the first in layer order, e.g. the embedding), and its name is the
  *canonical* one, the name a one-device model's optimizer state and checkpoint use;
- **copies** (:func:`retie`): after partitioning and materialization, the users inside one stage share one
  Parameter again (re-tied by original identity, which ``to_empty`` per submodule breaks), and each other stage
  gets a Parameter of its own;
- **equal values** (:meth:`TiedParameters.broadcast_from_owner`): after setup the owner's values are copied to
  every copy, over a small process group of the pipeline ranks holding them (one per data-parallel replica);
- **equal gradients** (:meth:`TiedParameters.sum_gradients`): after a step's backward that reduces gradients,
  the copies' gradients are summed within the group, so every copy holds the one-device gradient and the
  optimizer updates every copy identically (same values, same optimizer state);
- **counted once** (:attr:`TiedParameters.excluded_from_norm`): the non-owner copies are left out of the
  gradient norm, and clipped by the same coefficient;
- **stored once** (:attr:`TiedParameters.aliases`): checkpoints hold the canonical name only (see
  :mod:`lightning_bfpp.engine.checkpoint`);
- **refused** with the reason: a module with buffers shared across stages (:func:`check_shared_modules`),
  copies the optimizers treat differently (:meth:`TiedParameters.check_optimizers`), and copies a
  tensor-parallel plan splits differently on different stages. A parameter shared with
  a module outside the pipeline layers is refused by :mod:`lightning_bfpp.engine.layers`. Copies cannot differ in
  shape or mesh: they are clones of one Parameter, and every stage shards over a data-parallel group of the
  same size (under ``hybrid_shard`` split alike into (replicate, shard), and the ranks of one pipeline share
  their place in it), so a replica's copies hold the same shard, already all-reduced across nodes. Under tensor
  parallelism each stage splits its copy by its own plan; copies split alike (checked) hold the same rows on a
  rank, and the tie's groups link matching tensor ranks.

This module does not import Lightning.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_bfpp.engine._compat import buffer_slots, parameter_slots
from lightning_bfpp.engine.agreement import AgreedError
from lightning_bfpp.engine.process_groups import reused_subgroup


class TiedSettingsError(AgreedError, ValueError):
    """The copies of a tied parameter are optimized differently; raised on every rank alike."""


@dataclass(frozen=True)
class TieUser:
    """One use of a shared Parameter: the pipeline layer (index and name) and its name inside that layer."""

    layer: int
    layer_name: str
    name: str

    @property
    def fqn(self) -> str:
        return f"{self.layer_name}.{self.name}"


@dataclass(frozen=True)
class TieGroup:
    """The users of one Parameter shared by several pipeline layers; ``users[0]`` is the owner."""

    users: tuple[TieUser, ...]

    @property
    def owner(self) -> TieUser:
        return self.users[0]

    @property
    def canonical(self) -> str:
        return self.owner.fqn

    @property
    def aliases(self) -> tuple[str, ...]:
        return tuple(u.fqn for u in self.users if u.fqn != self.canonical)


def find_ties(module: nn.Module, named: Sequence[tuple[str, nn.Module]]) -> list[TieGroup]:
    """Group the users of every Parameter that several pipeline layers share (a layer's own ties are left alone).

    The owner is the user whose name ``module.named_parameters()`` reports, so the canonical name is the one a
    one-device model's optimizer state and ``named_parameters()`` use. Pure: the same on every rank.
    """
    users: dict[int, list[TieUser]] = {}
    for index, (layer_name, layer) in enumerate(named):
        for name, param in layer.named_parameters(remove_duplicate=False):
            users.setdefault(id(param), []).append(TieUser(index, layer_name, name))
    first_name = {}
    for name, param in module.named_parameters():
        first_name.setdefault(id(param), name)
    groups = []
    for key, found in users.items():
        if len({u.layer for u in found}) < 2:
            continue
        canonical = first_name.get(key, found[0].fqn)
        ordered = sorted(found, key=lambda u: (u.fqn != canonical, u.layer, u.name))
        groups.append(TieGroup(tuple(ordered)))
    return sorted(groups, key=lambda g: (g.owner.layer, g.owner.name))


def aliases_of(groups: Sequence[TieGroup]) -> dict[str, str]:
    """Every non-canonical user name -> its canonical name (what checkpoints store)."""
    return {alias: group.canonical for group in groups for alias in group.aliases}


def check_shared_modules(named: Sequence[tuple[str, nn.Module]], layer_stage: Sequence[int]) -> None:
    """Refuse a submodule with buffers used by layers on different stages (e.g. one BatchNorm in two layers).

    Its parameters could be tied like any other, but its buffers are state (running statistics) that one device
    updates once per use, in order, while each stage would update its own copy: they would drift apart. A buffer
    tensor shared by distinct modules (a constant table such as rotary frequencies) stays allowed.
    """
    seen: dict[int, tuple[int, str]] = {}
    for (layer_name, layer), stage in zip(named, layer_stage, strict=True):
        for name, sub in layer.named_modules(remove_duplicate=False):
            if not any(True for _ in sub.buffers(recurse=False)):
                continue
            full = f"{layer_name}.{name}" if name else layer_name
            first = seen.setdefault(id(sub), (stage, full))
            if first[0] != stage:
                raise ValueError(
                    f"BFPPStrategy: the module `{full}` (stage {stage}) is the module `{first[1]}` (stage {first[0]})"
                    " and holds buffers. Each stage would update its own copy of those buffers (e.g. running"
                    " statistics), so they would drift apart; give each layer its own module (tie only its"
                    " parameters), or keep both users in one stage (`partition=[...]`)."
                )


@dataclass
class _Slot:
    """Where a local layer holds a tensor: ``parameter_slots(module)[attr]`` (or ``buffer_slots``), named ``name``
    in layer ``layer``."""

    module: nn.Module
    attr: str
    layer: int
    name: str


@dataclass
class Identities:
    """Which slots of the local layers held the same Parameter (or buffer) before materialization."""

    parameters: dict[int, list[_Slot]] = field(default_factory=dict)
    buffers: dict[int, list[_Slot]] = field(default_factory=dict)


def record_identities(named: Sequence[tuple[str, nn.Module]], local_layers: Sequence[int]) -> Identities:
    """Record, before the local layers are materialized, which of their slots share one tensor."""
    record = Identities()
    for index in local_layers:
        for prefix, sub in named[index][1].named_modules(remove_duplicate=False):
            dotted = f"{prefix}." if prefix else ""
            for attr, param in parameter_slots(sub).items():
                if param is not None:
                    record.parameters.setdefault(id(param), []).append(_Slot(sub, attr, index, dotted + attr))
            for attr, buffer in buffer_slots(sub).items():
                if buffer is not None:
                    record.buffers.setdefault(id(buffer), []).append(_Slot(sub, attr, index, dotted + attr))
    return record


@dataclass
class _Group:
    """One tie across stages, as this rank sees it."""

    canonical: str
    owner_stage: int
    owner_rank: int  # the owner stage's pipeline rank
    stages: tuple[int, ...]  # every stage using it, ascending
    ranks: tuple[int, ...]  # the pipeline ranks of those stages, ascending
    slots: dict[int, _Slot]  # stage -> where this rank's copy lives (FSDP2 replaces the Parameter objects)
    process_group: dist.ProcessGroup | None = None

    @property
    def local(self) -> dict[int, nn.Parameter]:
        """Stage -> this rank's copy, as it is now (read from its module, so sharding is followed)."""
        return {stage: parameter_slots(slot.module)[slot.attr] for stage, slot in self.slots.items()}  # type: ignore[misc]


def retie(
    identities: Identities,
    groups: Sequence[TieGroup],
    layer_stage: Sequence[int],
    stage_rank: Sequence[int],
) -> TiedParameters:
    """After materialization: re-tie each stage's slots by original identity and give each stage its own copy.

    ``to_empty(recurse=False)`` per submodule gives every slot a tensor of its own, which breaks ties inside a
    layer or a stage; the first slot's tensor is set on the others of its stage. A Parameter used by several
    stages gets a distinct Parameter per stage (a clone of equal values where it is still one object), also
    when two of those stages are on the same rank: each stage is its own FSDP2 unit. ``stage_rank[s]`` is
    stage ``s``'s pipeline rank.
    """
    group_of: dict[tuple[int, str], TieGroup] = {(u.layer, u.name): g for g in groups for u in g.users}
    local: dict[str, dict[int, _Slot]] = {}
    with torch.no_grad():
        for slots in identities.buffers.values():
            _retie_slots(slots, layer_stage, buffer_slots, first_stage=None, copy_across_stages=False)
        for slots in identities.parameters.values():
            group = next((group_of[(s.layer, s.name)] for s in slots if (s.layer, s.name) in group_of), None)
            first = layer_stage[group.owner.layer] if group is not None else None
            per_stage = _retie_slots(slots, layer_stage, parameter_slots, first_stage=first, copy_across_stages=True)
            if group is not None:
                local[group.canonical] = per_stage
    tied = []
    for group in groups:
        stages = tuple(sorted({layer_stage[u.layer] for u in group.users}))
        if len(stages) < 2:
            continue  # its users share one stage, hence one FSDP2 unit: the Parameter stays one object
        ranks = tuple(sorted({stage_rank[s] for s in stages}))
        owner = layer_stage[group.owner.layer]
        local_copies = local.get(group.canonical, {})
        tied.append(_Group(group.canonical, owner, stage_rank[owner], stages, ranks, local_copies))
    return TiedParameters(tied, aliases_of(groups))


def _retie_slots(
    slots: Sequence[_Slot],
    layer_stage: Sequence[int],
    slots_of: Callable[[nn.Module], dict[str, Any]],
    *,
    first_stage: int | None,
    copy_across_stages: bool,
) -> dict[int, _Slot]:
    """Give every stage's slots one tensor (the stage's first slot's); with ``copy_across_stages``, a distinct
    Parameter per stage, ``first_stage`` (the owner's) keeping the original where it is still shared. Returns
    each stage's first slot."""
    per_stage: dict[int, torch.Tensor] = {}
    first_slot: dict[int, _Slot] = {}
    taken: set[int] = set()
    for slot in sorted(slots, key=lambda s: (layer_stage[s.layer] != first_stage, layer_stage[s.layer])):
        stage = layer_stage[slot.layer]
        if stage not in per_stage:
            current = slots_of(slot.module)[slot.attr]
            if copy_across_stages and id(current) in taken:
                current = nn.Parameter(current.detach().clone(), requires_grad=current.requires_grad)
            per_stage[stage] = current
            first_slot[stage] = slot
            taken.add(id(current))
        slots_of(slot.module)[slot.attr] = per_stage[stage]
    return first_slot


class TiedParameters:
    """This rank's copies of the parameters tied across stages, and what keeps them equal."""

    def __init__(self, groups: Sequence[_Group], aliases: Mapping[str, str]) -> None:
        self.groups = list(groups)
        #: every non-canonical name of a parameter shared by several layers -> its canonical name
        self.aliases = dict(aliases)

    def __bool__(self) -> bool:
        return bool(self.groups)

    @property
    def excluded_from_norm(self) -> frozenset[int]:
        """Ids of the copies on stages other than the owner's: counted once in the gradient norm, by the owner."""
        return frozenset(id(p) for g in self.groups for stage, p in g.local.items() if stage != g.owner_stage)

    def create_groups(self, mesh: DeviceMesh, pipeline_dim: str) -> None:
        """Create one process group per tie and data-parallel replica over the pipeline ranks holding copies.

        A collective over the world the first time (see :func:`~lightning_bfpp.engine.process_groups.reused`):
        every rank knows every tie and creates every group in the same order, also those it is not part of
        (``new_subgroups_by_enumeration`` needs that).
        """
        if mesh.size() == 1:
            return
        self._check_split_alike()
        names = mesh.mesh_dim_names
        assert names is not None
        # one row per pipeline (data-parallel replica, and tensor rank where there is one), in pipeline rank order
        grid = mesh.mesh.movedim(names.index(pipeline_dim), -1)
        ranks = grid.reshape(-1, grid.shape[-1])
        created: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for group in self.groups:
            if len(group.ranks) < 2:
                continue  # every copy is on this rank: summed locally
            if group.ranks not in created:
                members = [[row[r] for r in group.ranks] for row in ranks.tolist()]
                created[group.ranks] = reused_subgroup("ties", members)
            group.process_group = created[group.ranks]

    def _check_split_alike(self) -> None:
        """Refuse, on every rank, copies of one tie that are not split alike: a tensor-parallel plan that splits
        the tie on one stage and not on another (or along another dimension). Copies split alike hold the same
        rows on a rank (e.g. a vocabulary-parallel embedding and a column-wise LM head both split the vocabulary),
        so they are kept equal shard by shard; others cannot be. One ``all_gather_object`` over the world."""
        here = {g.canonical: {stage: _layout(p) for stage, p in g.local.items()} for g in self.groups if g.local}
        everywhere: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everywhere, here)
        seen: dict[str, dict[str, list[int]]] = {}
        for rank_layouts in everywhere:
            for canonical, per_stage in rank_layouts.items():
                for stage, layout in per_stage.items():
                    seen.setdefault(canonical, {}).setdefault(layout, []).append(stage)
        for canonical, layouts in seen.items():
            if len(layouts) > 1:
                found = "; ".join(f"stage(s) {sorted(set(stages))}: {layout}" for layout, stages in layouts.items())
                raise AgreedError(
                    f"BFPPStrategy: the parameter `{canonical}` is shared by layers on several stages, which split"
                    f" it differently ({found}). Split every layer that uses it alike (a vocabulary-parallel"
                    " embedding and a column-wise LM head split the same rows), or untie it."
                )

    @torch.no_grad()
    def broadcast_from_owner(self) -> None:
        """Copy the owner's values to every copy: equal at initialization, whatever each rank materialized."""
        for group in self.groups:
            if not group.local:
                continue
            source = group.local.get(group.owner_stage)
            # the owner's stage is on this rank, or a group links this rank to it (see create_groups)
            received = _local(source if source is not None else next(iter(group.local.values()))).contiguous().clone()
            if group.process_group is not None:
                dist.broadcast(received, group_src=group.ranks.index(group.owner_rank), group=group.process_group)
            for stage, param in group.local.items():
                if stage != group.owner_stage:
                    _local(param).copy_(received)

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Sum the copies' gradients over the tie (locally, then over its process group): each copy then holds
        the gradient the one shared parameter gets on one device.

        Sharded copies are summed shard by shard: every stage shards over a data-parallel mesh of the same size,
        so a replica's copies hold the same rows of the tensor.
        """
        for group in self.groups:
            params = [group.local[s] for s in sorted(group.local)]
            if not params or not params[0].requires_grad:
                continue
            grads = [_local(_grad_placed_as_param(p)) if p.grad is not None else None for p in params]
            present = [g for g in grads if g is not None]
            total = torch.zeros_like(_local(params[0])) if not present else present[0].clone()
            for g in present[1:]:
                total += g
            if group.process_group is not None:
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group.process_group)
            for param in params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                _local(param.grad).copy_(total)

    def check_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Refuse copies of one tied parameter that the optimizers treat differently, on every rank alike.

        ``configure_optimizers`` runs on each rank over its own layers and sees a copy under its stage's name
        (``head.weight``, not ``embed.weight``): grouping by name could put the copies in groups with other
        settings (weight decay, learning rate) or leave one out, and they would drift apart silently. A
        collective over the world (every rank calls it; the verdict is computed from the same gathered data).
        """
        if not self.groups:
            return
        mine = {g.canonical: {stage: _settings(p, optimizers) for stage, p in g.local.items()} for g in self.groups}
        gathered = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        for group in self.groups:
            seen: dict[int, str] = {}
            for rank_settings in gathered:
                seen.update(rank_settings[group.canonical])  # type: ignore[index]
            if len(set(seen.values())) > 1:
                listed = "; ".join(f"stage {s}: {seen[s]}" for s in sorted(seen))
                raise TiedSettingsError(
                    f"BFPPStrategy: the copies of the tied parameter `{group.canonical}` are optimized differently"
                    f" ({listed}). Each stage using it holds a copy, which `configure_optimizers` sees under that"
                    f" stage's name (e.g. {', '.join(f'`{a}`' for a in self._aliases_of(group.canonical)[:2])}):"
                    " put every copy in a parameter group with the same settings (select parameters by identity or"
                    " shape, or treat those names alike), as the one shared parameter is on one device."
                )

    def _aliases_of(self, canonical: str) -> list[str]:
        return [alias for alias, c in self.aliases.items() if c == canonical]


def _settings(param: torch.Tensor, optimizers: Sequence[torch.optim.Optimizer]) -> str:
    """Which optimizer and group settings ``param`` is updated with (``"not optimized"`` if none)."""
    for index, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            if any(p is param for p in group["params"]):
                options = {k: v for k, v in sorted(group.items()) if k != "params"}
                return f"optimizer {index} with {options}"
    return "not optimized"


def _layout(param: torch.Tensor) -> str:
    """How a copy is split over its mesh, and the part this rank holds: equal for copies split alike."""
    if isinstance(param, DTensor):
        dims = param.device_mesh.mesh_dim_names or ()
        placements = ", ".join(f"{d}: {p}" for d, p in zip(dims, param.placements, strict=True))
        return f"DTensor({placements}) local {tuple(param.to_local().shape)}"
    return f"whole {tuple(param.shape)}"


def _grad_placed_as_param(param: torch.Tensor) -> torch.Tensor:
    """``param``'s gradient, split as ``param`` is: a tensor-parallel layer's gradient can come out of autograd
    placed otherwise (torch's ``RowwiseParallel`` on an embedding returns it replicated over the group; FSDP2
    re-places it when it reduces, but without data parallelism nothing does), and copies of a tie are summed
    shard by shard."""
    grad = param.grad
    assert grad is not None
    if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad = grad.redistribute(param.device_mesh, param.placements)
    return grad


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
