"""Everything the package does on one GPU, checked and measured in one process: ``python -m benchmarks.gpu_check``.

    python -m benchmarks.gpu_check                    # CUDA, the sizes below (a few minutes on one GPU)
    python -m benchmarks.gpu_check --device cpu       # small sizes, on the CPU (the suite runs this)

One process holds every stage (``pipeline_parallel_size=1``, ``stages_per_rank`` ≥ 2), so everything a GPU process
does runs: torch's pipeline runtime over CUDA tensors, FSDP2's reduction stream, autocast, inductor. Checks (each
passes or fails, with what it measured):

- **equal to one device**: the example GPT and a Hugging Face Llama, each registered schedule that runs on one
  rank, in ``32-true``, ``bf16-mixed`` and ``bf16-true``, against the same module trained with Lightning's default
  strategy at the same precision, every step's loss and the final parameters. Tolerances (relative): 1e-5 in fp32
  (the pipeline sums a batch's micro-batches in another order); 3e-2 in ``bf16-mixed`` and 6e-2 in ``bf16-true``:
  bf16 keeps 8 bits of mantissa (relative steps of 2⁻⁸ ≈ 0.4%), the batch's split into micro-batches changes each
  gradient's summation order, every change of order moves a result by up to that much, and a few steps of updates
  compound it (``bf16-true`` also rounds the weights themselves after every update);
- **the stream path of the reductions**: two stages, each one FSDP2 unit over a one-rank mesh, run through
  torch's runtime with ``REDUCE_GRAD`` replaced by :class:`lightning_bfpp.engine.reductions.GradientReductions`
  (``"stream"`` on CUDA: the reduce-scatter on FSDP2's reduction stream, waited for at the end; ``"thread"`` on
  the CPU, where there is no stream), gradients against a plain backward (1e-6);
- **compile per layer**: ``BFPPStrategy(compile=True)`` (inductor on CUDA; on the CPU the ``"eager"`` backend,
  which checks the plumbing without a compiler) against one device (1e-4: inductor fuses and reorders);
- **save and resume**: a checkpoint after 2 steps, resumed for 2 more, against 4 steps straight (1e-6);

and measures, per schedule (the GPT, fp32): the step time, the peak memory of a step against the planner's
prediction for the same plan on the module's measured profile (CUDA: ``max_memory_allocated``, everything the step
holds, against ``Prediction.peak_memory``; the CPU: the activations, malloc's bytes in use at every action less the
step's start and the gradients, against ``Prediction.activation_peaks``; weight passing's runner opens no action
ranges to sample there), and on CUDA the share of the step the GPU is busy (torch's profiler: the kernels' time
over the step's wall time). Prints one table and writes ``--out``/gpu_check.json.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as torch_schedules
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_bfpp  # noqa: F401
from examples.train_gpt import GPT, SortDigits
from lightning_bfpp import BFPPStrategy
from lightning_bfpp.plan import Cluster, Plan, get_schedule, schedule_names, simulate

PRECISIONS = {"32-true": 1e-5, "bf16-mixed": 3e-2, "bf16-true": 6e-2}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The models and batches of a run (``small``: what the CPU test trains)."""

    gpt: dict[str, int]
    llama: dict[str, int]
    batch: int
    microbatches: int
    steps: int

    @staticmethod
    def of(small: bool) -> Sizes:
        if small:
            return Sizes(dict(layers=4, dim=32, heads=4, block_size=16), dict(layers=4, hidden=32, seq=12), 8, 4, 3)
        return Sizes(dict(layers=8, dim=512, heads=8, block_size=16), dict(layers=8, hidden=512, seq=128), 32, 4, 4)


@dataclasses.dataclass
class Check:
    name: str
    passed: bool
    detail: str = ""
    measured: dict[str, Any] = dataclasses.field(default_factory=dict)


# -- the models ----------------------------------------------------------------------------------------------


class Tokens(Dataset):
    """Random token sequences with full attention masks (a causal LM's batches)."""

    def __init__(self, count: int, seq: int, vocab: int, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (count, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i])}


