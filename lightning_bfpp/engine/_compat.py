"""Every private torch name lightning_bfpp relies on, in one place, importable without Lightning.

torch's pipelining runtime only accepts custom schedules through private names (its own docs call the
area alpha and say the CSV loader "will most likely get renamed"). Importing and touching them here, and
only here, means a torch upgrade breaks one file, and ``tests/unit/test_compat.py`` says which name moved
(it runs a real ``_PipelineScheduleRuntime`` and checks that torch reads what this module writes). The
versions in ``pyproject.toml`` are the ones those tests pass on. The few ``transformers`` internals the
Hugging Face adapter needs live beside it (:mod:`lightning_bfpp.integrations.huggingface._compat`).

The engine modules (``runtime``, ``microbatch``, ``sharding``, ``checkpoint``, ``layers``, ``trace``, ``tied``)
import only this file for private names, so they import without Lightning: this module imports neither
Lightning nor torchmetrics. Their private names live in :mod:`lightning_bfpp.adapter._lightning_compat`.
``tests/unit/test_compat.py`` also checks that no other module of the package touches a private name of torch,
Lightning or ``transformers``.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed.pipelining.schedules as _torch_schedules
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

# the torch releases this package is tested on (CI runs the oldest and the newest), and the oldest it runs on
SUPPORTED_TORCH = ((2, 13), (2, 14), (2, 15))
# what pip should be asked for, named in every refusal
TORCH_REQUIREMENT = "torch>=2.13,<2.16"

_MISSING: list[str] = []  # private names the installed torch does not have (private_api_problems)


class _Absent(type):
    """The metaclass of a stand-in for a missing private name: attribute access and subclassing still work at
    import time, so the package imports and :func:`check_torch_version` can name what is missing."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return cls

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise ImportError(f"lightning_bfpp: torch {torch.__version__} has no {cls.__qualname__}; {_FIX}")


def _private(*places: str) -> Any:
    """The first of ``places`` (``"module:name"``) the installed torch has. torch moves private names between
    modules (e.g. its schedule lowering passes towards ``pipelining/runtime.py``), so each lookup may name several;
    a name found nowhere is recorded and stands in as an :class:`_Absent` class."""
    for place in places:
        module_name, _, name = place.partition(":")
        try:
            value: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        for part in name.split("."):
            value = getattr(value, part, _NOT_FOUND)
        if value is not _NOT_FOUND:
            return value
    _MISSING.append(" or ".join(places))
    return _Absent(places[0].rpartition(":")[2], (), {})


_NOT_FOUND = object()
_FIX = f"install a tested release: pip install '{TORCH_REQUIREMENT}'"
_SCHEDULES = "torch.distributed.pipelining.schedules"
_RUNTIME = "torch.distributed.pipelining.runtime"

ReplicateModule = _private("torch.distributed._composable.replicate_with_fsdp:ReplicateModule")
replicate = _private("torch.distributed._composable.replicate_with_fsdp:replicate")
EmptyStateDictLoadPlanner = _private("torch.distributed.checkpoint.format_utils:_EmptyStateDictLoadPlanner")
_FSDPReduceScatter = _private("torch.distributed.fsdp._fully_shard._fsdp_collectives:DefaultReduceScatter")
_stage_backward_input = _private("torch.distributed.pipelining._backward:stage_backward_input")
_stage_backward_weight = _private("torch.distributed.pipelining._backward:stage_backward_weight")
PipeliningMetadataError = _private("torch.distributed.pipelining._utils:PipeliningMetadataError")
TorchAction = _private(f"{_SCHEDULES}:_Action")
TorchKind = _private(f"{_SCHEDULES}:_ComputationType")
add_send_recv = _private(f"{_SCHEDULES}:_add_send_recv", f"{_RUNTIME}:_add_send_recv")
format_torch_schedule = _private(f"{_SCHEDULES}:_format_pipeline_order", f"{_RUNTIME}:_format_pipeline_order")
PipelineScheduleRuntime = _private(f"{_SCHEDULES}:_PipelineScheduleRuntime", f"{_RUNTIME}:_PipelineScheduleRuntime")

