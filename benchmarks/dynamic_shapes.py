"""What a batch of a new sequence length costs, and what a seen one costs, on the suite's GPT.

Batches padded to their own longest sequence come in many lengths; each new length (per step kind and
pipeline) builds a schedule: torch's shape inference runs every stage forward and backward once, on stand-in
weights and without data-parallel collectives (``lightning_bfpp.engine.runtime.ShapeInference``), and the stages'
receive buffers are allocated. The schedule is cached (16 per pipeline), so a length seen before costs nothing
extra. This runs, in one launch of 4 CPU processes at (p, dp, v, m) = (2, 2, 2, 4), full sharding:

- *static*: every batch 32 tokens long;
- *dynamic*: batches of 16, 20, …, 48 tokens (9 lengths, fewer than the cache holds), which Lightning's
  distributed sampler deals to the two replicas in shuffled order: lengths change from step to step and
  differ between the replicas of a step.

Each step's wall time is measured on global rank 0 (from the step's start to the optimizer step's end).
Printed: per length, the first step at it against the median of the later ones (the new length's extra time),
their median over the lengths, the steps at a seen 32 tokens against the static run's, and the per-step cost of
the batch-content digest the pipeline's ranks compare (``microbatch.batch_digest``).

    python -m benchmarks.dynamic_shapes
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from examples.train_gpt import GPT, VOCAB
from lightning_bfpp import BFPPStrategy
from lightning_bfpp.engine.microbatch import batch_digest

LENGTHS = (16, 20, 24, 28, 32, 36, 40, 44, 48)
STEPS = 37
LOCAL_BATCH = 16


class Batches(Dataset):
    """Whole batches (``batch_size=None``), of ``lengths[(step + shift) % len]`` tokens at each step."""

    def __init__(self, lengths: tuple[int, ...], replicas: int = 2) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = []
        for step in range(STEPS):
            for replica in range(replicas):  # DistributedSampler deals item i to replica i % replicas
                t = lengths[(step + replica) % len(lengths)]
                x = torch.randint(0, VOCAB, (LOCAL_BATCH, t), generator=g)
                self.items.append((x, x.roll(-1, 1)))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


class Model(GPT):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(self(inputs).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:  # type: ignore[override]
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepTimes(L.Callback):
    def __init__(self) -> None:
        self.times: list[tuple[int, float]] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, i: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, out: Any, batch: Any, i: int) -> None:
        self.times.append((batch[0].shape[1], time.perf_counter() - self._start))


def run(lengths: tuple[int, ...]) -> tuple[list[tuple[int, float]], bool]:
    L.seed_everything(0)
    times = StepTimes()
    strategy = BFPPStrategy(pipeline_parallel_size=2, stages_per_rank=2, num_microbatches=4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[times],
    )
    model = Model(layers=8, dim=128, heads=4, block_size=max(LENGTHS))
    trainer.fit(model, DataLoader(Batches(lengths), batch_size=None))
    return times.times, trainer.is_global_zero


def main() -> None:
    static, _ = run((32,))
    dynamic, is_zero = run(LENGTHS)
    if not is_zero:
        return
    first: dict[int, float] = {}
    later: dict[int, list[float]] = {}
    for i, (length, seconds) in enumerate(dynamic):
        if i == 0:
            continue  # the first step builds the training schedule under any shape
        if length not in first:
            first[length] = seconds
        else:
            later.setdefault(length, []).append(seconds)
    ms = 1000.0
    print("| tokens | first step at this length on rank 0 (ms) | median later step (ms) | extra at the first (ms) |")
    print("|---|---|---|---|")
    first = {n: t for n, t in first.items() if n in later}  # a length seen once only has nothing to compare
    for length in sorted(first):
        median = statistics.median(later[length])
        print(f"| {length} | {first[length] * ms:.0f} | {median * ms:.0f} | {(first[length] - median) * ms:+.0f} |")
    extra = statistics.median(first[n] - statistics.median(later[n]) for n in first)
    print(f"\nmedian extra time of a step at a new length: {extra * ms:+.0f} ms")
    static_median = statistics.median(s for _, s in static[1:])
    seen_32 = statistics.median(later[32])
    print(
        f"\n32 tokens, seen length in the dynamic run against the static run: {seen_32 * ms:.0f} ms against"
        f" {static_median * ms:.0f} ms ({seen_32 / static_median:.2f}x)"
    )
    batch = {"input_ids": torch.randint(0, 32_000, (LOCAL_BATCH, 2048)), "attention_mask": torch.ones(16, 2048)}
    batch_digest(batch)
    start = time.perf_counter()
    for _ in range(100):
        batch_digest(batch)
    print(
        f"batch_digest of a {LOCAL_BATCH}x2048 int64 batch with its float mask:"
        f" {(time.perf_counter() - start) * 10:.3f} ms"
    )


if __name__ == "__main__":
    main()
