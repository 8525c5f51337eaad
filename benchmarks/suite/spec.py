"""What one benchmark configuration is, and the step time it could reach with free communication.

A :class:`Job` is one implementation on one layout of one model, run as ``processes`` real processes. It
travels to the worker processes as JSON, so it holds only plain values. Emulated layers (see
:mod:`benchmarks.suite.models`) take a known time per micro-batch, which is what makes an analytic bound
(:func:`bound_s`) possible: the fill-and-drain critical path of the layout with communication free and the
runtime costless. Efficiency is that bound over the measured step.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

Kind = Literal["bfpp", "bfpp_hand", "torch", "fsdp", "independent", "stage_compute", "collectives"]
# torch.distributed.pipelining schedule classes the "torch" kind can drive (ScheduleX without the prefix)
TORCH_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B", "gpipe", "1f1b")


@dataclass(frozen=True)
class Emulated:
    """An emulated accelerator's model: ``layers`` identical layers (the knobs of the suite).

    Times are per layer and per micro-batch of the job's ``microbatch_size`` samples, and scale with the rows a
    layer actually receives (a rank of a data-parallel-only run that gets two micro-batches' worth of samples
    takes twice as long), as an accelerator past its small-batch regime does.
    """

    layers: int = 16
    forward_ms: float = 5.0
    backward_ms: float = 10.0
    param_numel: int = 16_384  # fp32 values per layer: what FSDP gathers and reduces
    activation_numel: int = 4096  # fp32 values per sample at each layer boundary: what the pipeline sends

    def describe(self) -> str:
        return (
            f"{self.layers} layers × ({self.forward_ms:g} ms fwd + {self.backward_ms:g} ms bwd per micro-batch,"
            f" {_size(4 * self.param_numel)} params, {_size(4 * self.activation_numel)} activations per sample)"
        )


@dataclass(frozen=True)
class GPTSpec:
    """The small GPT of ``examples/train_gpt.py`` (embedding, ``layers`` blocks, head), with its sorting task."""

    layers: int = 8
    dim: int = 128
    heads: int = 4
    block_size: int = 16

    def describe(self) -> str:
        return f"GPT {self.layers} blocks, dim {self.dim}, {self.heads} heads, sequence {self.block_size}"


@dataclass(frozen=True)
class Job:
    """One implementation, one layout, one model, run on ``processes`` processes.

    ``m`` is micro-batches per step per pipeline replica; for ``fsdp`` (no pipeline) it is the micro-batch-sized
    chunks each rank processes in its one forward, and ``independent`` processes each train on one micro-batch
    per step. ``schedule`` is a lightning_bfpp schedule name for the bfpp kinds and a torch schedule class
    (``TORCH_SCHEDULES``) for ``torch``; ``collectives`` (:mod:`benchmarks.suite.collectives`: bfpp's weight
    gathers and gradient reductions alone, no compute) issues them ``"waited"`` or ``"async"``.
    ``stage_compute`` (real compute only) runs each pipeline rank's own stages on its own, started together, with
    no neighbour: ``schedule`` ``"breadth_first"`` holds every micro-batch's activations as bfpp does,
    ``"one_at_a_time"`` one micro-batch's.
    """

    name: str
    group: str
    kind: Kind
    label: str
    processes: int
    p: int = 1
    v: int = 1
    m: int = 1
    dp: int = 1
    schedule: str = "breadth_first"
    sharding: str = "full_shard"  # bfpp_hand also takes "none": dp replicas that never exchange gradients
    # torch kind with dp > 1: FSDP2's own resharding after each forward (its default) or not (torchtitan's choice
    # under pipelining, where the schedule's UNSHARD / RESHARD actions decide)
    reshard_after_forward: bool = False
    # bfpp kinds: BFPPStrategy(overlap_reductions=...): "auto" (on CPU: torch's blocking reductions) or "thread"
    overlap_reductions: bool | str = "auto"
    # bfpp kinds: BFPPStrategy(prefetch_stages=...), upcoming stages whose weight gathers are in flight
    prefetch_stages: int = 1
    # bfpp_hand: PlannedSchedule(early_receives=...): None is bfpp's default (on gloo every receive is posted when
    # the step starts), False torch's placement (each receive just before its consumer)
    early_receives: bool | None = None
    model: Literal["emulated", "gpt"] = "emulated"
    emulated: Emulated = field(default_factory=Emulated)
    gpt: GPTSpec = field(default_factory=GPTSpec)
    microbatch_size: int = 1
    warmup: int = 2
    steps: int = 5
    reference: bool = False  # the bfpp row the group's other rows are compared with
    timeout_s: float = 150.0
    # a folder: the bfpp kind writes its steps' timelines there (BFPPStrategy(trace=...)); the bfpp_hand and torch
    # kinds return their timed steps' spans in their records instead
    trace: str = ""

    @property
    def global_rows(self) -> int:
        """Samples per optimizer step over all processes (independent processes: per process)."""
        if self.kind == "fsdp":
            return self.processes * self.m * self.microbatch_size
        if self.kind == "independent":
            return self.microbatch_size
        return self.dp * self.m * self.microbatch_size

    @property
    def layout(self) -> str:
        if self.kind == "fsdp":
            return f"dp={self.processes} (FSDP2, no pipeline)"
        if self.kind == "independent":
            return f"{self.processes} × 1 process, micro-batch {self.microbatch_size}"
        if self.kind == "stage_compute":
            return f"p={self.p} v={self.v} m={self.m}, each rank alone"
        text = f"p={self.p} v={self.v} m={self.m} dp={self.dp}"
        if self.dp > 1:
            text += f" {self.sharding}" + (", reshard after forward" if self.reshard_after_forward else "")
        return text

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> Job:
        raw: dict[str, Any] = json.loads(text)
        raw["emulated"] = Emulated(**raw["emulated"])
        raw["gpt"] = GPTSpec(**raw["gpt"])
        return Job(**raw)

    def with_steps(self, warmup: int, steps: int) -> Job:
        return replace(self, warmup=warmup, steps=steps)


def bound_s(job: Job) -> float | None:
    """The step time of ``job``'s layout with free communication and no runtime cost (emulated models only).

    Pipelines: ``(m·v + p − 1)·(f + b)`` with ``f``, ``b`` one stage's forward and backward time per
    micro-batch (``L / (p·v)`` layers), the breadth-first fill and drain; for ``m < p`` every loop waits for its
    first micro-batch to come round, ``(m·v + v·(p − m) + m − 1)·(f + b)``. ``v = 1`` gives GPipe's and 1F1B's
    ``(m + p − 1)·(f + b)``. Data parallelism alone has no bubble: a rank's own samples through every layer.
    """
    if job.model != "emulated" or job.kind in ("independent", "stage_compute", "collectives"):
        return None
    e = job.emulated
    per_layer = (e.forward_ms + e.backward_ms) / 1e3
    if job.kind == "fsdp":
        return job.m * e.layers * per_layer
    p, v, m = job.p, job.v, job.m
    stage = per_layer * e.layers / (p * v)
    slots = m * v + p - 1 if m >= p else m * v + v * (p - m) + m - 1
    return slots * stage


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.3g} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")
