"""Per-process counters of what a step spent its time on, and what it sent, for every implementation alike.

The same hooks serve bfpp, torch's own schedules and Lightning's FSDP strategy, so they sit below all three,
at names each of them looks up at call time (as ``tests/distributed/worker.py``'s ``EventLog`` does for FSDP2,
re-done here because tests/ is not a library):

- ``torch.distributed.<collective>``: every collective called through the module (FSDP2's all-gathers and
  reduce-scatters, ``replicate``'s all-reduces, the strategies' own all-reduces and broadcasts): count, bytes
  (the largest tensor argument: an all-gather's output, a reduce-scatter's input), and the time the caller
  was blocked in the call (a synchronous collective's whole duration; an asynchronous one's issue time);
- FSDP2's ``FSDPParamGroup.wait_for_unshard``: time waiting for an asynchronously issued weight gather;
- ``torch.distributed.pipelining.schedules._batch_p2p`` / ``_wait_batch_p2p``: point-to-point sends (count,
  bytes) and the time spent waiting for a neighbour's activations or gradients, the pipeline bubble;
- emulated layers add their sleeping time to :data:`COUNTERS` themselves (the emulated accelerator's busy time).

Peak memory (:class:`PeakMemory`) is the most live host memory a step held above the level before the first
step, read from malloc at the same points during the warm-up steps after the first (reading it costs the host
enough to slow the steps it is read in, so the timed steps do not).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_param_group
import torch.distributed.pipelining.schedules as pp_schedules
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

COLLECTIVES = (
    "all_reduce",
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "reduce",
    "broadcast",
    "all_to_all_single",
    "barrier",
    "all_gather_object",
    "broadcast_object_list",
)


@dataclass
class Counters:
    """Cumulative totals for this process; a step's share is the difference of two :meth:`snapshot` s."""

    compute_s: float = 0.0  # emulated accelerator busy time, as slept
    nominal_s: float = 0.0  # what it was asked to sleep: compute_s / nominal_s − 1 is the machine's wake-up lag
    p2p_wait_s: float = 0.0  # waiting for pipeline neighbours
    collective_s: float = 0.0  # blocked inside collective calls
    gather_wait_s: float = 0.0  # waiting for asynchronously issued FSDP weight gathers
    collectives: int = 0
    collective_bytes: int = 0
    gathers: int = 0  # FSDP2's weight gathers among the collectives
    reduce_scatters: int = 0  # FSDP2's gradient reductions among them
    p2p_sends: int = 0
    p2p_send_bytes: int = 0

    by_name: dict[str, int] = field(default_factory=dict)  # every collective, by function name

    def snapshot(self) -> dict[str, Any]:
        return asdict(self)  # copies by_name


COUNTERS = Counters()
_installed = False


def install() -> None:
    """Route the hooked names through counting wrappers, in this process, for good (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is not None:
            setattr(dist, name, _counted_collective(name, original))
    # a collective is one of FSDP2's weight gathers or gradient reductions only when FSDP2 issues it (the
    # strategy's own per-step all-gather uses the same function)
    for hook in ("foreach_all_gather", "foreach_reduce"):
        setattr(fsdp_param_group, hook, _inside_fsdp(getattr(fsdp_param_group, hook)))
    send_batch, wait_batch = pp_schedules._batch_p2p, pp_schedules._wait_batch_p2p

    def batch_p2p(p2p_ops: list[dist.P2POp], desc: str | None = None) -> Any:
        for op in p2p_ops:
            if getattr(op.op, "__name__", "") == "isend":
                COUNTERS.p2p_sends += 1
                COUNTERS.p2p_send_bytes += op.tensor.numel() * op.tensor.element_size()
        return send_batch(p2p_ops, desc=desc)

    def wait_p2p(work: list[dist.Work]) -> None:
        start = time.perf_counter()
        wait_batch(work)
        COUNTERS.p2p_wait_s += time.perf_counter() - start
        MEMORY.sample()

    pp_schedules._batch_p2p = batch_p2p
    pp_schedules._wait_batch_p2p = wait_p2p
    wait_for_unshard = FSDPParamGroup.wait_for_unshard

    def timed_wait_for_unshard(self: FSDPParamGroup) -> None:
        start = time.perf_counter()
        wait_for_unshard(self)
        COUNTERS.gather_wait_s += time.perf_counter() - start
        MEMORY.sample()

    FSDPParamGroup.wait_for_unshard = timed_wait_for_unshard  # type: ignore[method-assign]


_FSDP = threading.local()  # depth > 0 while FSDP2 issues its own collectives on this thread


def _inside_fsdp(original: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        _FSDP.depth = getattr(_FSDP, "depth", 0) + 1
        try:
            return original(*args, **kwargs)
        finally:
            _FSDP.depth -= 1

    return run


def _counted_collective(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        fsdp = getattr(_FSDP, "depth", 0) > 0
        gather = fsdp and name in ("all_gather_single", "all_gather_into_tensor")  # FSDP2's weight gather
        reduce_scatter = fsdp and name in ("reduce_scatter_single", "reduce_scatter_tensor")  # its reduction
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            COUNTERS.collective_s += time.perf_counter() - start
            COUNTERS.collectives += 1
            COUNTERS.collective_bytes += _largest_tensor_bytes((*args, *kwargs.values()))
            COUNTERS.gathers += gather
            COUNTERS.reduce_scatters += reduce_scatter
            COUNTERS.by_name[name] = COUNTERS.by_name.get(name, 0) + 1
            MEMORY.sample()

    counted.__name__ = name
    counted.__wrapped__ = original  # type: ignore[attr-defined]
    return counted


def _largest_tensor_bytes(values: tuple[Any, ...]) -> int:
    sizes = [0]
    for value in values:
        items = value if isinstance(value, (list, tuple)) else (value,)
        total = sum(t.numel() * t.element_size() for t in items if isinstance(t, torch.Tensor))
        sizes.append(total)
    return max(sizes)


# -- memory ---------------------------------------------------------------------------------------------------


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


def _malloc_in_use() -> Callable[[], int] | None:
    """Bytes malloc has handed out and not had back (heap plus mmapped blocks), or None without glibc ≥ 2.33."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2

    def in_use() -> int:
        info = mallinfo2()
        return int(info.uordblks + info.hblkhd)

    return in_use


