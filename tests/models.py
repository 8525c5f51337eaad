"""Small LightningModules and data shared by the multi-process tests and their one-device references.

Written as ordinary single-device Lightning code: the only addition for the pipeline is
``pipeline_layers()``. Everything is seeded so that the pipelined run and the reference start from
identical weights and see identical samples.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import (
    BasePredictionWriter,
    Checkpoint,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchmetrics.regression import MeanAbsoluteError


class Transpose(nn.Module):
    """A parameter-free layer whose output is a strided view."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1)


class Block(nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


@dataclass
class ModelSpec:
    in_dim: int = 6
    width: int = 16
    out_dim: int = 3
    num_blocks: int = 8
    lr: float = 1e-2
    seed: int = 0
    batch_format: str = "tuple"  # or "dict"
    optimizer: str = "adamw"  # or "sgd"
    log_extras: bool = True
    tie_blocks: bool = False  # share a weight between the first and last block (tied across stages)
    param_groups: int = 1  # 2: weights and the rest (norms, biases) in separate groups, different lr and decay
    metrics: bool = False  # torchmetrics MeanAbsoluteError logged from the training, validation and test steps
    strided: bool = False  # a last layer that transposes, and a loss whose gradient is expanded (stride 0)
    scheduler: str = "none"  # "step": StepLR stepped per optimizer step; "epoch": ExponentialLR per epoch
    # "labelled": predict_step also returns per-sample label strings and a batch-level constant
    predict_output: str = "tensors"
    # parameters (or modules, by name prefix) that do not train: requires_grad=False after construction
    frozen: tuple[str, ...] = ()
    log: bool = True  # False: the steps log nothing (`Trainer(barebones=True)` refuses `self.log`)


def is_frozen(name: str, frozen: Sequence[str]) -> bool:
    """Whether parameter ``name`` is one of ``frozen`` or inside a module named there."""
    return any(name == f or name.startswith(f + ".") for f in frozen)


class PipeNet(L.LightningModule):
    def __init__(self, **spec: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.spec = ModelSpec(**spec)
        s = self.spec
        self.lr = s.lr  # read by configure_optimizers, set by Lightning's learning-rate finders
        torch.manual_seed(s.seed)
        self.embed = nn.Linear(s.in_dim, s.width)
        self.blocks = nn.ModuleList([Block(s.width) for _ in range(s.num_blocks)])
        self.head = nn.Sequential(nn.LayerNorm(s.width), nn.Linear(s.width, s.out_dim))
        if s.tie_blocks:
            self.blocks[-1].up.weight = self.blocks[0].up.weight
        if s.metrics:
            self.train_mae, self.val_mae, self.test_mae = MeanAbsoluteError(), MeanAbsoluteError(), MeanAbsoluteError()
        if s.strided:
            self.transpose = Transpose()
        for name, param in self.named_parameters():
            if is_frozen(name, s.frozen):
                param.requires_grad_(False)

    def pipeline_layers(self) -> list[nn.Module]:
        tail = [self.transpose] if self.spec.strided else []
        return [self.embed, *self.blocks, self.head, *tail]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def _unpack(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.spec.batch_format == "dict":
            return batch["x"], batch["y"]
        return batch[0], batch[1]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = self._unpack(batch)
        out = self(x)
        if self.spec.strided:
            out = out.transpose(0, 1)  # undo the last layer's transpose: a strided view
            loss = F.mse_loss(out, y) + out.mean()  # .mean() hands back an expanded (stride-0) gradient
        else:
            loss = F.mse_loss(out, y)
        if not self.spec.log:
            return loss
        self.log("train_loss", loss, prog_bar=True)
        if self.spec.log_extras:
            self.log("samples", float(len(x)), reduce_fx="sum")
            self.log("max_err", (out - y).abs().max(), reduce_fx="max")
        if self.spec.metrics:
            self.train_mae(out, y)
            self.log("train_mae", self.train_mae, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = self._unpack(batch)
        out = self(x)
        self.log("val_loss", F.mse_loss(out, y), prog_bar=True)
        if self.spec.metrics:
            self.val_mae.update(out, y)
            self.log("val_mae", self.val_mae)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = self._unpack(batch)
        out = self(x)
        self.log("test_loss", F.mse_loss(out, y))
        if self.spec.metrics:
            self.test_mae(out, y)
            self.log("test_mae", self.test_mae)

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        x, _ = self._unpack(batch)
        out = self(x)
        prediction = {"prediction": out, "argmax": out.argmax(-1)}
        if self.spec.predict_output == "labelled":
            prediction["labels"] = [f"class {k}" for k in prediction["argmax"].tolist()]
            prediction["head"] = "pipenet-v1"
        return prediction

    def configure_optimizers(self) -> Any:
        s = self.spec
        if s.param_groups == 2:
            matrices = [p for p in self.parameters() if p.dim() >= 2]
            others = [p for p in self.parameters() if p.dim() < 2]
            params: Any = [{"params": matrices}, {"params": others, "lr": self.lr / 2, "weight_decay": 0.0}]
        else:
            params = self.parameters()
        if s.optimizer == "sgd":
            optimizer = torch.optim.SGD(params, lr=self.lr, momentum=0.9, weight_decay=0.01)
        else:
            optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=0.01)
        if s.scheduler == "step":
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
        if s.scheduler == "epoch":
            scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.7)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}
        return optimizer


@dataclass
class DataSpec:
    num_samples: int = 64
    seed: int = 1
    batch_format: str = "tuple"


class RegressionData(Dataset):
    """Random inputs and a fixed random nonlinear target; item ``i`` is the same on every process."""

    def __init__(self, spec: DataSpec, in_dim: int, out_dim: int) -> None:
        g = torch.Generator().manual_seed(spec.seed)
        self.x = torch.randn(spec.num_samples, in_dim, generator=g)
        w = torch.randn(in_dim, out_dim, generator=g)
        self.y = torch.tanh(self.x @ w) + 0.1 * torch.randn(spec.num_samples, out_dim, generator=g)
        self.format = spec.batch_format

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        if self.format == "dict":
            return {"x": self.x[i], "y": self.y[i], "index": torch.tensor(i)}
        return self.x[i], self.y[i]


@dataclass
class RunSpec:
    """One training run: the same spec drives the pipelined run and its one-device reference."""

    name: str
    strategy: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)
    local_batch_size: int = 8
    data_parallel_size: int = 1
    checks: list[str] = field(default_factory=list)
    resume_from: str | None = None  # a checkpoint path, relative to the launch's output folder
    reference: dict[str, Any] = field(default_factory=dict)  # RunSpec fields that differ for the reference
    # "package.module:function" building the LightningModule from this RunSpec instead of PipeNet
    model_factory: str | None = None
    # "package.module:function" building the training loader from (RunSpec, trainer) instead of a DataLoader
    loader_factory: str | None = None
    # the run is expected to raise: every rank records the exception instead of failing, and the next run goes on
    expect_error: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def load_factory(path: str) -> Any:
    """``"package.module:function"`` -> the function."""
    import importlib

    module_name, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


