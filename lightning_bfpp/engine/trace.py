"""Record what each rank did during a pipelined step: ``BFPPStrategy(trace="dir")``.

While a traced step runs, the tracer hooks torch's pipeline runtime at the points where it already marks
actions (its ``record_function("PP:<action>")`` ranges), where it waits for point-to-point transfers
(``_wait_batch_p2p``), and where it waits for a stage's weights (``_assert_unsharded``), and turns them into
:class:`lightning_bfpp.plan.timeline.Span` records: compute per stage and micro-batch (what the action does
after its waits), waits for neighbours, weight gathers, gradient reductions, and the optimizer step. The
hooks (installed through the runner's ``hooked``: :func:`lightning_bfpp.engine._compat.hooked_runtime`, which names
torch's private points, or weight passing's own)
exist only inside traced steps; with tracing off nothing is installed.

Ranks align their clocks with a barrier at the start of each traced step. Times are host times: on GPUs
the tracer synchronizes the device at span ends so that host time is device time (tracing is for looking,
not for the fastest run).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_bfpp.engine._compat import PipelineScheduleRuntime, hooked_runtime
from lightning_bfpp.plan.timeline import Span, draw, format_summary, summarize, write_chrome_trace, write_spans

_ACTION = re.compile(
    r"^PP:(\d+)(F|B|I|W|UNSHARD|RESHARD|WAIT_REDUCE_GRAD|REDUCE_GRAD|WAIT_SEND_F|WAIT_SEND_B|SEND_F|RECV_F|SEND_B|RECV_B)"
    r"(\d*)$"
)
# actions drawn as one span each, with their stage (and micro-batch); the waits exist from torch 2.15 on
_SPANS = {"REDUCE_GRAD": "reduce", "WAIT_REDUCE_GRAD": "reduce_wait", "UNSHARD": "gather", "SEND_F": "send",
          "SEND_B": "send", "RECV_F": "recv", "RECV_B": "recv", "WAIT_SEND_F": "send_wait",
          "WAIT_SEND_B": "send_wait"}  # fmt: skip


class StepTracer:
    """Collects this rank's spans for one step at a time."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.device = device
        self.spans: list[Span] = []
        self._t0 = 0.0
        self._action: tuple[int, str, int | None] | None = None
        self._compute_from = 0.0

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self._t0

    def start_step(self, group: Any = None) -> None:
        """Align with the other ranks (a barrier), then start this step's clock."""
        self.spans = []
        dist.barrier(group=group)
        self._t0 = time.perf_counter()

    def add(self, kind: str, start: float, end: float, stage: int | None = None, microbatch: int | None = None) -> None:
        self.spans.append(Span(self.rank, kind, start, end, stage, microbatch))

    @contextmanager
    def recording(self, schedule: Any) -> Iterator[None]:
        """Hook a step runner (torch's runtime, or weight passing's) for the duration of one ``schedule.run``:
        its ``hooked(action_range=, p2p_wait=, weight_wait=)`` routes its action ranges and waits through here."""
        with schedule.hooked(
            action_range=self._action_range,
            p2p_wait=partial(self._timed_wait, "p2p_wait"),
            weight_wait=partial(self._timed_wait, "gather_wait"),
        ):
            yield

    @contextmanager
    def recording_torch(self, runtime: PipelineScheduleRuntime) -> Iterator[None]:
        """:meth:`recording` for one of torch's own schedule classes (the benchmarks compare them)."""
        with hooked_runtime(
            runtime,
            action_range=self._action_range,
            p2p_wait=partial(self._timed_wait, "p2p_wait"),
            weight_wait=partial(self._timed_wait, "gather_wait"),
        ):
            yield

    def _action_range(self, original: Callable[[str], Any]) -> Callable[[str], Any]:
        tracer = self

        @contextmanager
        def record(name: str) -> Iterator[None]:
            match = _ACTION.match(name)
            if match is None:
                with original(name):
                    yield
                return
            stage, kind, mb = int(match.group(1)), match.group(2), int(match.group(3)) if match.group(3) else None
            start = tracer.now()
            tracer._action, tracer._compute_from = (stage, kind, mb), start
            try:
                with original(name):
                    yield
            finally:
                end = tracer.now()
                tracer._action = None
                if kind in ("F", "B", "I", "W"):
                    compute = "forward" if kind == "F" else "backward"
                    tracer.add(compute, tracer._compute_from, end, stage, mb)
                elif kind in _SPANS:
                    tracer.add(_SPANS[kind], start, end, stage, mb)

        return record

    def _timed_wait(self, kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
        tracer = self

        def wait(*args: Any, **kwargs: Any) -> Any:
            start = tracer.now()
            result = original(*args, **kwargs)
            end = tracer.now()
            stage, _, mb = tracer._action or (None, None, None)
            if end - start > 0:
                tracer.add(kind, start, end, stage, mb)
            tracer._compute_from = end
            return result

        return wait


def write_step(spans: list[Span], folder: Path, step: int, title: str) -> str:
    """Write one step's Chrome trace, raw spans and PNG timeline; return its summary table."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"step{step:05d}"
    write_chrome_trace(spans, stem.with_suffix(".json"), title)
    write_spans(spans, Path(f"{stem}.spans.json"))
    draw(spans, stem.with_suffix(".png"), title)
    table = format_summary(summarize(spans))
    with (folder / "summary.md").open("a") as f:
        f.write(f"\n## step {step}: {title}\n\n{table}\n")
    return table


class TraceSession:
    """The traced training steps of one run: start each, time its optimizer step, write it on rank 0.

    Owned by ``BFPPStrategy(trace=...)``; kept out of it so that the strategy only says when a step starts,
    when its pipeline part ends, and when training ends. Writing a step gathers every rank's spans on global
    rank 0 (a collective), so it happens at the start of the next step or at the end of training, on every
    rank alike.
    """

    def __init__(
        self,
        folder: Path,
        steps: int,
        rank: int,
        world_size: int,
        device: torch.device,
        report: Callable[[str], None] = print,
    ) -> None:
        self.folder = folder
        self.report = report  # where rank 0 says what it wrote
        self.steps = steps
        self.rank = rank
        self.world_size = world_size
        self.tracer = StepTracer(rank, device)
        self._written = 0
        self._pending: tuple[int, float, str] | None = None  # (global step, pipeline end, title)

    def start_step(self) -> StepTracer | None:
        """Write the previous traced step; return the tracer if this step is traced too."""
        self.flush()
        if self._written >= self.steps:
            return None
        self.tracer.start_step()
        return self.tracer

    def end_pipeline(self, global_step: int, title: str) -> None:
        """The step's pipeline part (schedule and logged-value sync) ended now; its optimizer step follows."""
        self._pending = (global_step, self.tracer.now(), title)

    def optimizer_step_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """For ``Optimizer.register_step_post_hook``: the optimizer ran from the pipeline's end until now."""
        if self._pending is not None:
            self.tracer.add("optimizer", self._pending[1], self.tracer.now())

    def flush(self) -> None:
        """Gather the last traced step's spans on global rank 0 and write them (a collective)."""
        if self._pending is None:
            return
        step, _, title = self._pending
        self._pending = None
        self._written += 1
        gathered: list[Any] = [None] * self.world_size if self.rank == 0 else []
        dist.gather_object(self.tracer.spans, gathered if self.rank == 0 else None, dst=0)
        if self.rank == 0:
            title = f"{title}, step {step + 1}"
            table = write_step([s for spans in gathered for s in spans], self.folder, step + 1, title)
            self.report(f"BFPPStrategy trace of {title} written to {self.folder}\n{table}")