def make_model(name: str, sizes: Sizes) -> L.LightningModule:
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(**sizes.gpt)
    from transformers import LlamaConfig

    from lightning_bfpp.integrations.huggingface import HFCausalLM

    s = sizes.llama
    config = LlamaConfig(
        vocab_size=256, hidden_size=s["hidden"], intermediate_size=2 * s["hidden"], num_hidden_layers=s["layers"],
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(64, s["seq"]),
        attention_dropout=0.0, tie_word_embeddings=False,
    )  # fmt: skip
    return HFCausalLM(config, lr=1e-3)


def make_loader(name: str, sizes: Sizes, batches: int | None = None) -> DataLoader:
    count = sizes.batch * (batches or sizes.steps + 2)
    data = SortDigits(count, seed=1) if name == "gpt" else Tokens(count, sizes.llama["seq"], 256)
    return DataLoader(data, batch_size=sizes.batch)


# -- training and recording ----------------------------------------------------------------------------------


class Recorder(L.Callback):
    """Every step's loss and start time, and the peak memory of the steps after the first two."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.losses: list[float] = []
        self.starts: list[float] = []
        self.peak = 0
        self._base = 0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.starts.append(self._now())
        if self.device.type == "cuda" and trainer.global_step >= 2:
            torch.cuda.reset_peak_memory_stats(self.device)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
        if self.device.type == "cuda" and trainer.global_step >= 3:
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device))

    def on_train_end(self, *args: Any) -> None:
        self.starts.append(self._now())

    @property
    def step_s(self) -> float:
        steps = [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)][2:] or [0.0]
        return statistics.median(steps)


def fit(
    name: str,
    sizes: Sizes,
    device: torch.device,
    precision: str,
    strategy: Any = "auto",
    *,
    steps: int | None = None,
    epochs: int | None = None,
    callbacks: tuple[L.Callback, ...] = (),
    ckpt_path: str | None = None,
    save_to: str | None = None,
) -> tuple[Recorder, dict[str, torch.Tensor], L.Trainer]:
    """Train ``name`` on one device; ``epochs`` (of two batches) instead of ``steps``: a resumed run then replays
    the data as the uninterrupted one sees it (Lightning resumes iteration-based training as mid-epoch)."""
    recorder = Recorder(device)
    limit = {"max_epochs": epochs, "max_steps": -1} if epochs else {"max_steps": steps or sizes.steps}
    trainer = L.Trainer(
        accelerator=device.type, devices=1, strategy=strategy, precision=precision, **limit,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[recorder, *callbacks], num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
    )  # fmt: skip
    model = make_model(name, sizes)
    trainer.fit(model, make_loader(name, sizes, 2 if epochs else None), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    params = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items() if v.is_floating_point()}
    return recorder, params, trainer


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.double().norm().item()
    diff = (a.double() - b.double()).norm().item()
    return diff / denom if denom > 0 else diff


def compare(got: tuple[Recorder, dict[str, torch.Tensor]], want: tuple[Recorder, dict[str, torch.Tensor]]) -> float:
    """The largest relative difference of a step's loss, or of the final parameters taken as one vector.

    One vector, not tensor by tensor: a parameter whose gradient is zero in exact arithmetic (the keys' part of an
    attention's ``qkv`` bias) gets gradients of rounding noise, which AdamW scales up to full steps in a direction
    the summation order decides; its own relative difference says nothing about the pipeline."""
    (gr, gp), (wr, wp) = got, want
    if len(gr.losses) != len(wr.losses) or set(gp) != set(wp):
        return float("inf")
    losses = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(gr.losses, wr.losses, strict=True)]
    names = sorted(wp)
    params = _relative(torch.cat([gp[k].flatten() for k in names]), torch.cat([wp[k].flatten() for k in names]))
    return max([*losses, params])


def one_rank_schedules() -> list[tuple[str, int]]:
    """Every registered schedule that runs on one pipeline rank, with its stages per rank there (≥ 2 where it
    takes them; weight passing has one chunk per rank, here one)."""
    out = []
    for name in schedule_names():
        kind = get_schedule(name)
        if kind.runner == "weight_passing":
            out.append((name, 1))
        else:
            out.append((name, (kind.stages_per_rank_choices or (2,))[0]))
    return out


def strategy_for(schedule: str, v: int, sizes: Sizes, **extra: Any) -> BFPPStrategy:
    if get_schedule(schedule).runner == "weight_passing":
        return BFPPStrategy(schedule=schedule, num_microbatches=sizes.microbatches, **extra)
    return BFPPStrategy(
        pipeline_parallel_size=1, stages_per_rank=v, num_microbatches=sizes.microbatches, schedule=schedule,
        partition="parameters", **extra,
    )  # fmt: skip


# -- the checks ----------------------------------------------------------------------------------------------


def check_equivalence(device: torch.device, sizes: Sizes, log: Callable[[str], None]) -> list[Check]:
    checks = []
    for model in ("gpt", "llama"):
        for precision, tolerance in PRECISIONS.items():
            reference = fit(model, sizes, device, precision)[:2]
            for schedule, v in one_rank_schedules():
                got = fit(model, sizes, device, precision, strategy_for(schedule, v, sizes))[:2]
                error = compare(got, reference)
                name = f"{model} {precision} {schedule} v={v}"
                checks.append(Check(name, error <= tolerance, f"max relative difference {error:.1e} ≤ {tolerance:g}",
                                    {"error": error, "tolerance": tolerance}))  # fmt: skip
                log(f"{'ok  ' if checks[-1].passed else 'FAIL'} {name}: {checks[-1].detail}")
    return checks


def check_reduction_stream(device: torch.device) -> Check:
    """Two FSDP2 stages on a one-rank mesh through torch's runtime, ``REDUCE_GRAD`` overlapped."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_bfpp.engine.reductions import GradientReductions
    from lightning_bfpp.engine.runtime import PlannedSchedule, build_stages

    mode = "stream" if device.type == "cuda" else "thread"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=_file_store(), rank=0,
                                world_size=1)  # fmt: skip
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to(device) for _ in range(2)]
    inputs = torch.randn(8, 16, device=device)
    plain = copy.deepcopy(nn.Sequential(*layers))  # before sharding turns the layers' parameters into DTensors
    plain(inputs).pow(2).sum().backward()
    mesh = init_device_mesh(device.type, (1,))
    # FSDP2 itself (the strategy leaves a one-rank data-parallel group unsharded): its reduction path on one rank
    stages = [fully_shard(layer, mesh=mesh, reshard_after_forward=False) for layer in layers]
    # a plan with data parallelism lowers UNSHARD / RESHARD / REDUCE_GRAD; the one-rank mesh runs them
    plan = Plan("breadth_first", 1, 2, 2, 4)
    pipeline = build_stages(stages, [0, 1], 2, device, dist.group.WORLD)
    reductions = GradientReductions(dict(enumerate(stages)), mode)
    runner = PlannedSchedule(pipeline, plan.lowered(), 4, lambda out, mb: out.pow(2).sum(),
                             stage_to_rank=plan.stage_to_rank(), backward=True, reductions=reductions)  # fmt: skip
    runner.run([(x,) for x in inputs.chunk(4)], [{} for _ in range(4)], [torch.tensor(i) for i in range(4)])
    reductions.finish()
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for s in stages for p in s.parameters()]
    want = [p.grad for p in plain.parameters()]
    error = max(_relative(g.float().cpu(), w.float().cpu()) for g, w in zip(grads, want, strict=True))
    return Check(f"reductions overlapped ({mode})", error <= 1e-6, f"max relative gradient difference {error:.1e}",
                 {"error": error, "mode": mode})  # fmt: skip


