"""The LightningModule's side of the contract: find its pipeline layers, check them, keep only local ones.

A module opts in with ``pipeline_layers()``, the ordered modules whose composition is ``forward``. This
module turns that list into named layers (their fully-qualified names in the module, so parameter names
never change), rejects what cannot be pipelined with a message saying why, and after partitioning swaps
every layer another rank holds for a parameter-free :class:`RemoteLayer`, so a rank holds (and, from a
meta-device model, materializes) only its own stages.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from lightning_bfpp.engine import _compat
from lightning_bfpp.engine.random_state import forked_random_states, process_seed, seed_for_name

_CONTRACT = (
    "Define `pipeline_layers(self)` on your LightningModule returning the ordered list of submodules whose"
    " composition is `forward`, e.g. `return [self.embed, *self.blocks, self.head]`."
)


class RemoteLayer(nn.Module):
    """Stands in for a layer that lives on another pipeline rank; holds no parameters."""

    def __init__(self, name: str, pipeline_rank: int) -> None:
        super().__init__()
        self.layer_name = name
        self.pipeline_rank = pipeline_rank

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"Layer `{self.layer_name}` lives on pipeline rank {self.pipeline_rank} under BFPPStrategy and"
            " cannot be called here. Inside `training_step`/`validation_step`/`test_step`/`predict_step`,"
            " run the model through `self(...)`, which returns the pipeline's output."
        )

    def extra_repr(self) -> str:
        return f"{self.layer_name!r} on pipeline rank {self.pipeline_rank}"


class Recompute(nn.Module):
    """Runs a layer under ``torch.utils.checkpoint``: its activations are recomputed in backward, not stored.

    Breadth-first keeps every micro-batch's activations of every local stage alive until the backward sweep;
    recomputation bounds that to each layer's input. Wrapping happens only inside the stage module, so the
    LightningModule's layer (and its parameter names) is untouched.
    """

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.layer, *args, use_reentrant=False, **kwargs)


def compile_options(spec: Any) -> dict[str, Any] | None:
    """``compile`` as ``torch.compile``'s arguments, or None for no compilation."""
    if spec is False or spec is None:
        return None
    if spec is True:
        return {}
    if isinstance(spec, Mapping):
        return dict(spec)
    raise TypeError(f"BFPPStrategy: `compile` must be a bool or a dict of `torch.compile` arguments; got {spec!r}.")


def compiled(layer: nn.Module, options: dict[str, Any] | None) -> nn.Module:
    """``layer`` with its forward compiled in place (``nn.Module.compile``: parameter names and state unchanged),
    or as it is without ``options``. Each layer is compiled on its own, so the pipeline's transfers, FSDP2's hooks
    on the stage and the schedule stay outside the compiled code; a layer another rank runs is never compiled."""
    if options is not None:
        layer.compile(**options)
    return layer


def recompute_policy(spec: Any) -> Callable[[nn.Module], bool]:
    """``activation_checkpointing`` as a predicate on layers: a bool, layer type(s), or a callable."""
    if isinstance(spec, bool):
        return lambda layer: spec
    if isinstance(spec, type) or (isinstance(spec, tuple) and all(isinstance(t, type) for t in spec)):
        return lambda layer: isinstance(layer, spec)
    if callable(spec):
        return spec
    raise TypeError(
        "BFPPStrategy: `activation_checkpointing` must be a bool, a layer type (or tuple of types), or a callable"
        f" taking a layer and returning a bool; got {spec!r}."
    )


