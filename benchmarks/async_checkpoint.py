"""Saves that do not stop training: step time with a checkpoint every step on slow storage, asynchronous against
blocking against none.

    python -m benchmarks.async_checkpoint            # about 3 minutes on 2 cores
    python -m benchmarks.async_checkpoint --quick    # fewer steps, for a smoke run

Emulated layers (each ``Linear(--width, --width)`` sleeps ``--layer-ms`` per micro-batch in its forward while real
tensors flow, so a step takes about as long as on an accelerator whose compute it stands for, and the CPU stays
free for the writer), p=2 with v=2 stages per rank on 2 processes, AdamW. Slow storage is emulated by delaying
each DCP file write by ``--write-delay`` seconds (one file per rank and save). Three configurations, launched
one after the other in one invocation: no checkpoints; a ``ModelCheckpoint`` every step with the blocking save;
the same with ``BFPPStrategy(async_checkpoint=True)``. Each reports the median time between step starts over the
steps after ``--warmup``, as a ratio to the run without checkpoints, and each process's peak resident memory
(``VmHWM``): the asynchronous save's host copy of the rank's state is the difference. Results are printed and
written to ``--output`` (default ``runs/async_checkpoint/async_checkpoint.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

import lightning_bfpp
from lightning_bfpp.measure import launcher
from lightning_bfpp.measure.emulated import LayerStack


class _SleepingLinear(nn.Linear):
    """A linear layer that takes ``sleep_s`` longer per call: an accelerator's compute, emulated."""

    def __init__(self, width: int, sleep_s: float) -> None:
        super().__init__(width, width)
        self.sleep_s = sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.sleep_s)
        return torch.tanh(super().forward(x))


class _Net(LayerStack):
    def __init__(self, layers: int, width: int, layer_ms: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_SleepingLinear(width, layer_ms / 1e3) for _ in range(layers))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class _StepTimes(L.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())


def _peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _time_saver_calls() -> dict[str, list[float]]:
    """Each call's duration of the asynchronous saver's steps that the training thread waits for."""
    from lightning_bfpp.engine.checkpoint.async_saving import AsyncSaver

    spent: dict[str, list[float]] = {"save": [], "finish": [], "at_step_boundary": []}
    for name in spent:
        original = getattr(AsyncSaver, name)

        def timed(self: AsyncSaver, *args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                spent[_name].append(time.perf_counter() - start)

        setattr(AsyncSaver, name, timed)
    return spent


def _worker(rank: int, config: dict[str, Any], out: str) -> None:
    """One configuration on one rank: ``config["saves"]`` is "none", "blocking" or "async"."""
    write_data = FileSystemWriter.write_data

    def slow(writer: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
        time.sleep(config["write_delay"])
        return write_data(writer, *args, **kwargs)

    FileSystemWriter.write_data = slow  # type: ignore[method-assign]
    spent = _time_saver_calls()
    timer = _StepTimes()
    callbacks: list[L.Callback] = [timer]
    if config["saves"] != "none":
        callbacks.append(ModelCheckpoint(dirpath=Path(out) / "ckpts", every_n_train_steps=1, save_top_k=1))
    strategy = lightning_bfpp.BFPPStrategy(
        pipeline_parallel_size=2, stages_per_rank=2, num_microbatches=4, async_checkpoint=config["saves"] == "async"
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=config["steps"], callbacks=callbacks,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = torch.randn(config["steps"] * 8, config["width"], generator=torch.Generator().manual_seed(1))
    model = _Net(config["layers"], config["width"], config["layer_ms"])
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    steps = [b - a for a, b in zip(timer.starts, timer.starts[1:], strict=False)][config["warmup"] :]
    result = {
        "median_step_s": statistics.median(steps), "steps_s": steps, "peak_rss_bytes": _peak_rss_bytes(),
        "saver_s": {name: sum(times) / max(len(times), 1) for name, times in spent.items()},
    }  # fmt: skip
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def _launched(config: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        result = launcher.launch(
            "benchmarks.async_checkpoint:_worker", 2, Path(tmp), args=(config, tmp), start="spawn", timeout_s=900
        )
        if not result.ok:
            raise RuntimeError(f"{config['saves']}: a rank failed\n{result.report()}")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    return {
        "median_step_s": max(r["median_step_s"] for r in ranks),  # the slower rank's: the step waits for it
        "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks],
        "saver_s_per_call": [r["saver_s"] for r in ranks],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layer-ms", type=float, default=40.0)
    parser.add_argument("--write-delay", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", type=Path, default=Path("runs/async_checkpoint/async_checkpoint.json"))
    args = parser.parse_args()
    steps = 7 if args.quick else args.steps
    base = {
        "layers": args.layers, "width": args.width, "layer_ms": args.layer_ms, "write_delay": args.write_delay,
        "steps": steps, "warmup": min(args.warmup, steps - 2),
    }  # fmt: skip
    results = {saves: _launched({**base, "saves": saves}) for saves in ("none", "blocking", "async")}
    none = results["none"]["median_step_s"]
    for saves, result in results.items():
        result["step_ratio"] = result["median_step_s"] / none
        print(
            f"{saves:>9}: step {result['step_ratio']:.2f}x the run without checkpoints"
            f" (median {result['median_step_s']:.3f} s); peak RSS per rank"
            f" {', '.join(f'{b / 2**20:.0f} MiB' for b in result['peak_rss_bytes'])}"
        )
    state_mib = args.layers // 2 * (args.width * args.width + args.width) * 4 * 3 / 2**20
    print(f"each rank's checkpointed state (weights + AdamW's two moments): {state_mib:.0f} MiB")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"config": base, "results": results, "state_mib_per_rank": state_mib}, indent=2))


if __name__ == "__main__":
    main()
