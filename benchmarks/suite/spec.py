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
TORCH_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B", "gpipe", "1f1b")
# torch's zero-bubble schedules: their orders have no closed-form bound here (see bound_s)
TORCH_ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")
# placed in a V (rank r holds stages r and 2p − 1 − r, exactly two per rank) instead of looping
V_SCHEDULES = ("ZBVZeroBubble",)


@dataclass(frozen=True)
class Emulated:
    """An emulated accelerator's model: ``layers`` identical layers (the knobs of the suite).

    Times are per layer and per micro-batch of the job's ``microbatch_size`` samples, and scale with the rows a
    layer actually receives (a rank of a data-parallel-only run that gets two micro-batches' worth of samples
    takes twice as long), as an accelerator past its small-batch regime does. ``weight_grad_ms`` set splits the
    backward in two autograd nodes, as zero-bubble schedules split it: ``backward_ms`` is then the input-gradient
    time and ``weight_grad_ms`` the weight-gradient time (a full backward takes both); ``None`` is one node.
    """

    layers: int = 16
    forward_ms: float = 5.0
    backward_ms: float = 10.0
    param_numel: int = 16_384  # fp32 values per layer: what FSDP gathers and reduces
    activation_numel: int = 4096  # fp32 values per sample at each layer boundary: what the pipeline sends
    weight_grad_ms: float | None = None

    @property
    def times_s(self) -> tuple[float, float, float]:
        """Forward, input-gradient and weight-gradient seconds per layer (an unsplit backward: all input)."""
        return self.forward_ms / 1e3, self.backward_ms / 1e3, (self.weight_grad_ms or 0.0) / 1e3

    def describe(self) -> str:
        backward = (
            f"{self.backward_ms:g} ms bwd"
            if self.weight_grad_ms is None
            else f"{self.backward_ms:g} ms input grad + {self.weight_grad_ms:g} ms weight grad"
        )
        return (
            f"{self.layers} layers × ({self.forward_ms:g} ms fwd + {backward} per micro-batch,"
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
    # bfpp_hand and torch kinds: after each step's backward, the all-reduce of the gradients' norm over every rank
    # that clipping issues (torchtitan clips by default): a training loop's one collective per step, which ends the
    # step on every rank together, as BFPPStrategy's shared step does (without it a rank starts the next step
    # while another still drains this one)
    step_sync: bool = False
    # the bfpp kind with schedule="auto": the planner chooses the schedule (and with v=0 the stages per rank) at the
    # job's p and m, on this machine description (a Cluster JSON, e.g. from `plan calibrate`; "": assumed links)
    cluster: str = ""

    @property
    def global_rows(self) -> int:
        """Samples per optimizer step over all processes (independent processes: per process)."""
        if self.kind == "fsdp":
            return self.processes * self.m * self.microbatch_size
        if self.kind == "independent":
            return self.microbatch_size
        return self.dp * self.m * self.microbatch_size

    @property
    def planned(self) -> bool:
        """Whether the planner chooses the schedule (``schedule="auto"``)."""
        return self.kind == "bfpp" and self.schedule == "auto"

    @property
    def layout(self) -> str:
        if self.planned:
            v = "auto" if not self.v else self.v
            return f"p={self.p} v={v} m={self.m} dp={self.dp}" + (f" {self.sharding}" if self.dp > 1 else "")
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

    ``f``, ``i``, ``w`` are one stage's forward, input-gradient and weight-gradient time per micro-batch
    (``L / (p·v)`` layers; an unsplit layer's backward counts as ``i`` with ``w = 0``), ``b = i + w``.

    Pipelines: ``(m·v + p − 1)·(f + b)``, the breadth-first fill and drain; for ``m < p`` every loop waits for
    its first micro-batch to come round, ``(m·v + v·(p − m) + m − 1)·(f + b)``; both are ``S·(f + b)`` with
    ``S = p − 1 + max(m·v, p·v + m − p)`` slots. ``v = 1`` gives GPipe's and 1F1B's ``(m + p − 1)·(f + b)``.

    bfpp's ``breadth_first_zb`` (every forward sweep, then the input-gradient sweeps; weight gradients only
    after their own input gradient): the last rank ends its forwards at ``T = S·f`` at the earliest, and rank 0's
    first input gradient comes down ``p − 1`` ranks later, after which it still has all its ``v·m`` input and
    weight gradients, ``T + (p − 1)·i + v·m·(i + w)``; its last loop (stage 0) cannot start before the input
    gradients' chain, ``p·v − 1`` of them, has reached it, and then takes ``m·(i + w)``:
    ``max(T + (p − 1)·i + v·m·(i + w), T + (p·v − 1 + m)·i + m·w)``. For ``m ≥ p`` the first term wins:
    ``v·m·(f + i + w) + (p − 1)·(f + i)``, which is ``3·v·m + 2·(p − 1)`` units when ``f = i = w``. It bounds
    every order that keeps the sweeps, and the schedule reaches it at ``f = i = w``.

    torch's zero-bubble schedules (``TORCH_ZERO_BUBBLE``) get no bound: their orders (ZB1P with the idle slots it
    inserts, ZB-V padded to ``2p − 1`` micro-batches) are not closed forms of the layout, and the bounds above are
    not theirs (ZB1P interleaves input gradients with forwards, so it is not held to the sweeps: replayed with free
    communication and ``f = i = w`` at p=4 v=2 m=4, torch 2.13's orders take 27 units for ZB1P and 30 for ZB-V,
    against ``breadth_first_zb``'s 30 and ``breadth_first``'s 33). Data parallelism alone has no bubble: a rank's
    own samples through every layer.
    """
    if job.model != "emulated" or job.kind in ("independent", "stage_compute", "collectives") or job.planned:
        return None
    if job.kind == "torch" and job.schedule in TORCH_ZERO_BUBBLE:
        return None
    e = job.emulated
    f, i, w = e.times_s
    if job.kind == "fsdp":
        return job.m * e.layers * (f + i + w)
    p, v, m = job.p, job.v, job.m
    layers_per_stage = e.layers / (p * v)
    slots = p - 1 + max(m * v, p * v + m - p)
    if job.kind in ("bfpp", "bfpp_hand") and job.schedule == "breadth_first_zb":
        forwards = slots * f
        zero_bubble = max(forwards + (p - 1) * i + v * m * (i + w), forwards + (p * v - 1 + m) * i + m * w)
        return zero_bubble * layers_per_stage
    return slots * (f + i + w) * layers_per_stage


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.3g} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")
