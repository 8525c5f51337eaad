"""The Lightning callbacks, tuner calls and data modules that the rows of docs/lightning-features.md run, by
check name; shared by the pipelined runs and their one-device references (see ``models.make_callbacks``).

Each check builds the same callback on both sides, so a row's test compares like with like."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    BatchSizeFinder,
    DeviceStatsMonitor,
    GradientAccumulationScheduler,
    LambdaCallback,
    LearningRateFinder,
    ModelCheckpoint,
    ModelPruning,
    OnExceptionCheckpoint,
    RichModelSummary,
    RichProgressBar,
    SpikeDetection,
    ThroughputMonitor,
)
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader, DistributedSampler

# the learning-rate range both finders test: 16 steps, enough for Lightning's suggestion (it skips 10 + 1)
LR_RANGE = {"min_lr": 1e-3, "max_lr": 1.0}
LR_STEPS = 16
RAISE_AT_STEP = 3


def samples_in(batch: Any) -> int:
    return len(batch[0])


def log_steps_done(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    pl_module.log("steps_done", float(trainer.global_step), sync_dist=True)


class RaiseAtStep(L.Callback):
    """``raise_at_step``: every rank raises the same error after optimizer step ``RAISE_AT_STEP`` (as a user's
    interrupt or a callback's error reaches every process)."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == RAISE_AT_STEP:
            raise RuntimeError(f"stopped on purpose after step {RAISE_AT_STEP}")


class ModeProbe(L.Callback):
    """``modes``: the grad, inference, anomaly-detection and determinism modes each pipeline layer's forward
    ran under, per loop (``pl_module.bfpp_modes``): a Trainer option that never reaches the layers (which run
    inside the pipeline's schedule) shows here."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        seen: set[tuple[Any, ...]] = set()

        def record(*_: Any) -> None:
            loop = "train" if trainer.training else "validate" if trainer.validating else "other"
            seen.add(
                (
                    loop,
                    torch.is_grad_enabled(),
                    torch.is_inference_mode_enabled(),
                    torch.is_anomaly_enabled(),
                    torch.are_deterministic_algorithms_enabled(),
                )
            )

        self.handles = [layer.register_forward_hook(record) for layer in pl_module.pipeline_layers()]
        pl_module.bfpp_modes = seen

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for handle in self.handles:
            handle.remove()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # `Trainer(deterministic=True)` sets torch's process-wide flag and leaves it set: off again for the runs
        # and tests after this one in the same process
        torch.use_deterministic_algorithms(False)


class SampledData(L.LightningDataModule):
    """A training set whose loader the user builds in ``train_dataloader`` with their own sampler, as with
    ``use_distributed_sampler=False``: ``replicas`` shards it over the strategy's data-parallel replicas
    (``strategy.distributed_sampler_kwargs``), ``world`` over every process (wrong under a pipeline: its
    ranks would load different batches). Counts its loader requests (``reload_dataloaders_every_n_epochs``)."""

    def __init__(self, run: Any, shard_over: str) -> None:
        super().__init__()
        self.run, self.shard_over, self.requests = run, shard_over, 0

    def train_dataloader(self) -> DataLoader:
        from tests.models import make_dataset

        self.requests += 1
        strategy = self.trainer.strategy
        if self.shard_over == "replicas":
            where = strategy.distributed_sampler_kwargs
        else:
            where = {"num_replicas": self.trainer.world_size, "rank": self.trainer.global_rank}
        data = make_dataset(self.run)
        sampler = DistributedSampler(data, **where, shuffle=True, seed=0)
        return DataLoader(data, batch_size=self.run.local_batch_size, sampler=sampler)


def replica_sampled_data(run: Any, trainer: L.Trainer) -> SampledData:
    return SampledData(run, "replicas")


def world_sampled_data(run: Any, trainer: L.Trainer) -> SampledData:
    return SampledData(run, "world")


def feature_callbacks(checks: set[str], out: Path) -> tuple[list[L.Callback], dict[str, Any]]:
    """The callbacks and Trainer arguments of the feature table's checks."""
    callbacks: list[L.Callback] = []
    kwargs: dict[str, Any] = {}
    if "weights_only" in checks:
        callbacks.append(
            ModelCheckpoint(
                dirpath=out / "weights_only", save_weights_only=True, every_n_train_steps=3, save_top_k=0,
                save_last=True,
            )
        )  # fmt: skip
    if "accumulation_schedule" in checks:  # one batch per step in epoch 0, two from epoch 1
        callbacks.append(GradientAccumulationScheduler({0: 1, 1: 2}))
    if "device_stats" in checks:
        callbacks.append(DeviceStatsMonitor(cpu_stats=True))
    if "throughput" in checks:
        callbacks.append(ThroughputMonitor(batch_size_fn=samples_in, window_size=2))
    if "lambda" in checks:  # a hook given as a function: logs the step count, synced, at each epoch's end
        callbacks.append(LambdaCallback(on_train_epoch_end=log_steps_done))
    if checks & {"device_stats", "throughput", "lambda"}:
        kwargs["logger"] = CSVLogger(out, name="logs", version=0)
    if "rich" in checks:
        callbacks += [RichProgressBar(), RichModelSummary(max_depth=1)]
        kwargs.update(enable_progress_bar=True, enable_model_summary=True)
    if "spike" in checks:  # mode "max": any fall of the loss after the first step is a spike
        callbacks.append(SpikeDetection(mode="max", warmup=1, rtol=1e-9, exclude_batches_path=out / "skip.json"))
    if "on_exception_checkpoint" in checks:
        callbacks += [RaiseAtStep(), OnExceptionCheckpoint(dirpath=out / "on_exception", filename="interrupted")]
    if "lr_finder" in checks:
        callbacks.append(LearningRateFinder(**LR_RANGE, num_training_steps=LR_STEPS, update_attr=True))
    if "modes" in checks:
        callbacks.append(ModeProbe())
    if "pruning" in checks:
        callbacks.append(ModelPruning("l1_unstructured", amount=0.5))
    if "backbone_finetuning" in checks:
        callbacks.append(BackboneFinetuning(unfreeze_backbone_at_epoch=1))
    if "batch_size_finder" in checks:
        callbacks.append(BatchSizeFinder())
    if checks & {"lr_finder", "tuner_lr_find"}:
        kwargs["default_root_dir"] = out  # the finders' temporary checkpoint
    return callbacks, kwargs


def tune_before_fit(trainer: L.Trainer, model: L.LightningModule, loader: Any, checks: set[str]) -> None:
    """``tuner_lr_find``: ``Tuner.lr_find`` before ``fit``, setting the module's ``lr`` to its suggestion;
    ``tuner_scale_batch_size``: ``Tuner.scale_batch_size`` (Lightning refuses it for distributed strategies)."""
    if "tuner_scale_batch_size" in checks:
        Tuner(trainer).scale_batch_size(model, train_dataloaders=loader)
    if "tuner_lr_find" in checks:
        found = Tuner(trainer).lr_find(model, train_dataloaders=loader, **LR_RANGE, num_training=LR_STEPS)
        assert found is not None
        model.bfpp_lr_found = {"losses": found.results["loss"], "suggestion": found.suggestion()}


def feature_extras(trainer: L.Trainer, model: L.LightningModule, loader: Any, checks: set[str]) -> dict[str, Any]:
    """What the feature checks recorded on this rank, for the test to compare with one device."""
    out: dict[str, Any] = {}
    if checks & {"lr_finder", "tuner_lr_find"}:
        out["lr"] = model.lr
        finder = next((c for c in trainer.callbacks if isinstance(c, LearningRateFinder)), None)
        if finder is not None and (found := finder.optimal_lr) is not None:
            out["lr_found"] = {"losses": found.results["loss"], "suggestion": found.suggestion()}
        elif hasattr(model, "bfpp_lr_found"):
            out["lr_found"] = model.bfpp_lr_found
    if "modes" in checks:
        out["modes"] = sorted(model.bfpp_modes)
    if isinstance(loader, SampledData):
        out["loader_requests"] = loader.requests
    return out