def make_model(run: RunSpec) -> L.LightningModule:
    if run.model_factory is not None:
        model = load_factory(run.model_factory)(run)
    else:
        spec = dict(run.model)
        spec.setdefault("batch_format", run.data.get("batch_format", "tuple"))
        model = PipeNet(**spec)
    return model


def make_model_as_the_run_does(run: RunSpec) -> L.LightningModule:
    """The module of ``run`` on one process, built as its pipelined run builds it: with the ``empty_init`` check on
    the meta device, every module then materialized from the seed and its name, as the strategy's ranks
    materialize theirs (so the reference starts where the run did without copying its weights). A run that loads
    pretrained weights (``pretrained:<path>``, written from the module built in memory) starts from those."""
    if "empty_init" not in run.checks or any(check.startswith("pretrained:") for check in run.checks):
        return make_model(run)
    from lightning_bfpp.engine.layers import materialize_whole

    with torch.device("meta"):
        model = make_model(run)
    materialize_whole(model, torch.device("cpu"))
    return model


def model_spec(run: RunSpec) -> ModelSpec:
    """The PipeNet fields of ``run.model`` (a model factory may take more keys)."""
    fields = ModelSpec.__dataclass_fields__
    return ModelSpec(**{k: v for k, v in run.model.items() if k in fields})