class _ContiguousGradient(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (it is sent to the previous stage)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _contiguous(value: Any, *, gradients: bool) -> Any:
    """Tensors that cross a stage boundary must be dense: torch's point-to-point ops (gloo and NCCL) refuse
    strided ones, which a layer can well produce (a transpose) or receive as gradient (the expanded
    gradient of a ``mean`` loss)."""
    if isinstance(value, tuple):
        return tuple(_contiguous(v, gradients=gradients) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    if gradients:
        return _ContiguousGradient.apply(value) if value.requires_grad else value
    return value.contiguous()


class StageModule(nn.Module):
    """One pipeline stage: a contiguous run of the LightningModule's own layer objects, applied in order.

    The layers are shared with the LightningModule, not copied, so sharding them in place keeps their
    names there. Between stages, a tuple output travels as several tensors; it is packed back into one
    tuple before the next layer, exactly as ``x = layer(x)`` would pass it on one device. Activations
    and gradients leaving a stage are made dense (see :func:`_contiguous`).
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        stage_index: int,
        *,
        names: Sequence[str] | None = None,
        is_last: bool = False,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.stage_index = stage_index
        self.last_layer_name = names[-1] if names else f"{len(layers) - 1} of stage {stage_index}"
        self.is_last = is_last

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.stage_index == 0:
            x = self.layers[0](*args, **kwargs)
        else:
            # torch's pipeline passes keyword inputs to every stage; only the first layer takes them
            received = _contiguous(args[0] if len(args) == 1 else tuple(args), gradients=True)
            x = self.layers[0](received)
        for layer in self.layers[1:]:
            x = layer(x)
        if not self.is_last:
            self._check_sendable(x)
        return _contiguous(x, gradients=False)

    def _check_sendable(self, x: Any) -> None:
        tensors = isinstance(x, torch.Tensor) or (
            isinstance(x, tuple) and len(x) > 0 and all(isinstance(t, torch.Tensor) for t in x)
        )
        if not tensors:
            raise TypeError(
                f"BFPPStrategy: pipeline layer `{self.last_layer_name}`, the last of stage {self.stage_index},"
                f" returned {'None' if x is None else 'a ' + type(x).__name__}. A stage's output is sent to the next"
                " pipeline rank and must be a tensor or a tuple of tensors: return those (e.g. `out['hidden']`),"
                " and pass anything else the next layers need as a tensor too."
            )


def pipeline_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The module's pipeline layers with their fully-qualified names, checked against the contract."""
    getter = getattr(module, "pipeline_layers", None)
    if not callable(getter):
        raise TypeError(f"BFPPStrategy: `{type(module).__name__}` has no `pipeline_layers()` method. {_CONTRACT}")
    layers = getter()
    if not isinstance(layers, Iterable) or isinstance(layers, nn.Module):
        raise TypeError(f"BFPPStrategy: `pipeline_layers()` must return a list of modules. {_CONTRACT}")
    layers = list(layers)
    if not layers:
        raise ValueError(f"BFPPStrategy: `pipeline_layers()` returned no layers. {_CONTRACT}")
    names: dict[int, str] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        if name:
            names.setdefault(id(m), name)
    named: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(
                f"BFPPStrategy: `pipeline_layers()` item {i} is a {type(layer).__name__}, not an nn.Module;"
                " wrap functions in a module (e.g. `nn.Flatten()` or a small nn.Module)."
            )
        if id(layer) in seen:
            raise ValueError(
                f"BFPPStrategy: `pipeline_layers()` lists the module `{names.get(id(layer), i)}` twice; a layer"
                " can belong to only one stage."
            )
        if id(layer) not in names:
            raise ValueError(
                f"BFPPStrategy: `pipeline_layers()` item {i} ({type(layer).__name__}) is not a submodule of the"
                " LightningModule; assign it as an attribute (e.g. in `__init__`) so it has a name."
            )
        seen.add(id(layer))
        named.append((names[id(layer)], layer))
    nested = [(outer, inner) for outer, _ in named for inner, _ in named if inner.startswith(outer + ".")]
    if nested:
        outer, inner = nested[0]
        raise ValueError(
            f"BFPPStrategy: `pipeline_layers()` lists `{inner}` inside `{outer}`; list the outer module or its"
            " parts, not both."
        )
    again = getter()
    again = list(again) if isinstance(again, Iterable) and not isinstance(again, nn.Module) else [again]
    if [id(layer) for layer in again] != [id(layer) for _, layer in named]:
        raise ValueError(
            f"BFPPStrategy: `pipeline_layers()` returned different layers on two calls ({len(named)} then"
            f" {len(again)}). It is called more than once (to partition the model and to check it), so it must"
            " return the same modules in the same order every time, e.g. build the list from attributes set in"
            " `__init__` rather than from state that changes."
        )
    _check_parameters(module, named)
    check_no_aliases(module, named)
    return named


def _check_parameters(module: nn.Module, named: Sequence[tuple[str, nn.Module]]) -> None:
    """Refuse parameters outside the pipeline layers. A parameter several layers share (tied weights) is
    allowed: :mod:`lightning_bfpp.engine.tied` keeps one copy per stage and keeps the copies equal."""
    inside = {id(param) for _, layer in named for param in layer.parameters()}
    stray = [n for n, p in module.named_parameters() if id(p) not in inside]
    parallel = [n for n, p in module.named_parameters() if id(p) not in inside and isinstance(p, DTensor)]
    if parallel:
        raise ValueError(
            f"BFPPStrategy: `{parallel[0]}` is a tensor-parallel (DTensor) parameter outside the module's"
            " `pipeline_layers()`. Only the layers are cut into stages, placed and sharded: parallelise the"
            " layers' own submodules (in `configure_model` or with `parallelize_fn`), not modules around them."
        )
    if stray:
        listed = ", ".join(f"`{n}`" for n in stray[:5]) + (" …" if len(stray) > 5 else "")
        raise ValueError(
            f"BFPPStrategy: parameters {listed} belong to no pipeline layer. Every parameter must live in a"
            " module that `pipeline_layers()` returns (move it into one of those layers); a parameter shared"
            " between pipeline layers (tied weights) is fine, one shared with a module outside them is not."
        )


def check_no_aliases(module: nn.Module, named: Sequence[tuple[str, nn.Module]]) -> None:
    """Refuse a pipeline layer's parameters reachable under a name outside that layer.

    An alias such as ``self.head = self.blocks[-1]`` (or a bare ``self.w = self.blocks[0].up.weight``) would
    survive the swap of a remote layer for :class:`RemoteLayer`: the rank would keep, checkpoint and optimize
    parameters another rank owns. Checked here, before partitioning and from the module alone, so every rank
    raises the same error at the same point; found only after the swap, only the ranks not holding the
    layer would raise, and the owner would wait for them in its next collective. Buffers may be shared (a
    rotary-embedding table used by every block is common, and a rank keeping a copy is harmless).
    """
    owner: dict[int, tuple[str, str]] = {}  # parameter id -> (its first layer, its name inside the module)
    users: dict[int, list[str]] = {}  # parameter id -> every pipeline layer using it (tied weights)
    for layer_name, layer in named:
        for name, param in layer.named_parameters(remove_duplicate=False):
            owner.setdefault(id(param), (layer_name, f"{layer_name}.{name}"))
            users.setdefault(id(param), []).append(layer_name)
    for name, param in module.named_parameters(remove_duplicate=False):
        layer_name, canonical = owner.get(id(param), (None, name))
        if layer_name is None or name == canonical:
            continue
        if any(name.startswith(user + ".") for user in users[id(param)]):
            continue  # the name of another layer using it: a tie between layers, not an alias of a layer
        alias, original = _differing_prefixes(name, canonical)
        inside = _layer_submodule_name(module, alias, named)
        if inside is not None:  # e.g. `self.last = self.head`, where `head.weight` is tied to `embed.weight`
            layer_name, original = inside
        elif _distinct_modules(module, alias, original):
            raise ValueError(
                f"BFPPStrategy: `{name}` is the parameter `{canonical}` of pipeline layer `{layer_name}`, shared"
                " with a module outside the pipeline layers. Each pipeline rank keeps only its own layers, so that"
                " module would hold another rank's parameter: move it into a pipeline layer (a parameter tied"
                " between pipeline layers is supported), or give it its own parameter."
            )
        raise ValueError(
            f"BFPPStrategy: `{alias}` is another name for `{original}` of pipeline layer `{layer_name}` (an"
            " alias such as `self.head = self.blocks[-1]`). Each pipeline rank keeps only its own layers, so a"
            " layer's parameters must be reachable under one name only: remove the attribute (or make it a"
            " property that returns the layer)."
        )


def _layer_submodule_name(
    module: nn.Module, name: str, named: Sequence[tuple[str, nn.Module]]
) -> tuple[str, str] | None:
    """The pipeline layer and own name of the submodule called ``name`` (an alias of it), if it is one."""
    try:
        target = module.get_submodule(name)
    except AttributeError:
        return None
    for layer_name, layer in named:
        for sub_name, sub in layer.named_modules():
            if sub is target:
                return layer_name, f"{layer_name}.{sub_name}" if sub_name else layer_name
    return None


def _distinct_modules(module: nn.Module, a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` name two different submodules (then they share a parameter, not one module)."""
    try:
        return module.get_submodule(a) is not module.get_submodule(b)
    except AttributeError:
        return False


def _differing_prefixes(alias: str, canonical: str) -> tuple[str, str]:
    """``("last.0.weight", "blocks.3.0.weight")`` -> ``("last", "blocks.3")``: the names of the aliased object."""
    a, c = alias.split("."), canonical.split(".")
    while len(a) > 1 and len(c) > 1 and a[-1] == c[-1]:
        a.pop()
        c.pop()
    return ".".join(a), ".".join(c)


def layer_weights(named: Sequence[tuple[str, nn.Module]]) -> list[int]:
    """Parameter count per layer; works on meta-device modules too."""
    return [sum(p.numel() for p in layer.parameters()) for _, layer in named]


def keep_local_layers(
    module: nn.Module,
    named: Sequence[tuple[str, nn.Module]],
    owner_rank: Sequence[int],
    pipeline_rank: int,
    device: torch.device,
    *,
    seed: int | None = None,
) -> dict[str, nn.Module]:
    """Replace other ranks' layers by :class:`RemoteLayer`, materialize (seeded by name from ``seed``, see
    :func:`materialize_meta`) and place the local ones.

    Returns the local layers by name. Raises if a replaced layer's parameters are still reachable from the
    module, since the rank would then keep them: a backstop, as :func:`check_no_aliases` refuses such aliases
    on every rank in :func:`pipeline_layers`, before this runs. A parameter a local layer shares with a remote
    one (tied weights, see :mod:`lightning_bfpp.engine.tied`) is the local layer's own.
    """
    local: dict[str, nn.Module] = {}
    remote_params: set[int] = set()
    for (name, layer), rank in zip(named, owner_rank, strict=True):
        if rank == pipeline_rank:
            local[name] = layer
        else:
            remote_params.update(id(p) for p in layer.parameters())
            parent_name, _, child = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, child, RemoteLayer(name, rank))
    remote_params -= {id(p) for layer in local.values() for p in layer.parameters()}
    leaked = [n for n, p in module.named_parameters() if id(p) in remote_params]
    if leaked:
        raise ValueError(
            f"BFPPStrategy: `{leaked[0]}` belongs to a layer held by another pipeline rank but is still reachable"
            " through another attribute of the module; remove the alias so each layer has one name."
        )
    if remote_params:
        # a reference cycle can still hold a dropped layer (a module's method kept by one of its submodules,
        # a frame kept by its own locals): free them now, before this rank's own layers are allocated, not
        # whenever the collector next runs
        gc.collect()
    for name, layer in local.items():
        materialize_meta(layer, device, name=name, seed=seed)
        layer.to(device)
    return local


def materialize_meta(layer: nn.Module, device: torch.device, *, name: str = "", seed: int | None = None) -> None:
    """Allocate ``layer``'s meta-device tensors on ``device`` and initialize each submodule that holds them with its
    ``reset_parameters()``, under torch's (and NumPy's, Python's) generators seeded from ``seed`` and the
    submodule's fully-qualified name (``name``: the layer's name in the module).

    So a module's initial values depend on the seed and its name alone: not on which rank materializes it, nor on
    how many modules that rank drew before it (a layout with other stages per rank draws the same values), nor on
    whether the whole model is materialized on one process (a Hugging Face wrapper under another strategy) or a
    stage at a time. ``seed``: default this process's torch seed (``seed_everything``'s); the strategy passes
    global rank 0's, so that every rank agrees even unseeded. The draws are forked: the process's own generator
    states are left as they were.
    """
    base = process_seed() if seed is None else seed
    pending = [
        (f"{name}.{sub_name}" if name and sub_name else name or sub_name, sub)
        for sub_name, sub in layer.named_modules()
        if any(t.is_meta for t in (*sub.parameters(recurse=False), *sub.buffers(recurse=False)))
    ]
    if not pending:
        return
    with forked_random_states(device) as reseed:
        for qualified, sub in pending:
            reseed(seed_for_name(base, qualified))
            _materialize(sub, device)


def materialize_whole(module: nn.Module, device: torch.device, *, seed: int | None = None) -> None:
    """Materialize every meta-device tensor of ``module`` on one process (:func:`materialize_meta`: each submodule
    from the seed and its name, so as a pipeline's ranks materialize their layers), keeping a parameter shared by
    several submodules shared: the first to hold it keeps its values, and the others point to it again, as the
    copies of a tied parameter take their owner's values under the strategy."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, param in _compat.parameter_slots(sub).items():
            if param is not None:
                places.setdefault(id(param), []).append((sub, name))
    materialize_meta(module, device, seed=seed)
    for (owner, owner_name), *others in places.values():
        for sub, name in others:
            _compat.parameter_slots(sub)[name] = _compat.parameter_slots(owner)[owner_name]


def _materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate a meta-device module's own tensors on ``device`` and initialize them with its
    ``reset_parameters()``: the contract of Lightning's ``init_module(empty_init=True)``, written with torch's
    public API so that this module does not need Lightning."""
    module.to_empty(device=device, recurse=False)
    if not callable(getattr(module, "reset_parameters", None)):
        raise TypeError(
            f"BFPPStrategy: `{type(module).__name__}` was created on the meta device and has no `reset_parameters()`"
            " method to initialize its parameters and buffers; add one (as torch's built-in layers have), or"
            " create the model without `empty_init=True`."
        )
    module.reset_parameters()


def materialize_remaining(module: nn.Module, device: torch.device, *, seed: int | None = None) -> None:
    """Materialize meta tensors outside the pipeline layers (e.g. metrics' states, loose buffers), seeded by name
    as :func:`materialize_meta`.

    Called after :func:`keep_local_layers`, so the only meta tensors left belong to modules every rank keeps.
    """
    materialize_meta(module, device, seed=seed)


# layers whose forward in training normalises by statistics over the samples of the call (BatchNorm), or whose
# running statistics a forward updates (InstanceNorm with ``track_running_stats``), by torch's public classes
_BATCH_NORMS = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
)
_INSTANCE_NORMS = (
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LazyInstanceNorm1d,
    nn.LazyInstanceNorm2d,
    nn.LazyInstanceNorm3d,
)


def batch_statistics_layers(named: Sequence[tuple[str, nn.Module]]) -> list[tuple[str, str]]:
    """``(name, class name)`` of every module inside the pipeline layers whose result depends on how a batch is
    cut into forward calls: BatchNorm (statistics over the call's samples; running statistics, if tracked,
    updated once per call) and InstanceNorm with ``track_running_stats`` (running statistics updated once per
    call). A custom layer that updates its own buffers in forward is not recognised."""
    found = []
    for layer_name, layer in named:
        for name, sub in layer.named_modules():
            running = isinstance(sub, _INSTANCE_NORMS) and sub.track_running_stats
            if isinstance(sub, _BATCH_NORMS) or running:
                found.append((f"{layer_name}.{name}" if name else layer_name, type(sub).__name__))
    return found


def batch_statistics_warning(
    found: Sequence[tuple[str, str]], num_microbatches: int, *, replicas_keep_own: bool, note: str | None = None
) -> str | None:
    """What the layers of :func:`batch_statistics_layers` compute differently here than on one device; None
    where nothing differs from DDP (one micro-batch per replica, and replicas that share running statistics).
    ``replicas_keep_own``: each data-parallel replica keeps its own running statistics; ``note``: what else the
    runner changes about them (weight passing's)."""
    if not found or (num_microbatches == 1 and not replicas_keep_own):
        return None
    names = ", ".join(f"`{name}` ({kind})" for name, kind in found[:3]) + (
        f" and {len(found) - 3} more" if len(found) > 3 else ""
    )
    text = [f"BFPPStrategy: {names} compute statistics over the samples of each forward call."]
    if num_microbatches > 1:
        text.append(
            f" Each forward call here sees one micro-batch (num_microbatches={num_microbatches} per replica):"
            " BatchNorm normalises by the micro-batch's mean and variance, not the whole batch's as on one"
            " device, and running statistics are updated once per micro-batch."
        )
    if replicas_keep_own:
        text.append(
            " Each data-parallel replica keeps its own running statistics (FSDP2 does not broadcast buffers every"
            " step as DDP does); a checkpoint holds one replica's."
        )
    if note:
        text.append(note)
    text.append(
        " For results that do not depend on how the batch is split use LayerNorm or GroupNorm (per-sample"
        " statistics), or num_microbatches=1 (statistics over each replica's batch, as under DDP). SyncBatchNorm is"
        " not supported inside a pipeline."
    )
    return "".join(text)


def check_no_collective_layers(named: Sequence[tuple[str, nn.Module]]) -> None:
    """Refuse ``nn.SyncBatchNorm``: its training forward is a collective over every process, which only the ranks
    running that stage reach (under weight passing, while the communication threads use the same ranks)."""
    for layer_name, layer in named:
        for name, sub in layer.named_modules():
            if isinstance(sub, nn.SyncBatchNorm):
                where = f"{layer_name}.{name}" if name else layer_name
                raise ValueError(
                    f"BFPPStrategy: `{where}` is a SyncBatchNorm, whose forward is a collective over all processes"
                    " that only the ranks running its stage would reach, so it cannot run inside a pipeline. Use"
                    " BatchNorm (statistics per micro-batch), LayerNorm or GroupNorm."
                )