def _file_store() -> str:
    return f"file://{tempfile.mkdtemp(prefix='bfpp-gpu-check-')}/store"


def check_compile(device: torch.device, sizes: Sizes) -> Check:
    options: Any = True if device.type == "cuda" else {"backend": "eager"}
    reference = fit("gpt", sizes, device, "32-true")[:2]
    got = fit("gpt", sizes, device, "32-true", strategy_for("breadth_first", 2, sizes, compile=options))[:2]
    error = compare(got, reference)
    backend = "inductor" if device.type == "cuda" else "eager"
    return Check(f"compile per layer ({backend})", error <= 1e-4, f"max relative difference {error:.1e} ≤ 1e-4",
                 {"error": error})  # fmt: skip


class StopAfterEpoch(L.Callback):
    """Stop at the end of the first epoch, whatever ``max_epochs`` (the learning-rate schedule follows it)."""

    def on_train_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
        trainer.should_stop = True


def check_resume(device: torch.device, sizes: Sizes, folder: Path) -> Check:
    strategy = lambda: strategy_for("breadth_first", 2, sizes)  # noqa: E731
    straight = fit("gpt", sizes, device, "32-true", strategy(), epochs=2)[:2]
    path = str(folder / "half.ckpt")
    fit("gpt", sizes, device, "32-true", strategy(), epochs=2, save_to=path, callbacks=(StopAfterEpoch(),))
    rec, params, _ = fit("gpt", sizes, device, "32-true", strategy(), epochs=2, ckpt_path=path)
    cut = Recorder(device)
    cut.losses = straight[0].losses[2:]
    error = compare((rec, params), (cut, straight[1]))
    return Check("save and resume", error <= 1e-6, f"an epoch, saved, resumed for another, against two: max"
                 f" relative difference {error:.1e}", {"error": error})  # fmt: skip