# torch ≥ 2.15's runtime retires every send and every gradient reduction with an action of its own
# (WAIT_SEND_F / WAIT_SEND_B / WAIT_REDUCE_GRAD); lightning_bfpp.engine.torch_ir writes them, or leaves them out
TORCH_WAIT_ACTIONS = hasattr(TorchKind, "WAIT_REDUCE_GRAD")
# torch ≥ 2.15's FSDP2 lets the caller end a backward iteration (public: `FSDPModule.finalize_backward`, returning
# a `GradientReductionHandle`), and `PipelineStage`'s forward switches a stage to it; before, only FSDP2's private
# post-backward and root callback could (fsdp_post_backward, fsdp_finish_backward)
MANUAL_BACKWARD_FINALIZATION = hasattr(FSDPModule, "finalize_backward")

# torch's own functions at import time, to tell whether something replaced them (see runtime_is_hooked)
_RECORD_FUNCTION, _WAIT_P2P = _torch_schedules.record_function, _torch_schedules._wait_batch_p2p

# The file in a checkpoint folder that holds Lightning's non-tensor state, which its `consolidate_checkpoint`
# and its model-parallel loaders look for. A literal, so that `checkpoint/` imports without Lightning;
# test_compat checks that it equals Lightning's own `lightning.fabric.utilities.load._METADATA_FILENAME`.
_METADATA_FILENAME = "meta.pt"


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def private_api_problems() -> list[str]:
    """What the installed torch lacks of the private API this module drives: the names it imports, the methods and
    attributes of torch's classes and modules it calls or replaces, the action types it writes. Empty on every
    tested release (``tests/unit/test_compat.py`` checks it, beside running that API for real)."""
    problems = [f"{place} is missing" for place in _MISSING]
    expected = {
        PipelineScheduleRuntime: ("_prepare_schedule_with_comms", "_step_microbatches", "_initialize_stages",
                                  "register_custom_function", "_assert_unsharded", "_validate_and_set_stage_mapping"),
        _private("torch.distributed.pipelining:PipelineStage"): ("forward_one_chunk", "backward_one_chunk",
                                                                 "clear_runtime_states"),
        _torch_schedules: ("record_function", "_wait_batch_p2p"),
        TorchKind: ("FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "UNSHARD", "RESHARD",
                    "REDUCE_GRAD", "SEND_F", "RECV_F", "SEND_B", "RECV_B"),
        _private("torch.distributed.device_mesh:DeviceMesh"): ("_unflatten",),
        FSDPModule: ("set_requires_gradient_sync", "set_reshard_after_backward", "set_is_last_backward", "unshard",
                     "reshard", "set_custom_reduce_scatter"),
    }  # fmt: skip
    if TORCH_WAIT_ACTIONS:  # the 2.15 runtime's waits, and FSDP2's public finalization beside them
        expected[TorchKind] += ("WAIT_SEND_F", "WAIT_SEND_B")
        expected[FSDPModule] += ("finalize_backward", "set_manual_backward_finalization")
    else:  # before: FSDP2's private post-backward (fsdp_post_backward)
        state = _private("torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState")
        expected[state] = ("_root_post_backward_final_callback",)
        expected[_private("torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup")] = ("post_backward",)
    for owner, names in expected.items():
        if isinstance(owner, _Absent):
            continue  # already reported as missing
        label = getattr(owner, "__qualname__", None) or owner.__name__
        problems += [f"{label}.{name} is missing" for name in names if not hasattr(owner, name)]
    try:
        parameters = inspect.signature(add_send_recv).parameters
    except (TypeError, ValueError):
        parameters = {}
    problems += [f"_add_send_recv takes no {n!r}" for n in ("stage_to_rank", "num_stages") if n not in parameters]
    return problems


def check_torch_version() -> None:
    """Refuse a torch older than supported, and a newer one whose private API (:func:`private_api_problems`) has
    changed, each with what to install; warn on a newer one that still has everything."""
    version = torch_version()
    tested = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_TORCH)
    if version < SUPPORTED_TORCH[0]:
        raise ImportError(
            f"lightning_bfpp needs torch {SUPPORTED_TORCH[0][0]}.{SUPPORTED_TORCH[0][1]} or newer (tested on torch"
            f" {tested}); this is torch {torch.__version__}. Install a supported release: pip install"
            f" '{TORCH_REQUIREMENT}'."
        )
    problems = private_api_problems()
    if problems:
        raise ImportError(
            f"lightning_bfpp runs torch.distributed.pipelining's private schedule runtime, tested on torch {tested};"
            f" torch {torch.__version__} has changed what it relies on: {'; '.join(problems)}. Install a tested"
            f" release: pip install '{TORCH_REQUIREMENT}'."
        )
    if version > SUPPORTED_TORCH[-1]:
        warnings.warn(
            f"lightning_bfpp is tested on torch {tested}; this is torch {torch.__version__}. The private pipelining"
            f" API it relies on is all there, but untested behaviour may differ; if a step fails, install a tested"
            f" release: pip install '{TORCH_REQUIREMENT}'.",
            stacklevel=2,
        )


