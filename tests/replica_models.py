"""Models whose processes start from different initial values, and a probe of what every rank holds.

- :func:`rank_seeded_net`: a PipeNet with buffers (a fixed random gain in every block, a target shift outside
  the pipeline layers) built with a different seed on every process, as a script without ``seed_everything``
  builds it; :func:`assembled_net` is the one-device model made of chosen processes' layers.
- :func:`batch_norm_net`: the same blocks normalised by ``nn.BatchNorm1d``, whose running statistics are
  updated by every training forward.
- :class:`RankState` (the worker's ``rank_state`` check): every rank's full parameters and buffers after setup
  and after training, and under weight passing the buffers of every chunk as this rank holds them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tests.models import PipeNet, RunSpec

SEED_BASE = 1000  # process r builds its model with seed SEED_BASE + r


class GainBlock(nn.Module):
    """A residual MLP block scaled by a fixed random buffer (``gain``): a buffer the forward reads."""

    def __init__(self, width: int, norm: str) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(width) if norm == "batch" else nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.register_buffer("gain", 0.5 + torch.rand(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gain * self.down(F.gelu(self.up(self.norm(x))))


class BufferedNet(PipeNet):
    """PipeNet with :class:`GainBlock` blocks and a buffer outside the pipeline layers (``target_shift``, added
    to the targets by the training step)."""

    def __init__(self, norm: str = "layer", **spec: Any) -> None:
        super().__init__(**spec)
        s = self.spec
        self.blocks = nn.ModuleList([GainBlock(s.width, norm) for _ in range(s.num_blocks)])
        self.register_buffer("target_shift", 0.1 * torch.randn(s.out_dim))

    def _unpack(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super()._unpack(batch)
        return x, y + self.target_shift


def _spec(run: RunSpec) -> dict[str, Any]:
    spec = {k: v for k, v in run.model.items() if k not in ("layer_seeds", "module_seed")}
    spec.setdefault("batch_format", run.data.get("batch_format", "tuple"))
    return spec


def process_rank() -> int:
    """This process's rank in a single-node launch (Lightning's launcher sets ``LOCAL_RANK`` on the others)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def rank_seeded_net(run: RunSpec) -> BufferedNet:
    """A different initialisation on every process: seed ``SEED_BASE + rank``."""
    return BufferedNet(**{**_spec(run), "seed": SEED_BASE + process_rank()})


def assembled_net(run: RunSpec) -> BufferedNet:
    """The model whose layer ``name`` is the one seed ``run.model["layer_seeds"][name]`` builds, and whose other
    state (buffers outside the layers) seed ``run.model["module_seed"]`` builds."""
    spec = _spec(run)
    model = BufferedNet(**{**spec, "seed": run.model["module_seed"]})
    built: dict[int, BufferedNet] = {}
    for name, seed in run.model["layer_seeds"].items():
        source = built.setdefault(seed, BufferedNet(**{**spec, "seed": seed}))
        model.get_submodule(name).load_state_dict(source.get_submodule(name).state_dict())
    return model


def batch_norm_net(run: RunSpec) -> BufferedNet:
    return BufferedNet(**{**_spec(run), "norm": "batch"})


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


class RankState(L.Callback):
    """Writes ``state_<when>_rank<R>.pt`` after setup (``setup``) and after training (``end``): this rank's
    full parameters and buffers by name; under weight passing also ``chunk_buffers``, every chunk's buffers as
    this rank holds them (the module keeps its own chunk only), and ``owned_layers``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _write(self, trainer: L.Trainer, module: L.LightningModule, when: str) -> None:
        from lightning_bfpp.engine.layers import Recompute, RemoteLayer

        strategy = trainer.strategy
        names = {id(m): n for n, m in module.named_modules()}
        state: dict[str, Any] = {
            "params": {n: _full(p) for n, p in module.named_parameters()},
            "buffers": {n: _full(b) for n, b in module.named_buffers()},
            "owned_layers": [names[id(m)] for m in module.pipeline_layers() if not isinstance(m, RemoteLayer)],
            "chunk_buffers": {},
        }
        if strategy.config.schedule == "weight_passing":
            for stage, stage_module in enumerate(strategy.pipeline.stage_modules):
                for name, layer in zip(strategy.plan.stage_layers(stage), stage_module.layers, strict=True):
                    inner = layer.layer if isinstance(layer, Recompute) else layer
                    for buffer_name, buffer in inner.named_buffers():
                        state["chunk_buffers"][f"{name}.{buffer_name}"] = buffer.detach().clone()
        torch.save(state, self.folder / f"state_{when}_rank{trainer.global_rank}.pt")

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, pl_module, "setup")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, pl_module, "end")