# -- the measurements ------------------------------------------------------------------------------------------


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]  # fmt: skip


def _malloc_in_use() -> Callable[[], int] | None:
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    return lambda: int(mallinfo2().uordblks + mallinfo2().hblkhd)


class HostPeak(L.Callback):
    """The CPU's peak of activations in the third step: malloc's bytes in use at the end of every action, less the
    step's start and the gradients held then (``benchmarks/memory_per_schedule.py`` measures the same way)."""

    def __init__(self) -> None:
        self.in_use = _malloc_in_use()
        self.peak = 0
        self._base: int | None = None
        self._params: list[torch.Tensor] = []
        self._original = torch_schedules.record_function

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._params = [p for p in module.parameters() if p.requires_grad]

    def _sample(self) -> None:
        assert self.in_use is not None
        grads = sum(p.grad.numel() * p.grad.element_size() for p in self._params if p.grad is not None)
        level = self.in_use() - grads
        if self._base is None:
            self._base = level
        self.peak = max(self.peak, level - self._base)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != 2 or self.in_use is None:
            return
        original, probe = self._original, self

        @contextmanager
        def sampled(name: str) -> Iterator[None]:
            if probe._base is None:
                probe._sample()
            with original(name):
                yield
            probe._sample()

        torch_schedules.record_function = sampled

    def on_train_batch_end(self, *args: Any) -> None:
        torch_schedules.record_function = self._original


