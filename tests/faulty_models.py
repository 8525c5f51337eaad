"""PipeNet variants that fail on purpose: bad ``pipeline_layers()``, bad steps, errors and kills on one rank.

``RunSpec.model_factory = "tests.faulty_models:faulty"`` with ``model={"fault": NAME, "fault_rank": R,
"fault_step": S, ...}``; the other ``model`` keys go to PipeNet. Each fault mimics a mistake a user makes or a
failure a cluster has; the tests check that every rank reports it with one message and none hangs.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanAbsoluteError

from tests.models import PipeNet, RunSpec


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class Faulty(nn.Module):
    """Wraps a layer; on ``rank`` at training step ``step`` its forward does ``fault``, otherwise passes through."""

    def __init__(self, layer: nn.Module, fault: str, rank: int, step: int, clock: dict[str, int]) -> None:
        super().__init__()
        self.layer = layer
        self.fault, self.fault_rank, self.fault_step, self.clock = fault, rank, step, clock
        self.calls = 0

    def forward(self, x: torch.Tensor) -> Any:
        out = self.layer(x)
        if self.fault_rank not in (-1, _rank()) or self.clock["step"] != self.fault_step:
            return out
        self.calls += 1
        if self.fault == "layer_raise":
            announce(self.fault)
            raise RuntimeError(f"injected failure in a layer's forward on rank {_rank()}")
        if self.fault == "layer_kill":
            announce(self.fault)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault == "layer_dict":
            return {"hidden": out}
        if self.fault == "layer_none":
            return None
        if self.fault == "layer_shape_varies":
            return out[: len(out) - self.calls % 2]  # every other micro-batch loses a row
        return out


def announce(fault: str) -> None:
    """Tell the test when the fault happened (it measures how long the others take to stop)."""
    sys.stderr.write(f"INJECTED {fault} on rank {_rank()} at {time.time():.3f}\n")
    sys.stderr.flush()


LAYER_FAULTS = ("layer_raise", "layer_kill", "layer_dict", "layer_none", "layer_shape_varies")


class FaultyNet(PipeNet):
    def __init__(self, fault: str, fault_rank: int = 0, fault_step: int = 1, **spec: Any) -> None:
        super().__init__(**spec)
        self.fault, self.fault_rank, self.fault_step = fault, fault_rank, fault_step
        self.clock = {"step": -1, "calls": 0}
        if fault in LAYER_FAULTS:  # one faulty layer in the first and one in the last stage
            for i in (1, len(self.blocks) - 2):
                self.blocks[i] = Faulty(self.blocks[i], fault, fault_rank, fault_step, self.clock)
        if fault == "metric_dist_sync_on_step":
            self.synced_mae = MeanAbsoluteError(dist_sync_on_step=True)
        if fault in ("metric_compute_in_step",):
            self.train_mae_metric = MeanAbsoluteError()
        self._calls = 0
        if fault == "no_layers_method":
            self.pipeline_layers = None  # type: ignore[assignment,method-assign]

    def pipeline_layers(self) -> Any:
        layers = super().pipeline_layers()
        if self.fault == "layers_empty":
            return []
        if self.fault == "layers_non_module":
            return [*layers[:2], torch.relu, *layers[2:]]
        if self.fault == "layers_twice":
            return [*layers, layers[1]]
        if self.fault == "layers_change":
            self._calls += 1
            return layers if self._calls % 2 else layers[:-1]
        if self.fault == "layers_generator":
            return iter(layers)
        return layers

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.clock["step"] = self.trainer.global_step

    def on_train_batch_end(self, *args: Any) -> None:
        if self.fault == "sigterm" and self.trainer.global_rank == self.fault_rank and self.trainer.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's preemption notice reaches one process

    def _here(self) -> bool:
        return self.trainer.global_rank == self.fault_rank and self.trainer.global_step == self.fault_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = self._unpack(batch)
        self.clock["calls"] += 1
        fault = self.fault
        if fault == "raise_train" and self._here():
            raise ValueError(f"injected failure in training_step on rank {self.trainer.global_rank}")
        if fault == "step_no_model":
            return F.mse_loss(self.head(x[:, :1].expand(-1, self.spec.width)), y)
        if fault == "step_string_input":
            return F.mse_loss(self(x, [f"sample {i}" for i in range(len(x))]), y)
        if fault == "all_gather_in_step":
            self.all_gather(x)
        if fault == "reduce_in_step":
            self.trainer.strategy.reduce(x.sum())
        out = self(x)
        if fault == "step_model_twice":
            out = out + self(x * 2)
        loss = F.mse_loss(out, y)
        if fault == "step_returns_none":
            return None  # type: ignore[return-value]
        if fault == "log_vector":
            self.log("per_output_error", (out - y).abs().mean(0))
        if fault == "log_reduce_fx_bad":
            self.log("median_loss", loss, reduce_fx=torch.median)
        if fault == "metric_compute_in_step":
            self.train_mae_metric.update(out, y)
            self.log("mae_so_far", self.train_mae_metric.compute())
        self.log("train_loss", loss)
        return loss

    def forward(self, x: torch.Tensor, *extra: Any) -> torch.Tensor:
        return super().forward(x)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.fault == "raise_val" and self.trainer.global_rank == self.fault_rank:
            raise ValueError(f"injected failure in validation_step on rank {self.trainer.global_rank}")
        super().validation_step(batch, batch_idx)


def faulty(run: RunSpec) -> FaultyNet:
    return FaultyNet(**run.model)


def fsdp_precision() -> Any:
    """A precision plugin of another strategy (FSDP's), which the pipeline cannot honour."""
    from lightning.pytorch.plugins.precision import FSDPPrecision

    return FSDPPrecision("bf16-mixed")