class PeakMemory:
    """The most live host memory a step held, above the level before the first step.

    torch's CPU tensors come straight from malloc, so malloc's bytes in use follow live tensors; the resident
    size does not (freed blocks stay in glibc's heap), and forcing every large block through mmap to make it
    would turn each allocation into page faults and slow the very steps being measured. So the level is read
    at the points where a step's memory peaks: every emulated layer's forward and backward, every GPT layer's
    forward, every collective, weight-gather wait and point-to-point wait.

    Reading it is not free: ``mallinfo2`` walks every free chunk of every arena, 70–220 µs per read in a
    pipeline rank, dozens of reads per step. Read in the timed steps, it added 9–16 ms of host CPU per rank
    and step to (a)'s layout and lengthened its steps by 4–7%. So the level is read in the untimed warm-up
    steps after the first (see :class:`StepClock`): every step of a run holds the same tensors, and those
    start with the previous step's gradients and optimizer state, as the timed steps do. Where asynchronous
    communication decides when a buffer is freed (FSDP2 under torch's schedules), the peak varies from step to
    step by up to one layer's weights; the full suite runs three such steps per launch.

    The baseline is taken before the first step, where no implementation holds gradients yet (Lightning frees
    them at the start of the next step, a plain loop at the end of its own), so what stays allocated between
    steps (gradients, optimizer state, communication buffers) counts, the same way for every implementation.
    """

    def __init__(self) -> None:
        self._in_use = _malloc_in_use()
        self.baseline = self.peak = 0
        self.sampling = False

    def set_baseline(self) -> None:
        if self._in_use is not None:
            self.baseline = self.peak = self._in_use()

    def start_sampling(self) -> None:
        self.sampling = self._in_use is not None

    def stop_sampling(self) -> None:
        self.sampling = False

    def sample(self) -> None:
        if self.sampling:
            self.peak = max(self.peak, self._in_use())  # type: ignore[misc]

    def result(self) -> dict[str, float | None]:
        if self._in_use is None:
            return {"baseline_mib": None, "step_peak_mib": None}
        return {"baseline_mib": self.baseline / 2**20, "step_peak_mib": (self.peak - self.baseline) / 2**20}


MEMORY = PeakMemory()


class StepClock:
    """Per-step timestamps and counter snapshots of one rank; the timed steps start after ``warmup``."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.marks: list[dict[str, Any]] = []
        self.phases: list[dict[str, Any]] = []

    def mark(self) -> None:
        """Call at the start of every step, and once after the last.

        Peak memory is sampled during the warm-up steps after the first (the first step alone with fewer than two
        warm-up steps), so that the timed steps do not pay for reading it (:class:`PeakMemory`).
        """
        if not self.marks:
            MEMORY.set_baseline()
        first, end = (1, self.warmup) if self.warmup >= 2 else (0, 1)  # the steps that read memory: [first, end)
        if len(self.marks) == first:
            MEMORY.start_sampling()
        elif len(self.marks) == end:
            MEMORY.stop_sampling()
        self.marks.append({"t": time.perf_counter(), "cpu_s": time.process_time(), **COUNTERS.snapshot()})

    def phase(self, name: str) -> None:
        """Call at a named point inside a step (e.g. ``"optimizer"`` where its optimizer step starts)."""
        now, step = time.perf_counter(), len(self.marks) - 1
        self.phases.append({"step": step, "name": name, "t": now, "collective_s": COUNTERS.collective_s})

    def result(self) -> dict[str, Any]:
        return {"marks": self.marks, "phases": self.phases, "warmup": self.warmup, "memory": MEMORY.result()}
