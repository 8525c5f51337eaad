"""One traced weight-passing step on emulated accelerators: 4 processes as 2 nodes × 2, 8 layers of 10 ms
forward and 20 ms backward per micro-batch, 1 MiB activations per sample and 64 KiB of weights per layer.

    python benchmarks/trace_weight_passing.py [--out runs/trace_weight_passing]

Writes per-step Chrome traces, PNG timelines and per-rank summaries (``BFPPStrategy(trace=...)``);
``docs/img/trace_weight_passing.png`` is its step 4.
"""

from __future__ import annotations

import argparse

import lightning as L

from lightning_bfpp import BFPPStrategy
from lightning_bfpp.measure.emulated import EmulatedModel, EmulatedNet, emulated_loader

MODEL = EmulatedModel(layers=8, forward_ms=10.0, backward_ms=20.0, param_numel=16_384, activation_numel=1 << 18)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/trace_weight_passing")
    args = parser.parse_args()
    steps, microbatches, world = 4, 2, 4
    strategy = BFPPStrategy(
        schedule="weight_passing",
        num_microbatches=microbatches,
        processes_per_node=2,
        trace=args.out,
        trace_steps=steps,
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(EmulatedNet(MODEL), emulated_loader(MODEL, microbatches, steps * world))


if __name__ == "__main__":
    main()
