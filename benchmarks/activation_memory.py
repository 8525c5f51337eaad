"""Activation memory per pipeline rank under breadth-first, with and without activation checkpointing.

Breadth-first runs every micro-batch's forward through all local stages before any backward, so a rank
holds the activations of all its micro-batches at once. This script measures, per rank:

- *saved for backward*: bytes of the tensors autograd keeps for backward when the last forward of the
  step ends (before any backward frees them), counted once per storage with a ``saved_tensors_hooks`` pair;
  exact, and independent of the allocator;
- *RSS growth*: the process's peak resident memory during training minus its resident memory when
  training starts (``ru_maxrss``), which includes the allocator's slack and transient buffers.

    python benchmarks/activation_memory.py            # both settings, prints a markdown table

Each setting runs in its own 2-process job (p=2, dp=1, v=2, m=8) on CPU, its ranks started by the package's
launcher (``lightning_bfpp.measure.launcher``) as new interpreters with one intra-op thread each, so a rank's RSS
is its own; their output goes to ``OUT/logs/recompute<N>/rank<R>.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_bfpp  # noqa: F401
from lightning_bfpp import BFPPStrategy
from lightning_bfpp.measure import launcher
from lightning_bfpp.measure.emulated import LayerStack

SEQ, WIDTH, BLOCKS, MICROBATCH = 128, 256, 16, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(LayerStack):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(BLOCKS))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class SavedBytes(L.Callback):
    """Bytes autograd holds for backward at the end of the forward sweeps of each training step."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}
        self.at_first_backward: list[int] = []
        self.backward_started = False
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.rss_start = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.backward_started:
            storage = tensor.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.backward_started:
            self.backward_started = True
            self.at_first_backward.append(sum(self.storages.values()))
        return tensor

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.rss_start = _rss_bytes()

    def on_train_batch_start(self, *args: object) -> None:
        self.storages.clear()
        self.backward_started = False
        self.hooks.__enter__()

    def on_train_batch_end(self, *args: object) -> None:
        self.hooks.__exit__(None, None, None)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def train(recompute: bool, out: Path) -> None:
    """One rank of a setting's 2-process job: trains, then writes its measurements to ``out``."""
    torch.manual_seed(0)
    steps, m = 3, 8
    data = TensorDataset(
        torch.randn(steps * m * MICROBATCH, SEQ, WIDTH), torch.randn(steps * m * MICROBATCH, SEQ, WIDTH)
    )
    probe = SavedBytes()
    strategy = BFPPStrategy(
        pipeline_parallel_size=2, stages_per_rank=2, num_microbatches=m, activation_checkpointing=recompute
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, callbacks=[probe], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Net(), DataLoader(data, batch_size=m * MICROBATCH))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    record = {
        "rank": trainer.global_rank,
        "saved_bytes": max(probe.at_first_backward[1:]),  # step 1 also infers shapes
        "rss_growth": peak - probe.rss_start,
    }
    (out / f"recompute{int(recompute)}_rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _train_rank(rank: int, recompute: bool, out: str) -> None:
    """A rank started by the launcher (Lightning reads its rank from the launcher's environment)."""
    train(recompute, Path(out))


def run_setting(recompute: bool, out: Path) -> None:
    """One setting's job on 2 new interpreters (a forked rank would start from this process's memory)."""
    target = "benchmarks.activation_memory:_train_rank"
    folder = out / "logs" / f"recompute{int(recompute)}"
    result = launcher.launch(target, 2, folder, args=(recompute, str(out)), start="spawn")
    if not result.ok:
        raise RuntimeError(f"the job with recompute={recompute} failed: {result.report()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/activation_memory")
    args = parser.parse_args()
    out = Path(args.out).resolve()  # the ranks write there too
    out.mkdir(parents=True, exist_ok=True)
    for recompute in (False, True):
        run_setting(recompute, out)
    print(f"p=2, v=2, m=8 micro-batches of {MICROBATCH}×{SEQ}×{WIDTH}, {BLOCKS} blocks (8 per rank), fp32\n")
    print("| activation checkpointing | rank | saved for backward (MiB) | RSS growth (MiB) |")
    print("|---|---|---|---|")
    for recompute in (0, 1):
        for rank in (0, 1):
            r = json.loads((out / f"recompute{recompute}_rank{rank}.json").read_text())
            print(
                f"| {'on' if recompute else 'off'} | {rank} | {r['saved_bytes'] / 2**20:,.1f} |"
                f" {r['rss_growth'] / 2**20:,.1f} |"
            )


if __name__ == "__main__":
    main()