class PipelineRuntime(PipelineScheduleRuntime):
    """torch's ``_PipelineScheduleRuntime``, driven only through the methods below.

    torch has no public way to run a schedule someone else wrote, so these methods are the private entry
    points, each named once: :meth:`install_plan` (the action lists), :meth:`run_microbatches` (one step over
    pre-split micro-batches) and :meth:`metadata_inference` (an override point around torch's first-run shape
    inference). Subclasses (:class:`lightning_bfpp.engine.runtime.PlannedSchedule`) use no other private name.
    """

    def install_plan(
        self, plan: Mapping[int, Sequence[TorchAction]], stage_to_rank: Mapping[int, int], *, backward: bool
    ) -> None:
        """Make ``plan`` (every rank's actions, sends and receives included) what each step executes.

        A plan with backward goes through torch's own ``_prepare_schedule_with_comms(format="compute_comms")``,
        which validates it (each stage on one rank, ``m`` forwards and ``m`` backwards per stage, every
        backward after its forward) and infers the stage placement from it. torch's validator demands a
        backward for every forward, so a forward-only plan is stored directly, in the attribute that method
        fills, with the backward switched off the way torch's own ``eval()`` does, and placed as ``stage_to_rank``
        says (torch would place its stages looping). torch's lowering passes
        (``_add_unshard_reshard``, ``_add_reduce_grad``) are not used; see ``schedule.add_sharding_actions``.
        """
        actions = {rank: list(plan[rank]) for rank in plan}
        if backward:
            self._prepare_schedule_with_comms(actions, format="compute_comms")  # type: ignore[arg-type]
        else:
            self.pipeline_order_with_comms = actions
            self._has_backward = False
            # torch infers the placement from a training plan only; a forward-only one takes the plan's, as
            # torch's own V schedules set theirs, on the runtime and on every stage (whose sends follow it)
            self.stage_index_to_group_rank = dict(stage_to_rank)
            for stage in self._stages:
                stage.stage_index_to_group_rank = self.stage_index_to_group_rank
        if self.stage_index_to_group_rank != dict(stage_to_rank):
            # torch places stages by the plan (training); ours must agree, or sends and receives would go to the
            # wrong ranks
            raise RuntimeError(
                f"lightning_bfpp: torch's runtime places stages on ranks {self.stage_index_to_group_rank},"
                f" the plan on {dict(stage_to_rank)}."
            )

    def replace_gradient_reduction(self, reduce: Callable[[int], bool], wait: Callable[[int], None]) -> None:
        """Run ``reduce(stage_index)`` for each ``REDUCE_GRAD`` action instead of torch's own reduction, and
        ``wait(stage_index)`` for each ``WAIT_REDUCE_GRAD``, through torch's own ``register_custom_function``.
        ``reduce`` returns whether it also reshards the stage (FSDP2's post-backward does when asked to), in
        which case the stage's next ``RESHARD`` only updates the runtime's record of unsharded stages instead of
        touching the stage while its reduction may still run.

        Before torch 2.15 the lists carry no ``WAIT_REDUCE_GRAD`` (:mod:`lightning_bfpp.engine.torch_ir`): the
        wait the plan puts just before a rank's next ``REDUCE_GRAD`` runs at the start of that action instead, and
        the list's last one is the caller's, after the step (``GradientReductions.finish``).
        """
        resharded_by_reduction: set[int] = set()
        pending: list[int] = []  # before 2.15: the stage whose reduction the plan's next wait retires

        def reduce_grad(action: TorchAction, ctx: Any) -> None:
            if not TORCH_WAIT_ACTIONS:
                if pending:
                    wait(pending.pop())
                pending.append(action.stage_index)
            if reduce(action.stage_index):
                resharded_by_reduction.add(action.stage_index)

        def wait_reduce_grad(action: TorchAction, ctx: Any) -> None:
            wait(action.stage_index)

        def reshard(action: TorchAction, ctx: Any) -> None:
            stage_index = action.stage_index
            if stage_index in self.unshard_ops:
                raise RuntimeError(f"lightning_bfpp: resharding stage {stage_index} before its gather finished")
            if stage_index in resharded_by_reduction:
                resharded_by_reduction.discard(stage_index)
            else:
                stage = next(s for s in self._stages if s.stage_index == stage_index)
                for module in stage.submod.modules():
                    if isinstance(module, FSDPModule):
                        module.reshard()
            self.unsharded_stages.discard(stage_index)

        self.register_custom_function(TorchKind.REDUCE_GRAD, reduce_grad)
        self.register_custom_function(TorchKind.RESHARD, reshard)
        if TORCH_WAIT_ACTIONS:
            self.register_custom_function(TorchKind.WAIT_REDUCE_GRAD, wait_reduce_grad)

    @property
    def stages(self) -> list[Any]:
        """This rank's ``PipelineStage`` objects, in the order they were given."""
        return list(self._stages)

    @property
    def runs_backward(self) -> bool:
        """Whether a step runs the plan's backward actions (False for a forward-only plan)."""
        return bool(self._has_backward)

    @contextmanager
    def metadata_inference(self) -> Iterator[None]:
        """Wraps torch's stage initialization, which on the first step infers shapes by running the stages on
        placeholder data. An override point; does nothing here."""
        yield

    @property
    def needs_metadata_inference(self) -> bool:
        """Whether torch's next stage initialization infers shapes: on the first run, and after a switch between
        training and forward-only runs (torch's own test in ``_initialize_pp_stages``)."""
        return not self._stages_forward_initialized or self._has_backward != self._stages_backward_initialized

    def _initialize_stages(self, *args: Any, **kwargs: Any) -> None:
        # torch calls this before every step and returns at once when the stages are initialized; the wrapper
        # runs only when it infers, since entering it costs (stand-in weights for every sharded stage)
        if not self.needs_metadata_inference:
            super()._initialize_stages(*args, **kwargs)
            return
        # the placeholders are uninitialised memory (NaN where `torch.use_deterministic_algorithms` fills it):
        # anomaly detection (`Trainer(detect_anomaly=True)`) would stop at the inference's discarded backward
        with self.metadata_inference(), torch.autograd.set_detect_anomaly(False):
            super()._initialize_stages(*args, **kwargs)

    def run_microbatches(
        self,
        arg_mbs: list[tuple[Any, ...]] | None,
        kwarg_mbs: list[dict[str, Any]] | None,
        target_mbs: list[torch.Tensor],
    ) -> None:
        """Run this rank's action list once over micro-batches the caller split (any structure, not only
        tensors, unlike torch's ``step``, which splits a batch itself)."""
        for stage in self._stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
            # torch checks every micro-batch's stage inputs and outputs against the inferred shapes only under
            # TORCH_DISTRIBUTED_DEBUG=DETAIL; unchecked, an output of another shape reaches the next rank in a
            # buffer of the inferred shape, partly stale: silently wrong (a forward-only step never notices)
            stage._runtime_validate = True
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, None, return_outputs=False)


