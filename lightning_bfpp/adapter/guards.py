"""What the strategy refuses, checked up front on every rank, each with the reason and the fix.

Arguments when the strategy is built; the precision plugin when the Trainer is; ``sync_batchnorm``, a
``CheckpointIO`` plugin and the Trainer's callbacks before the callbacks' own ``setup`` (so that none acts on
the whole module first); the module's optimization mode at set-up; torchmetrics that would sync inside a step
while the layers are split; parameters that ``configure_model`` untied by splitting their users one by one.
(Collectives called from inside a step are refused where they are called: see ``user_step.collective_refusal``.)
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import (
    BaseFinetuning,
    BatchSizeFinder,
    ModelPruning,
    StochasticWeightAveraging,
    WeightAveraging,
)
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import nn
from torchmetrics import Metric

SUPPORTED_PRECISION = {
    Precision: ("32-true",),
    MixedPrecision: ("bf16-mixed",),
    HalfPrecision: ("bf16-true", "16-true"),
    DoublePrecision: ("64-true",),
}


def check_arguments(
    overlap_reductions: Any,
    trace_steps: Any,
    failure_timeout: Any,
    memory_budget: Any = None,
    async_checkpoint: Any = False,
) -> None:
    if not isinstance(async_checkpoint, bool):
        raise ValueError(f"BFPPStrategy: `async_checkpoint` must be True or False, got {async_checkpoint!r}.")
    if not isinstance(overlap_reductions, bool) and overlap_reductions not in ("auto", "stream", "thread"):
        raise ValueError(
            "BFPPStrategy: `overlap_reductions` must be a bool, 'auto', 'stream' or 'thread', got"
            f" {overlap_reductions!r}."
        )
    if isinstance(trace_steps, bool) or not isinstance(trace_steps, int) or trace_steps < 1:
        raise ValueError(f"BFPPStrategy: `trace_steps` must be a positive int, got {trace_steps!r}.")
    if failure_timeout is not None and (
        isinstance(failure_timeout, bool) or not isinstance(failure_timeout, (int, float)) or failure_timeout <= 0
    ):
        raise ValueError(
            f"BFPPStrategy: `failure_timeout` must be a positive number of seconds or None, got {failure_timeout!r}."
        )
    if memory_budget is not None and (
        isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget <= 0
    ):
        raise ValueError(
            "BFPPStrategy: `memory_budget` is the bytes per device the planner's choice must fit in: a positive int"
            f" (e.g. 40 * 2**30) or None, got {memory_budget!r}."
        )


def check_precision(plugin: Precision) -> None:
    """Refuse precisions the pipeline cannot honour, when the Trainer is built, on every rank."""
    name = getattr(plugin, "precision", None)
    if name == "16-mixed":
        raise ValueError(
            "BFPPStrategy does not support `precision='16-mixed'`: its gradient scaler scales the loss in"
            " Lightning's backward, which the pipeline replaces, and would skip steps on some pipeline ranks"
            " only. Use `precision='bf16-mixed'` (no scaler needed), 'bf16-true' or '32-true'."
        )
    allowed = SUPPORTED_PRECISION.get(type(plugin))
    if allowed is None or name not in allowed:
        supported = ", ".join(p for names in SUPPORTED_PRECISION.values() for p in names)
        raise ValueError(
            f"BFPPStrategy does not support the precision plugin {type(plugin).__name__}"
            f" (precision={name!r}); choose one of: {supported}."
        )


def check_callbacks(callbacks: list[Any]) -> None:
    """Refuse the callbacks that act on the whole model or change which parameters train after the stages are
    placed, naming what to use instead; on every rank, before any callback's ``setup`` and any collective.
    (The table of every Lightning callback and what it does here: docs/lightning-features.md.)"""
    for callback in callbacks:
        name = type(callback).__name__
        if isinstance(callback, StochasticWeightAveraging):
            raise RuntimeError(
                "BFPPStrategy cannot run StochasticWeightAveraging: it switches Lightning's own backward back on"
                " and recomputes BatchNorm statistics with whole-model forwards, while the pipeline runs forward and"
                " backward itself over stages spread across ranks. Use `WeightAveraging` (an equal average, as SWA"
                " keeps) or `EMAWeightAveraging` instead: both average each rank's own stages under BFPPStrategy."
            )
        if isinstance(callback, BaseFinetuning):
            raise RuntimeError(
                f"BFPPStrategy cannot run {name} (a BaseFinetuning callback): it freezes modules when fit starts"
                " and unfreezes them later into a new optimizer parameter group, while the pipeline fixes at set-up"
                " which parameters each rank trains and shards their gradients and optimizer state. Freeze in the"
                " module instead (`requires_grad_(False)` before fit), and train the unfrozen phase as a new fit of"
                " a module that starts from the first phase's checkpoint (`lightning_bfpp.load_pretrained`)."
            )
        if isinstance(callback, ModelPruning):
            raise RuntimeError(
                "BFPPStrategy cannot run ModelPruning: it re-registers each pruned weight as `<name>_orig` with a"
                " mask during fit, while the pipeline holds each rank's parameters as FSDP2 shards that the"
                " optimizer steps; a global threshold would also rank weights that live on other pipeline ranks."
                " Prune after training, on one device: a consolidated checkpoint or the model from"
                " `export_pretrained` with `torch.nn.utils.prune`."
            )
        if isinstance(callback, BatchSizeFinder):
            raise RuntimeError(
                f"BFPPStrategy cannot run {name}: it grows the batch until a step runs out of memory, and under the"
                " pipeline that error hits one rank while the others wait for its transfers. Set the batch size"
                " yourself; `BFPPStrategy(schedule='auto', memory_budget=<bytes per device>)` chooses a layout"
                " whose estimate fits that budget for it."
            )
    averaging = [type(c).__name__ for c in callbacks if isinstance(c, WeightAveraging)]
    if len(averaging) > 1:
        raise RuntimeError(
            f"BFPPStrategy runs one weight-averaging callback, got {len(averaging)} ({', '.join(averaging)}): each"
            " would put its own average under the checkpoint's `state_dict` and the other's as the trained"
            " weights. Keep one."
        )


def check_layer_sync(layer_sync: object | None) -> None:
    """Refuse ``Trainer(sync_batchnorm=True)``: SyncBatchNorm's forward is a collective over every process, which
    only the ranks running that stage reach (lightning_bfpp.engine.layers.check_no_collective_layers)."""
    if layer_sync is not None:
        raise ValueError(
            "BFPPStrategy does not support `Trainer(sync_batchnorm=True)`: SyncBatchNorm's forward is a collective"
            " that only the ranks running its stage reach. Remove it; BatchNorm's statistics then cover each"
            " micro-batch (the strategy warns which layers), or use LayerNorm or GroupNorm, which do not depend on"
            " how the batch is split."
        )


def check_checkpoint_io(checkpoint_io: object) -> None:
    """Refuse a ``CheckpointIO`` plugin (``Trainer(plugins=[AsyncCheckpointIO()])``, a storage one): checkpoints
    are written by torch.distributed.checkpoint, each rank its own shards, so the plugin would never be used."""
    from lightning.fabric.plugins import TorchCheckpointIO

    if type(checkpoint_io) is not TorchCheckpointIO:
        raise ValueError(
            f"BFPPStrategy does not use CheckpointIO plugins, got {type(checkpoint_io).__name__}: every rank writes"
            " its own shards of a checkpoint with torch.distributed.checkpoint, which the plugin would never see."
            " Remove it from `Trainer(plugins=...)` and save to a path every process can write (a local or shared"
            " file system)."
        )


def check_optimization(module: Any) -> None:
    """Refuse Lightning's own backward (manual optimization): at set-up, on every rank, before any collective of
    the pipeline's. (The callbacks were checked earlier, in ``setup_environment``: :func:`check_callbacks`.)"""
    if not module.automatic_optimization:
        raise RuntimeError(
            "BFPPStrategy runs forward and backward inside the pipeline and needs automatic optimization;"
            " remove `self.automatic_optimization = False` and `manual_backward` from the module."
        )