def make_dataset(run: RunSpec) -> RegressionData:
    model = model_spec(run)
    return RegressionData(DataSpec(**run.data), model.in_dim, model.out_dim)


# the rank that fails at each point of a save (see FailWhileSaving)
FAILING_RANK = {"plan": 1, "write": 1, "metadata": 0, "between_renames": 0, "after_renames": 0}


class FailWhileSaving(L.Callback):
    """``fail_save:<where>:<step>``: the checkpoint save after step ``step`` raises on one rank at one point.

    ``where``: ``plan`` (rank 1, in DCP's planning, before its own part of the staging folder exists),
    ``write`` (rank 1, in DCP's write; global rank 0 then takes 3 s to remove the staging folder, as a busy
    machine may make it: the other ranks must not stop it meanwhile), ``metadata`` (rank 0, writing ``meta.pt``
    after DCP wrote), ``between_renames`` (rank 0, at the swap's second rename: the previous checkpoint is
    ``<path>.old`` then), ``after_renames`` (rank 0, removing ``<path>.old`` once the new folder is in place).
    Armed in ``on_train_batch_end`` of that step, before ``ModelCheckpoint``'s (the Trainer runs checkpoint
    callbacks last); what it replaced is put back when the run ends, for the runs after it in these processes.
    """

    SLOW_CLEANUP_S = 3.0

    def __init__(self, where: str, step: int) -> None:
        if where not in FAILING_RANK:
            raise ValueError(f"unknown failure point {where!r}")
        self.where, self.step = where, step
        self._restore: list[tuple[Any, str, Any]] = []

    def _replace(self, owner: Any, name: str, value: Any) -> None:
        self._restore.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        from lightning_bfpp.engine.checkpoint import saving as checkpoint_saving

        rank, where = trainer.global_rank, self.where

        def fail(*_: Any, **__: Any) -> Any:
            raise OSError(f"injected failure ({where}) on rank {rank}")

        if rank == 0 and where == "write":
            rmtree = shutil.rmtree

            def slow_rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
                if str(path).endswith(".tmp"):
                    time.sleep(self.SLOW_CLEANUP_S)
                rmtree(path, *args, **kwargs)

            self._replace(shutil, "rmtree", slow_rmtree)
        if rank != FAILING_RANK[where]:
            return
        if where == "plan":
            self._replace(FileSystemWriter, "prepare_local_plan", fail)
        elif where == "write":
            self._replace(FileSystemWriter, "write_data", fail)
        elif where == "metadata":
            self._replace(checkpoint_saving, "_write_metadata", fail)
        elif where == "between_renames":
            rename = Path.rename

            def second_rename_fails(source: Path, target: Any) -> Any:
                target = Path(target)
                if source.name.endswith(".tmp") and target.with_name(target.name + ".old").exists():
                    fail()
                return rename(source, target)

            self._replace(Path, "rename", second_rename_fails)
        else:
            remove = checkpoint_saving._remove

            def old_stays(path: Path) -> None:
                staging = path.with_name(path.name.removesuffix(".old") + ".tmp")
                if path.name.endswith(".old") and path.exists() and not staging.exists():  # after the renames
                    fail()
                remove(path)

            self._replace(checkpoint_saving, "_remove", old_stays)

    def _put_back(self) -> None:
        while self._restore:
            owner, name, value = self._restore.pop()
            setattr(owner, name, value)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._put_back()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._put_back()