def busy_share(device: torch.device, sizes: Sizes, schedule: str, v: int) -> float | None:
    """The share of a step the GPU computes (its kernels' time over the steps' wall time), from torch's profiler."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler import schedule as profiler_schedule

    steps = 4
    with profile(activities=[ProfilerActivity.CUDA], schedule=profiler_schedule(wait=2, warmup=0, active=2)) as prof:

        class Step(L.Callback):
            def on_train_batch_end(self, *args: Any) -> None:
                prof.step()

        recorder, _, _ = fit("gpt", sizes, device, "32-true", strategy_for(schedule, v, sizes), steps=steps,
                             callbacks=(Step(),))  # fmt: skip
    kernels = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total) / 1e6
    wall = 2 * recorder.step_s
    return min(kernels / wall, 1.0) if wall > 0 else None


def measure_schedules(device: torch.device, sizes: Sizes, log: Callable[[str], None]) -> list[dict[str, Any]]:
    from lightning_bfpp.adapter.user_step import training_step_input
    from lightning_bfpp.measure.profile import profile_module

    module = make_model("gpt", sizes).to(device)
    batch = next(iter(make_loader("gpt", sizes)))
    micro = [t[: sizes.batch // sizes.microbatches].to(device) for t in batch]
    profile = dataclasses.replace(
        profile_module(module, micro, training_step_input, split_backward=True), optimizer_state_ratio=2.0
    )
    cluster = Cluster(1, 1, 2**50, 1e12, 1e12)
    rows = []
    for schedule, v in one_rank_schedules():
        host = HostPeak()
        recorder, _, trainer = fit("gpt", sizes, device, "32-true", strategy_for(schedule, v, sizes), steps=5,
                                   callbacks=(host,))  # fmt: skip
        plan = trainer.strategy.plan
        prediction = simulate(dataclasses.replace(plan, layer_names=(), microbatch_size=micro[0].shape[0]), profile,
                              cluster)  # fmt: skip
        # CUDA: everything the step allocates (weights, gradients, optimizer state, activations); the CPU: activations
        if device.type == "cuda":
            predicted: int | None = prediction.peak_memory
        else:  # weight passing's model has no per-action activations to compare
            predicted = prediction.activation_peaks[0] if prediction.activation_peaks else None
        measured = recorder.peak if device.type == "cuda" else host.peak
        row = {"schedule": schedule, "v": v, "step_ms": 1e3 * recorder.step_s, "peak_bytes": measured,
               "predicted_peak_bytes": predicted, "busy": busy_share(device, sizes, schedule, v)}  # fmt: skip
        rows.append(row)
        log(f"     {schedule} v={v}: step {row['step_ms']:.1f} ms, peak {measured / 2**20:.1f} MiB")
    return rows


# -- the command ----------------------------------------------------------------------------------------------


def run(device: torch.device, small: bool, out: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    sizes = Sizes.of(small)
    started = time.monotonic()
    checks = check_equivalence(device, sizes, log)
    checks.append(check_reduction_stream(device))
    checks.append(check_compile(device, sizes))
    with tempfile.TemporaryDirectory() as folder:
        checks.append(check_resume(device, sizes, Path(folder)))
    for check in checks[-3:]:
        log(f"{'ok  ' if check.passed else 'FAIL'} {check.name}: {check.detail}")
    measured = measure_schedules(device, sizes, log)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "sizes": dataclasses.asdict(sizes),
        "seconds": time.monotonic() - started,
        "checks": [dataclasses.asdict(c) for c in checks],
        "schedules": measured,
        "passed": all(c.passed for c in checks),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    log("\n" + table(result))
    return result


def table(result: dict[str, Any]) -> str:
    scope = "activations'" if result["device"] == "cpu" else "step's"
    lines = [
        f"{result['device']}, torch {result['torch']}: {sum(c['passed'] for c in result['checks'])} of"
        f" {len(result['checks'])} checks passed in {result['seconds']:.0f} s",
        "",
        f"| schedule | v | step (ms) | {scope} peak (MiB) | predicted (MiB) | predicted / measured | GPU busy |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["schedules"]:
        peak, predicted = row["peak_bytes"], row["predicted_peak_bytes"]
        busy = "" if row["busy"] is None else f"{row['busy']:.0%}"
        ratio = f"{predicted / peak:.2f}" if peak and predicted else ""
        shown = "" if predicted is None else f"{predicted / 2**20:.1f}"
        lines.append(f"| {row['schedule']} | {row['v']} | {row['step_ms']:.1f} | {peak / 2**20:.1f} | {shown} |"
                     f" {ratio} | {busy} |")  # fmt: skip
    failed = [c for c in result["checks"] if not c["passed"]]
    lines += ["", *(f"FAILED {c['name']}: {c['detail']}" for c in failed)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_check"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; run with --device cpu")
    result = run(torch.device(args.device), small=args.device == "cpu", out=args.out)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