def check_metrics(module: nn.Module) -> None:
    """Refuse torchmetrics that sync inside every step: only some ranks run a step's code, the sync would hang."""
    for name, metric in module.named_modules():
        if isinstance(metric, Metric) and metric.dist_sync_on_step:
            raise ValueError(
                f"BFPPStrategy: the metric `{name}` has `dist_sync_on_step=True`. Under the pipeline a step's metric"
                " code runs on the last stage's ranks only, where a sync would wait forever for the others. Drop"
                " `dist_sync_on_step`: a metric logged with `self.log(name, metric)` shows the step value of the"
                " global batch anyway (step values are reduced over data-parallel replicas), and its epoch value"
                " is synced by Lightning."
            )


def shared_parameters(module: nn.Module) -> list[tuple[str, ...]]:
    """The names of each Parameter the module uses under several names (tied weights), before
    ``configure_model`` runs."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [tuple(group) for group in names.values() if len(group) > 1]


def check_ties_kept(before: list[tuple[str, ...]], module: nn.Module, tensor_parallel_size: int) -> None:
    """Refuse weights tied before ``configure_model`` and separate after it, under tensor parallelism:
    ``parallelize_module`` on each user of a tied weight gives each its own split copy, and the model would
    train untied, silently different from one device. (Per layer, after the split, the pipeline keeps ties.)"""
    if tensor_parallel_size == 1:
        return
    now = dict(module.named_parameters(remove_duplicate=False))
    for names in before:
        if all(n in now for n in names) and len({id(now[n]) for n in names}) > 1:
            raise ValueError(
                f"BFPPStrategy: `{'`, `'.join(names)}` were one tied Parameter before `configure_model` and are"
                " separate after it: tensor-parallelising each user there gives each its own copy, so they"
                " would train untied. Parallelise the layers in `parallelize_layer(layer, tp_mesh)` or with"
                " `parallelize_fn=` instead (the pipeline keeps ties and checks that every copy is split alike),"
                " or untie them."
            )
