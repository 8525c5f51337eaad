"""Every private Lightning and torchmetrics name lightning_bfpp relies on, in one place.

A Lightning strategy that runs backward itself must reach a few loop internals, and the logging of
torchmetrics objects computed on some ranks only must reach a metric's cached values. Importing and touching
them here, and only here, means a Lightning or torchmetrics upgrade breaks one file, and
``tests/unit/test_compat.py`` says which name moved. Kept apart from :mod:`lightning_bfpp.engine._compat` (torch's
names) so that the engine modules import without Lightning.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer import call as lightning_call
from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import Strategy
    from torch.distributed.device_mesh import DeviceMesh
    from torchmetrics import Metric

# a path argument as Lightning types it (str or os.PathLike)
PathLike = _PATH


# -- the training loop -----------------------------------------------------------------------------


def set_skip_backward(trainer: object, value: bool) -> None:
    """Tell Lightning's automatic optimization not to zero gradients or call backward after the step.

    The pipeline runs forward and backward inside ``training_step``; Lightning would otherwise zero the
    gradients right after it (see its ``_AutomaticOptimization`` closure). Lightning's own
    ``StochasticWeightAveraging`` callback uses the same switch.
    """
    trainer.fit_loop._skip_backward = value  # type: ignore[attr-defined]


def get_skip_backward(trainer: object) -> bool:
    return bool(trainer.fit_loop._skip_backward)  # type: ignore[attr-defined]


def call_callback_hooks(trainer: Trainer, hook: str, *args: Any) -> None:
    """Run ``hook`` on every callback, as Lightning's loops do (profiled, in callback order).

    The strategy runs backward itself, so it must call the hooks Lightning's backward would have called.
    """
    lightning_call._call_callback_hooks(trainer, hook, *args)


def call_module_hook(trainer: Trainer, hook: str, *args: Any) -> Any:
    """Run the LightningModule's ``hook``, as Lightning's loops do; returns what it returned."""
    return lightning_call._call_lightning_module_hook(trainer, hook, *args)


def should_accumulate(trainer: Trainer) -> bool:
    """Whether the running training batch is one of an accumulation window's batches before its last (Lightning's
    own decision, which also ends a window early at an epoch's last batch)."""
    return bool(trainer.fit_loop.epoch_loop._should_accumulate())


STOP, REQUEUE = 1, 2  # what a process asks of the others through the step's collective (bits)


def share_sigterm_through(
    trainer: Trainer, stop_agreed: Callable[[], bool], requeue_agreed: Callable[[], bool]
) -> Callable[[], int]:
    """Take SIGTERM, and SLURM's requeue signal, out of Lightning's per-rank hands and into the step's one
    collective; call once training has started. Returns what this process asks for (:data:`STOP` once it has
    received SIGTERM, :data:`REQUEUE` once it has received the requeue signal), for that collective to carry.

    Lightning (2.6) broadcasts a SIGTERM flag from rank 0 before every training batch on any multi-process
    strategy (one blocking collective per step); its signal handler broadcasts too, from whichever rank the
    signal reached, at whatever point it was interrupted; and the rank that received it raises right after its
    current batch, leaving the others waiting for it in the pipeline. Here the handler only notes the signal
    (and still stops the launcher's child processes, as Lightning's does). The per-batch check reads
    ``stop_agreed()``: whether any rank had noted it by the previous step's collective, which every rank reads
    alike. Then every rank marks the trainer as having received SIGTERM and raises Lightning's
    ``SIGTERMException`` at the same batch, as Lightning intends.

    Under ``SLURMEnvironment(auto_requeue=True)`` Lightning's handler of the requeue signal (``--signal=USR1@90``)
    saves a checkpoint inside the handler, on each rank wherever the signal interrupted it: a collective save
    that the other ranks, elsewhere in the step, never join. Here that handler only notes the signal too, and
    runs, Lightning's own, on every rank at the same batch boundary once ``requeue_agreed()``: the checkpoint
    (``hpc_ckpt_<n>.ckpt``) saved by every rank together, then ``scontrol requeue`` from global rank 0. There
    SIGTERM (Slurm ending a requeued or preempted job) also saves one, at the boundary where the ranks stop.
    """
    import signal
    import threading

    from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    connector = trainer._signal_connector  # type: ignore[attr-defined]
    noted = {STOP: False, REQUEUE: False}
    requeued = [False]
    environment = trainer._accelerator_connector.cluster_environment  # type: ignore[attr-defined]
    requeue_signal = getattr(environment, "requeue_signal", None)

    def check() -> None:
        if requeue_agreed() and not requeued[0]:
            requeued[0] = True
            connector._slurm_sigusr_handler_fn(requeue_signal, None)
        if stop_agreed():
            if requeue_signal is not None and environment.auto_requeue:  # ended or preempted: keep what was done
                trainer.save_checkpoint(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))
            connector.received_sigterm = True
            raise SIGTERMException()

    def note_stop(signum: int, _frame: Any) -> None:
        launcher = trainer.strategy.launcher
        if not noted[STOP] and launcher is not None:
            launcher.kill(signum)
        noted[STOP] = True

    def note_requeue(signum: int, _frame: Any) -> None:
        noted[REQUEUE] = True

    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = check  # type: ignore[method-assign]
    if threading.current_thread() is threading.main_thread():
        for signum, ours, theirs in (
            (signal.SIGTERM, note_stop, connector._sigterm_notifier_fn),
            (requeue_signal, note_requeue, connector._slurm_sigusr_handler_fn),
        ):
            handler = signal.getsignal(signum) if signum is not None else None
            if isinstance(handler, _HandlersCompose):
                handler.signal_handlers = [ours if h == theirs else h for h in handler.signal_handlers]
    return lambda: (STOP if noted[STOP] or connector.received_sigterm else 0) | (REQUEUE if noted[REQUEUE] else 0)