class CheckpointFolderAtStart(L.Callback):
    """``checkpoint_folder_at_start``: global rank 0 writes ``checkpoint_folder.json`` in the run's folder: what
    the folder it resumes from held at ``setup`` (before anything is loaded or saved; each checkpoint folder with
    its ``global_step``), and the step training resumed at."""

    def __init__(self, folder: Path, out: Path) -> None:
        self.folder, self.file = folder, out / "checkpoint_folder.json"
        self.record: dict[str, Any] = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.global_rank == 0:
            self.record["held"] = {
                p.name: torch.load(p / "meta.pt", weights_only=True)["global_step"]
                if (p / "meta.pt").is_file()
                else None
                for p in sorted(self.folder.iterdir())
            }

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            self.record["resumed_at"] = trainer.global_step
            self.file.write_text(json.dumps(self.record))


class SlowWrites(L.Callback):
    """``slow_writes:<seconds>``: every rank's DCP file write takes ``seconds`` longer (slow storage), and global
    rank 0 records in ``saves_seen.json``, at the start of each step (before the strategy's step boundary), the
    names in ``ckpts/each_step`` (the ``topk_every_step`` callback's folder)."""

    def __init__(self, seconds: float, out: Path) -> None:
        self.seconds, self.seen = seconds, []
        self.folder, self.file = out / "ckpts" / "each_step", out / "saves_seen.json"
        self.write_data = FileSystemWriter.write_data

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        write_data, seconds = self.write_data, self.seconds

        def slow(writer: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
            time.sleep(seconds)
            return write_data(writer, *args, **kwargs)

        FileSystemWriter.write_data = slow  # type: ignore[method-assign]

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank != 0:
            return
        names = sorted(p.name for p in self.folder.iterdir()) if self.folder.is_dir() else []
        self.seen.append({"step": trainer.global_step, "names": names})

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        FileSystemWriter.write_data = self.write_data  # type: ignore[method-assign]
        if trainer.global_rank == 0:
            self.file.write_text(json.dumps(self.seen))


class IndexedPredictionWriter(BasePredictionWriter):
    """Writes each batch's predictions with the dataset indices Lightning recorded for them."""

    def __init__(self, folder: Path) -> None:
        super().__init__(write_interval="batch")
        self.folder = folder

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.save((batch_indices, prediction), self.folder / f"rank{trainer.global_rank}_batch{batch_idx}.pt")


class SyncedLogs(L.Callback):
    """Logs with ``sync_dist=True`` from epoch hooks, on every rank, as user code may do anywhere."""

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.log("ranks_reporting", 1.0, sync_dist=True, reduce_fx="sum")
        pl_module.log("epoch_lr", trainer.optimizers[0].param_groups[0]["lr"], sync_dist=True)


def make_callbacks(run: RunSpec, out: Path) -> tuple[list[L.Callback], dict[str, Any]]:
    """The callbacks (and Trainer arguments) a run's ``checks`` ask for; shared by the pipeline and reference."""
    callbacks: list[L.Callback] = []
    kwargs: dict[str, Any] = {}
    checks = set(run.checks)
    for check in run.checks:
        if check.startswith("fail_save:"):
            _, where, step = check.split(":")
            callbacks.append(FailWhileSaving(where, int(step)))
    # "save_beside_resumed": the checkpoints go to the folder of the one resumed from (the same `last.ckpt`)
    ckpts = (out.parent / run.resume_from).parent if "save_beside_resumed" in checks else out / "ckpts"
    if "checkpoint_folder_at_start" in checks:
        callbacks.append(CheckpointFolderAtStart((out.parent / str(run.resume_from)).parent, out))
    if "last_checkpoint_every_step" in checks:
        callbacks.append(ModelCheckpoint(dirpath=ckpts, every_n_train_steps=1, save_top_k=0, save_last=True))
    if "topk_every_step" in checks:  # keeps the newest only: each save removes the one before
        callbacks.append(ModelCheckpoint(dirpath=ckpts / "each_step", filename="{step}", every_n_train_steps=1))
    for check in run.checks:
        if check.startswith("slow_writes:"):
            callbacks.append(SlowWrites(float(check.split(":")[1]), out))
    if "stop_on_non_finite_loss" in checks:
        callbacks.append(EarlyStopping(monitor="train_loss", check_finite=True, patience=1000))
    if "early_stopping" in checks:
        callbacks.append(EarlyStopping(monitor="val_loss", patience=0, min_delta=0.02))
    if "top_k" in checks:
        callbacks.append(
            ModelCheckpoint(dirpath=out / "topk", monitor="val_loss", save_top_k=2, filename="{epoch}-{val_loss:.5f}")
        )
    if "lr_monitor" in checks:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    if "csv_logger" in checks or "lr_monitor" in checks:
        kwargs["logger"] = CSVLogger(out, name="logs", version=0)
    if "prediction_writer" in checks:
        callbacks.append(IndexedPredictionWriter(out / "written"))
    if "synced_logs" in checks:
        callbacks.append(SyncedLogs())
    if "swa" in checks:
        callbacks.append(StochasticWeightAveraging(swa_lrs=1e-2))
    for check in run.checks:  # "ema" or "ema:<decay>:<update_every_n_steps>:<update_starting_at_step>"
        if check == "ema" or check.startswith("ema:"):
            from lightning.pytorch.callbacks import EMAWeightAveraging

            given = check.split(":")[1:]
            decay, every, start = given + ["0.9", "1", ""][len(given) :]
            callbacks.append(
                EMAWeightAveraging(
                    decay=float(decay),
                    update_every_n_steps=int(every),
                    update_starting_at_step=int(start) if start else None,
                )
            )
    if "average" in checks:  # an equal average of every step's weights (SWA's), Lightning's default
        from lightning.pytorch.callbacks import WeightAveraging

        callbacks.append(WeightAveraging())
    if "progress_bar" in checks:
        kwargs["enable_progress_bar"] = True
    from tests.lightning_features import feature_callbacks

    more, more_kwargs = feature_callbacks(checks, out)
    callbacks += more
    kwargs.update(more_kwargs)
    if any(isinstance(c, Checkpoint) for c in callbacks):  # ModelCheckpoint, OnExceptionCheckpoint
        kwargs["enable_checkpointing"] = True
    return callbacks, kwargs


def eval_loader(run: RunSpec, batch_size: int, seed: int) -> DataLoader:
    spec = DataSpec(**{**run.data, "seed": seed, "num_samples": 32})
    model = model_spec(run)
    return DataLoader(RegressionData(spec, model.in_dim, model.out_dim), batch_size=batch_size)


def after_fit(
    trainer: L.Trainer, model: L.LightningModule, run: RunSpec, batch_size: int, loader: Any = None
) -> dict[str, Any]:
    """Test and predict after training when the run asks for it; what every rank got back."""
    from tests.lightning_features import feature_extras

    out: dict[str, Any] = feature_extras(trainer, model, loader, set(run.checks))
    if "test" in run.checks:
        out["test"] = trainer.test(model, eval_loader(run, batch_size, seed=3), verbose=False)
    if "markers" in run.checks:  # tests.probe_models.MarkerNet
        out["markers"] = model.marker_report()
    if "predict" in run.checks:
        # the per-replica batch size on every strategy, so one device yields the same batches
        # a model of its own predicts on its own data
        data = loader if run.loader_factory is not None else eval_loader(run, run.local_batch_size, seed=4)
        predictions = trainer.predict(model, data)
        out["predict"] = predictions
    return out


def assert_same_predictions(got: Any, want: Any, tol: float, where: str = "predictions") -> None:
    """``trainer.predict``'s result has one device's structure and types; float tensors agree within ``tol``."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} vs {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert (got.shape, got.dtype) == (want.shape, want.dtype), f"{where}: {got.shape} vs {want.shape}"
        if want.is_floating_point():
            torch.testing.assert_close(got, want, rtol=tol, atol=1e-6, msg=lambda m: f"{where}: {m}")
        else:
            assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            assert_same_predictions(got[key], want[key], tol, f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: {len(got)} items vs {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_predictions(g, w, tol, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"


def trainer_defaults(run: RunSpec) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "max_steps": 6,
        "log_every_n_steps": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    if "validate" not in run.checks:
        kwargs["limit_val_batches"] = 0
    kwargs.update(run.trainer)
    return kwargs


def gradient_norm(trainer: L.Trainer) -> float:
    """The whole model's gradient norm, on any strategy (the pipeline's must be reduced over its ranks)."""
    strategy = trainer.strategy
    if hasattr(strategy, "gradient_norm"):
        return float(strategy.gradient_norm())
    grads = [p.grad for p in trainer.lightning_module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads))


class StepRecorder(L.Callback):
    """Records, on this rank, what each training step logged and returned, and each validation's metrics."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.validations: list[dict[str, float]] = []
        self._grad_norm: float | None = None

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._grad_norm = gradient_norm(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.validations.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")})

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        record = {
            "step": trainer.global_step,
            "returned_loss": float(loss),
            "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "progress_bar": {k: float(v) for k, v in trainer.progress_bar_metrics.items()},
            "lrs": [group["lr"] for group in trainer.optimizers[0].param_groups],
            "grad_norm": self._grad_norm,
        }
        self._grad_norm = None
        if isinstance(batch, dict) and "index" in batch:
            record["indices"] = batch["index"].tolist()
        if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
            record["batch_shape"] = list(batch["input_ids"].shape)
        self.steps.append(record)


@dataclass
class Reference:
    """What one-device training of a run produced."""

    steps: list[dict[str, Any]]
    params: dict[str, torch.Tensor]
    validations: list[dict[str, float]]
    extras: dict[str, Any]


def reference_run(
    run: RunSpec, save_to: str | None = None, resume_from: str | None = None, out: Path | None = None
) -> Reference:
    """Train ``run`` on one process with ``strategy="auto"`` on the global batch.

    Lightning shuffles a distributed training set with ``DistributedSampler(shuffle=True, seed=0)``; the k-th
    global batch of the data-parallel replicas together is the k-th slice of that permutation, which is
    what this sampler gives one process with the global batch size.
    """
    ref = RunSpec(**{**run.to_json(), **run.reference})
    model = make_model_as_the_run_does(ref)
    data = make_dataset(ref)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    batch = ref.local_batch_size * ref.data_parallel_size
    loader = DataLoader(data, batch_size=batch, sampler=sampler)
    recorder = StepRecorder()
    out = out or Path(tempfile.mkdtemp(prefix="reference-"))
    callbacks, extra_kwargs = make_callbacks(ref, out)
    kwargs = {**trainer_defaults(ref), **extra_kwargs}
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="auto", callbacks=[recorder, *callbacks], **kwargs)
    val = eval_loader(ref, batch, seed=2) if "validate" in ref.checks else None
    fit(trainer, model, loader, val, ref, resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    extras = after_fit(trainer, model, ref, batch, loader)
    extras["counters"] = {"global_step": trainer.global_step, "current_epoch": trainer.current_epoch}
    extras["out"] = out
    params = {k: v.detach().clone() for k, v in model.state_dict().items() if "mae" not in k}
    return Reference(recorder.steps, params, recorder.validations, extras)


def fit_on_one_device(model: L.LightningModule, data: Dataset, run: RunSpec) -> Reference:
    """``model`` trained on ``data`` on one process with ``strategy="auto"`` on ``run``'s global batches, in the
    order the replicas' distributed sampler takes them (see :func:`reference_run`)."""
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=run.local_batch_size * run.data_parallel_size, sampler=sampler)
    recorder = StepRecorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="auto", callbacks=[recorder], **trainer_defaults(run))
    trainer.fit(model, loader)
    params = {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}
    return Reference(recorder.steps, params, recorder.validations, {"out": Path(tempfile.gettempdir())})


def fit(trainer: L.Trainer, model: L.LightningModule, loader: Any, val: Any, run: RunSpec, ckpt: str | None) -> None:
    """``trainer.fit`` (after a tuner when the run asks for one), and with the ``fit_twice`` check a second ``fit``
    for one more epoch on the same Trainer."""
    from tests.lightning_features import tune_before_fit

    tune_before_fit(trainer, model, loader, set(run.checks))
    trainer.fit(model, loader, val, ckpt_path=ckpt)
    if "fit_twice" in run.checks:
        trainer.fit_loop.max_epochs += 1
        trainer.fit(model, loader, val)