@contextmanager
def hooked_runtime(
    runtime: PipelineScheduleRuntime,
    *,
    action_range: Callable[[Callable[[str], Any]], Callable[[str], Any]],
    p2p_wait: Callable[[Callable[..., Any]], Callable[..., Any]],
    weight_wait: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> Iterator[None]:
    """For the duration of the block, route three points of torch's runtime through wrappers.

    Each argument receives torch's original and returns its replacement: ``action_range`` wraps the
    ``record_function("PP:<action>")`` range torch opens around every action, ``p2p_wait`` the wait for a
    batch of point-to-point transfers, ``weight_wait`` the wait for a stage's weight all-gather
    (``runtime._assert_unsharded``, on this runtime only). torch offers no callback at these points; the first
    two are globals of ``torch.distributed.pipelining.schedules`` and are restored when the block ends.
    """
    originals = (_torch_schedules.record_function, _torch_schedules._wait_batch_p2p)
    _torch_schedules.record_function = action_range(originals[0])
    _torch_schedules._wait_batch_p2p = p2p_wait(originals[1])
    runtime._assert_unsharded = weight_wait(runtime._assert_unsharded)  # type: ignore[method-assign]
    try:
        yield
    finally:
        _torch_schedules.record_function, _torch_schedules._wait_batch_p2p = originals
        del runtime._assert_unsharded


def runtime_is_hooked() -> bool:
    """Whether torch's runtime globals are replaced (tests: tracing hooks only traced steps, then restores)."""
    return _torch_schedules.record_function is not _RECORD_FUNCTION or _torch_schedules._wait_batch_p2p is not _WAIT_P2P


@contextmanager
def instance_attributes(module: nn.Module, **attrs: Any) -> Iterator[None]:
    """Give one module instance other attributes (e.g. ``forward``, ``log``) for the duration of the block.

    Set with ``object.__setattr__`` because ``nn.Module.__setattr__`` would register a module or parameter
    value and must not run here; removed from the instance ``__dict__`` afterwards, which uncovers the class's
    own methods again.
    """
    for name, value in attrs.items():
        object.__setattr__(module, name, value)
    try:
        yield
    finally:
        for name in attrs:
            module.__dict__.pop(name, None)


class ReduceScatterOn(_FSDPReduceScatter):
    """FSDP2's reduce-scatter issued on another process group over the same ranks (``set_custom_reduce_scatter``):
    reductions running on a communication thread must not share a group with the gathers of the main thread,
    or ranks could issue the two in different orders on one group."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False) -> Any:
        return super().__call__(output_tensor, input_tensor, self.group, op, async_op)


def start_gradient_reduction(module: Any) -> Callable[[], None]:
    """Start reducing an FSDP2 stage's gradients accumulated over the step's micro-batches, and reshard it; returns
    the wait, after which the gradients are complete (on CUDA: the compute stream waits for the reduction there,
    not before).

    torch ≥ 2.15: FSDP2's public manual finalization, as ``PipelineStage.start_gradient_reduction`` and
    ``wait_for_gradient_reduction`` use it (the stage's forward switched the module to it). Before: the private
    post-backward of every parameter group, with the root's final callback deferred to the wait
    (:func:`fsdp_post_backward`, :func:`fsdp_finish_backward`; the only reason those two still exist).
    """
    if MANUAL_BACKWARD_FINALIZATION:
        module.set_requires_gradient_sync(True)
        module.set_reshard_after_backward(True)
        handle = module.finalize_backward(async_op=True)

        def wait() -> None:
            handle.wait()
            module.set_manual_backward_finalization(False)  # as torch's stage does after its wait

        return wait
    fsdp_post_backward(module, final=False)
    return partial(fsdp_finish_backward, module)


def reduce_gradients(module: Any) -> None:
    """:func:`start_gradient_reduction` and its wait, at once (a communication thread's whole job)."""
    start_gradient_reduction(module)()


def fsdp_post_backward(module: Any, *, final: bool = True) -> None:
    """torch < 2.15: what torch's ``REDUCE_GRAD`` does for an FSDP2 stage (``PipelineStage.perform_reduce_grad``):
    reduce the gradients accumulated over the step's micro-batches and reshard. ``final=False`` leaves out the
    root's final callback, which on CUDA makes the compute stream wait for the reduction (run it later with
    :func:`fsdp_finish_backward`). On torch ≥ 2.15 the stage's forward switches FSDP2 to manual finalization, under
    which that callback no longer ends the backward: use :func:`start_gradient_reduction`."""
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = _fsdp_state_of(module)
    for sub_state in state._state_ctx.all_states:
        for group in sub_state._fsdp_param_groups:
            group.post_backward()
    if final:
        state._root_post_backward_final_callback()


def fsdp_finish_backward(module: Any) -> None:
    """torch < 2.15: the root's end-of-backward callback: wait for the reductions (on the compute stream) and reset
    state."""
    _fsdp_state_of(module)._root_post_backward_final_callback()


def _fsdp_state_of(module: Any) -> Any:
    if isinstance(module, ReplicateModule):
        return replicate.state(module)
    return fully_shard.state(module)


def unflatten_mesh(mesh: Any, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """A 1-D DeviceMesh split into ``len(sizes)`` dimensions, row-major, sharing the root mesh (DeviceMesh's
    private ``_unflatten``; creates the new dimensions' process groups, a collective over the world)."""
    return mesh._unflatten(0, sizes, names)


def parameter_slots(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The module's own parameters by attribute name: ``nn.Module``'s registry itself, so assigning a slot
    replaces the Parameter the module computes with (without ``__setattr__``'s re-registration)."""
    return module._parameters  # type: ignore[return-value]


@contextmanager
def parameters_replaced(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Let ``module``'s own forward compute with ``tensors`` (e.g. a parameter passed through an autograd
    function) in place of its parameters of those names, for the duration of the block: the slots of
    :func:`parameter_slots`, restored afterwards."""
    slots = parameter_slots(module)
    saved = {name: slots[name] for name in tensors}
    slots.update(tensors)  # type: ignore[arg-type]
    try:
        yield
    finally:
        slots.update(saved)


def buffer_slots(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """The module's own buffers by attribute name, writable like :func:`parameter_slots`."""
    return module._buffers


# names of collective ops (functional and c10d spellings); not waits or autograd wrappers
_COLLECTIVES = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "all_to_all", "alltoall",
                "broadcast")  # fmt: skip


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives issued while active: torch's functional ones (``_c10d_functional.all_reduce``,
    DTensor's redistributions) and the ``c10d`` ones ``torch.distributed`` calls dispatch.
    (torch's ``CommDebugMode`` counts the same, but its module tracker refuses an input-gradient pass run with
    ``torch.autograd.grad``.)"""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace in ("_c10d_functional", "c10d_functional", "c10d") and any(
            kind in func.__name__ for kind in _COLLECTIVES
        ):
            self.count += 1
        return func(*args, **(kwargs or {}))


def backward_input(
    outputs: Sequence[torch.Tensor],
    output_grads: Sequence[torch.Tensor],
    inputs: Sequence[Any],
    weights: Sequence[torch.Tensor],
) -> list[dict[str, Any]]:
    """torch's input-gradient pass, as its runtime runs a ``BACKWARD_INPUT`` (``stage_backward_input``): the inputs'
    gradients land in their ``.grad``; returns what the weight pass needs (its ``param_groups``). It detaches
    ``outputs`` in place at the end, which a view refuses: pass tensors that are not views (a copy changes none of
    the intermediates it keeps)."""
    _, groups = _stage_backward_input(list(outputs), list(output_grads), list(inputs), iter(weights))
    return groups


def backward_weight(weights: Sequence[torch.Tensor], groups: list[dict[str, Any]]) -> None:
    """torch's weight-gradient pass of a ``BACKWARD_WEIGHT`` (``stage_backward_weight``) over :func:`backward_input`'s
    groups: the weights' gradients land in their ``.grad``."""
    _stage_backward_weight(iter(weights), groups)


def kept_for_weight_pass(groups: list[dict[str, Any]]) -> int:
    """Bytes :func:`backward_input` keeps for the weight pass: the gradients of the intermediate outputs that feed
    the weights (``param_groups[...]["grads"]``), each storage once."""
    storages: dict[int, int] = {}
    for group in groups:
        for grads in group.get("grads") or ():
            for grad in grads or ():
                if isinstance(grad, torch.Tensor):
                    storage = grad.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def default_store() -> Any:
    """The default process group's key-value store (the failure watchdog's channel, see failures.py)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def read_whole_dcp(reader: Any, planner: Any) -> dict[str, Any]:
    """Every entry of a DCP checkpoint, read on one process as saved (nested dicts, whole tensors), through
    ``reader`` and an :class:`EmptyStateDictLoadPlanner` ``planner`` (Lightning's consolidation does the same):
    ``dcp.load`` fills only the keys it is given."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    return state


__all__ = [
    "MANUAL_BACKWARD_FINALIZATION",
    "SUPPORTED_TORCH",
    "TORCH_REQUIREMENT",
    "TORCH_WAIT_ACTIONS",
    "_METADATA_FILENAME",
    "CollectiveCounter",
    "EmptyStateDictLoadPlanner",
    "PipelineRuntime",
    "PipelineScheduleRuntime",
    "ReduceScatterOn",
    "TorchAction",
    "TorchKind",
    "add_send_recv",
    "backward_input",
    "backward_weight",
    "buffer_slots",
    "check_torch_version",
    "default_store",
    "format_torch_schedule",
    "fsdp_finish_backward",
    "fsdp_post_backward",
    "hooked_runtime",
    "instance_attributes",
    "kept_for_weight_pass",
    "parameter_slots",
    "parameters_replaced",
    "private_api_problems",
    "read_whole_dcp",
    "reduce_gradients",
    "replicate",
    "runtime_is_hooked",
    "start_gradient_reduction",
    "torch_version",
    "tree_flatten",
    "tree_unflatten",
    "unflatten_mesh",
]