def request_train_dataloader(trainer: object) -> object:
    """The training DataLoader as the user defined it (before Lightning adds a distributed sampler)."""
    return _request_dataloader(trainer.fit_loop._data_source)  # type: ignore[attr-defined]


def prediction_lists(trainer: object) -> list[list[object]]:
    """The per-dataloader lists ``trainer.predict`` returns (the prediction loop's own, mutable in place)."""
    return trainer.predict_loop._predictions  # type: ignore[attr-defined]


def seen_batch_indices(dataloader: object) -> list[list[int]] | None:
    """Dataset indices of each batch a prediction dataloader produced (Lightning's index-recording sampler)."""
    return getattr(getattr(dataloader, "batch_sampler", None), "seen_batch_indices", None)


def attached_trainer(module: LightningModule) -> Trainer | None:
    """The Trainer a LightningModule is attached to, or None (``module.trainer`` raises when there is none)."""
    return module._trainer


# -- the strategy's inherited state ------------------------------------------------------------------


def setup_distributed(strategy: Strategy, first: Callable[..., Any] | None = None) -> None:
    """Lightning's process-group setup of a ``ParallelStrategy`` (seeds, environment, ``init_process_group``).

    ``first(backend, timeout, rank, world_size, device)``, where given, may initialize the default process group
    before, with what Lightning would pass: Lightning's own initialization then finds it done (under torchrun, the
    strategy's group on a store of its attempt: :mod:`lightning_bfpp.engine.restarts`)."""
    if first is not None:
        backend, timeout = strategy._get_process_group_backend(), strategy._timeout  # type: ignore[attr-defined]
        first(backend, timeout, strategy.global_rank, strategy.world_size, strategy.root_device)
    strategy._setup_distributed()  # type: ignore[attr-defined]


def set_device_mesh(strategy: Strategy, module: LightningModule, mesh: DeviceMesh) -> None:
    """Install ``mesh`` where ``ModelParallelStrategy.device_mesh`` and ``LightningModule.device_mesh`` read it."""
    strategy._device_mesh = mesh  # type: ignore[attr-defined]
    module._device_mesh = mesh


def stored_precision_plugin(strategy: Strategy) -> Precision | None:
    """The precision plugin the Trainer gave the strategy (None before it did)."""
    return strategy._precision_plugin


def store_precision_plugin(strategy: Strategy, plugin: Precision | None) -> None:
    strategy._precision_plugin = plugin


def replace_clip_grad_by_norm(plugin: Precision, clip: Callable[[Any, float], None]) -> None:
    """Make this plugin instance clip by norm with ``clip(optimizer, max_norm)``.

    Lightning clips by the norm of the gradients one rank holds, which under a pipeline is part of the
    model; its ``Precision.clip_grad_by_norm`` is the only point where the norm can be replaced, and the
    plugin class is the user's choice, so the method is replaced on the instance.
    """
    plugin.clip_grad_by_norm = clip  # type: ignore[method-assign]


def optimizers_to_device(optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> None:
    """Move optimizer states to ``device``, as Lightning's strategies do after restoring them."""
    _optimizers_to_device(optimizers, device)


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a ``LightningOptimizer`` (or ``optimizer`` itself)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


# -- torchmetrics ----------------------------------------------------------------------------------


def metric_step_value(metric: object) -> object:
    """A torchmetrics Metric's value from its last ``forward`` (what Lightning logs per step)."""
    return metric._forward_cache  # type: ignore[attr-defined]


def set_metric_step_value(metric: object, value: object, *, mark_updated: bool) -> None:
    """Set the per-step value Lightning will log for ``metric``; ``mark_updated`` tells torchmetrics that this
    rank's (empty) state takes part in ``compute`` on purpose, so it does not warn about a missing update."""
    metric._forward_cache = value  # type: ignore[attr-defined]
    if mark_updated:
        metric._update_count += 1  # type: ignore[attr-defined]


# what update()/forward() change in a Metric besides its registered states (`update_called` is derived from the
# count, a read-only property)
_METRIC_BOOKKEEPING = ("_update_count", "_computed", "_forward_cache")


def metric_state_snapshot(metric: Metric) -> dict[str, Any]:
    """A copy of everything ``update``/``forward`` change in a torchmetrics Metric: its registered states
    (``add_state``) and its bookkeeping (update count, cached results)."""
    state: dict[str, Any] = {}
    for name in metric._defaults:
        value = getattr(metric, name)
        state[name] = value.clone() if isinstance(value, torch.Tensor) else list(value)
    for name in _METRIC_BOOKKEEPING:
        if hasattr(metric, name):
            state[name] = getattr(metric, name)
    return state


def restore_metric_state(metric: Metric, snapshot: dict[str, Any]) -> None:
    """Undo updates made since :func:`metric_state_snapshot` (states through ``setattr``, bookkeeping directly)."""
    for name, value in snapshot.items():
        if name.startswith("_"):
            object.__setattr__(metric, name, value)
        else:
            setattr(metric, name, value)


__all__ = [
    "PathLike",
    "attached_trainer",
    "call_callback_hooks",
    "call_module_hook",
    "get_skip_backward",
    "lightning_call",
    "metric_state_snapshot",
    "metric_step_value",
    "optimizers_to_device",
    "prediction_lists",
    "replace_clip_grad_by_norm",
    "request_train_dataloader",
    "restore_metric_state",
    "seen_batch_indices",
    "set_device_mesh",
    "set_metric_step_value",
    "set_skip_backward",
    "setup_distributed",
    "should_accumulate",
    "store_precision_plugin",
    "stored_precision_plugin",
    "summarize_with",
    "unwrap_optimizer",
]


# -- checkpoint consolidation ----------------------------------------------------------------------


def load_distributed_checkpoint(folder: Any, *, weights_only: bool | None = None) -> dict[str, Any]:
    """A DCP checkpoint ``folder`` read whole on one process, as saved (the weights under ``"model"``), with the
    non-tensor state of its ``meta.pt``: Lightning's ``_load_distributed_checkpoint``, with ``weights_only``
    applied to every file (see :func:`lightning_bfpp.engine.checkpoint.read_whole`)."""
    from lightning_bfpp.engine.checkpoint import read_whole

    return read_whole(folder, weights_only=weights_only)


def consolidated_checkpoint(folder: Any, *, weights_only: bool | None = None) -> dict[str, Any]:
    """What ``python -m lightning.pytorch.utilities.consolidate_checkpoint`` writes for a DCP ``folder``."""
    from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint

    return _format_checkpoint(load_distributed_checkpoint(folder, weights_only=weights_only))


def summarize_with(callbacks: Any, summary: Any) -> None:
    """Make the trainer's model-summary callbacks (``ModelSummary``, ``RichModelSummary``) print ``summary``
    instead of summarizing the module they are given (their private ``_summary``)."""
    from lightning.pytorch.callbacks import ModelSummary

    for callback in callbacks:
        if isinstance(callback, ModelSummary):
            callback._summary = lambda trainer, pl_module: summary


def layer_sync(strategy: Strategy) -> object | None:
    """What ``Trainer(sync_batchnorm=True)`` gave the strategy (``TorchSyncBatchNorm``), else None."""
    return getattr(strategy, "_layer_sync", None)


def count_replicas_in_throughput(callbacks: Any, replicas: int) -> None:
    """Make ``ThroughputMonitor``'s global rates count each data-parallel replica's batch once.

    It multiplies a device's samples (batches, items) per second by ``trainer.world_size``; under the pipeline
    every device of a replica (its pipeline and tensor ranks) runs that replica's batch, so the world's rate is the
    device's times the replica count. Set on its ``Throughput`` objects (private ``_throughputs``), which the
    callback builds in its ``setup``, before the strategy's."""
    from lightning.pytorch.callbacks import ThroughputMonitor

    for callback in callbacks:
        if isinstance(callback, ThroughputMonitor):
            for throughput in callback._throughputs.values():
                throughput.world_size = replicas


def evaluation_loop(trainer: Trainer, step_name: str) -> Any:
    """The evaluation loop running ``step_name`` now (its ``batch_progress`` knows whether a batch is the last)."""
    from lightning.pytorch.trainer.states import TrainerFn

    if step_name == "predict_step":
        return trainer.predict_loop
    if step_name == "test_step":
        return trainer.test_loop
    if trainer.state.fn == TrainerFn.FITTING:
        return trainer.fit_loop.epoch_loop.val_loop
    return trainer.validate_loop


# -- weight averaging (lightning.pytorch.callbacks.WeightAveraging) ----------------------------------------------


def averaging_arguments(callback: Any) -> tuple[torch.device | int | None, bool, dict[str, Any]]:
    """What a ``WeightAveraging`` callback hands ``AveragedModel``: its ``device``, ``use_buffers`` and the rest
    (``avg_fn``, ``multi_avg_fn``), as its private attributes hold them."""
    return callback._device, callback._use_buffers, dict(callback._kwargs)


def average_model(callback: Any) -> Any:
    """The ``AveragedModel`` a ``WeightAveraging`` callback updates, swaps in for validation and saves."""
    return callback._average_model


def set_average_model(callback: Any, model: Any) -> None:
    callback._average_model = model


def find_last_checkpoints_with(choose: Callable[[set[str], Path, Callable[[str], bool]], set[str]]) -> None:
    """Make ``ModelCheckpoint``'s search for its last checkpoints (what ``ckpt_path="last"`` resolves among, by
    modification time) pass its findings, with the newest checkpoint saved at SLURM's requeue signal
    (``hpc_ckpt_<n>.ckpt``, which Lightning reads only for ``ckpt_path=None``), through
    ``choose(found, folder, is_last_name)`` when the trainer's strategy is a BFPPStrategy (one with
    ``resolves_last_checkpoints``). Installed once, on the class: Lightning resolves "last" before
    the strategy sees the trainer, and its private ``_find_last_checkpoints`` is the one place it looks."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    original = ModelCheckpoint._find_last_checkpoints
    if getattr(original, "bfpp_wrapped", False):
        return

    def find(self: ModelCheckpoint, trainer: Trainer) -> set[str]:
        found = original(self, trainer)
        if not getattr(trainer.strategy, "resolves_last_checkpoints", False):
            return found
        hpc = trainer._checkpoint_connector._hpc_resume_path  # type: ignore[attr-defined]
        if hpc is not None:  # saved at SLURM's requeue signal: newer than any other when a requeued job starts
            found = {*found, hpc}
        folder = Path(self._ModelCheckpoint__resolve_ckpt_dir(trainer))  # type: ignore[attr-defined]
        pattern = rf"^{self.CHECKPOINT_NAME_LAST}(-(\d+))?"

        def is_last(name: str) -> bool:
            path = Path(name)
            return path.suffix == self.FILE_EXTENSION and bool(re.match(pattern, path.stem))

        return choose(found, folder, is_last)

    find.bfpp_wrapped = True  # type: ignore[attr-defined]
    ModelCheckpoint._find_last_checkpoints = find  # type: ignore[method-assign]


def set_sampler_epoch(dataloader: object, epoch: int) -> None:
    """Lightning's ``set_epoch`` on a loader's sampler (and its batch sampler's), as its fit loop calls it."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    _set_sampler_epoch(dataloader, epoch)


def wrapped_sampler(wrapper: object) -> object:
    """The user's sampler inside Lightning's ``DistributedSamplerWrapper`` (it keeps it in its index dataset)."""
    return wrapper.dataset._sampler  # type: ignore[attr-defined]
