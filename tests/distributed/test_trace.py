"""``BFPPStrategy(trace=dir)`` writes what each rank did per step; with tracing off nothing is hooked."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest

from lightning_bfpp.engine._compat import TORCH_WAIT_ACTIONS
from lightning_bfpp.plan.timeline import read_spans
from tests.distributed.harness import launch
from tests.models import RunSpec

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

LAYOUT = {"pipeline_parallel_size": 2, "stages_per_rank": 2, "num_microbatches": 4}


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("trace")
    trace_dir = workdir / "trace"
    runs = [
        RunSpec(
            name="traced",
            strategy={**LAYOUT, "trace": str(trace_dir), "trace_steps": 2},
            trainer={"max_steps": 3},
            local_batch_size=8,
            data_parallel_size=2,
        ),
        RunSpec(name="untraced", strategy=LAYOUT, trainer={"max_steps": 2}, local_batch_size=8, data_parallel_size=2),
        RunSpec(
            name="traced_overlapped",
            strategy={
                **LAYOUT,
                "trace": str(trace_dir / "overlapped"),
                "trace_steps": 1,
                "overlap_reductions": "thread",
            },
            trainer={"max_steps": 2},
            local_batch_size=8,
            data_parallel_size=2,
        ),
    ]
    return trace_dir, launch(runs, 4, workdir, timeout=400)


def test_trace_files_per_step(traced):
    trace_dir, _ = traced
    names = sorted(p.name for p in trace_dir.iterdir() if p.is_file())
    assert names == [
        "step00001.json",
        "step00001.png",
        "step00001.spans.json",
        "step00002.json",
        "step00002.png",
        "step00002.spans.json",
        "summary.md",
    ]  # fmt: skip  (trace_steps=2 of 3 steps)
    chrome = json.loads((trace_dir / "step00002.json").read_text())
    events = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    assert {"0F0", "2B3", "1F3", "3B0"} <= {e["name"] for e in events}
    assert all(e["dur"] >= 0 for e in events)
    assert (trace_dir / "step00002.png").stat().st_size > 10_000
    summary = (trace_dir / "summary.md").read_text()
    assert summary.count("| rank | step (ms) | busy | bubble") == 2


def test_spans_show_the_breadth_first_schedule(traced):
    trace_dir, _ = traced
    spans = read_spans(trace_dir / "step00002.spans.json")
    for rank in range(4):
        mine = [s for s in spans if s.rank == rank]
        kinds = Counter(s.kind for s in mine)
        # v·m forwards and backwards, one weight gather and one gradient reduction per stage: at v = 2 under
        # full_shard both local stages are gathered together during the first forward anyway, so neither is
        # released between its sweeps
        assert (kinds["forward"], kinds["backward"], kinds["gather"], kinds["reduce"]) == (8, 8, 2, 2)
        compute = [s for s in sorted(mine, key=lambda s: s.start) if s.kind in ("forward", "backward")]
        stages = [s.stage for i, s in enumerate(compute) if i == 0 or compute[i - 1].stage != s.stage]
        pipeline_rank = compute[0].stage
        assert stages == [pipeline_rank, pipeline_rank + 2, pipeline_rank]  # one visit per stage and sweep
        assert all(b.start >= a.end - 1e-6 for a, b in itertools.pairwise(compute))
        assert any(s.kind == "optimizer" for s in mine)
        # torch ≥ 2.15's wait actions, each with its stage (and a send's micro-batch): one per reduction, one per send
        local = {pipeline_rank, pipeline_rank + 2}
        if TORCH_WAIT_ACTIONS:
            assert sorted(s.stage for s in mine if s.kind == "reduce_wait") == sorted(local)
            sends = sorted((s.stage, s.microbatch) for s in mine if s.kind == "send")
            assert sorted((s.stage, s.microbatch) for s in mine if s.kind == "send_wait") == sends and sends
            assert all(s.stage in local and s.microbatch is not None for s in mine if s.kind == "send_wait")
        else:
            assert not kinds["reduce_wait"] and not kinds["send_wait"]


def test_runtime_is_hooked_during_traced_steps_only(traced):
    """The worker notes, at every stage forward, whether torch's runtime globals are replaced: the traced run
    shows the check sees the tracer's hooks (steps 1 and 2 of 3), the untraced run that nothing is hooked."""
    _, res = traced
    for rank_result in res["traced"].ranks:
        assert rank_result["holdings"]["hooked_steps"] == [1, 2]  # trace_steps=2 of 3
        assert rank_result["holdings"]["runtime_untouched"]  # restored after the last traced step
    for rank_result in res["untraced"].ranks:
        assert rank_result["holdings"]["hooked_steps"] == []
        assert rank_result["holdings"]["runtime_untouched"]


def test_overlapped_reductions_show_as_the_wait_at_the_steps_end(traced):
    """With reductions on the communication thread, each stage's REDUCE_GRAD only hands its reduction over, and
    the time still waited for them is one span after the schedule's last compute, counted as exposed."""
    trace_dir, _ = traced
    spans = read_spans(trace_dir / "overlapped" / "step00001.spans.json")
    for rank in range(4):
        mine = sorted((s for s in spans if s.rank == rank), key=lambda s: s.start)
        reduces = [s for s in mine if s.kind == "reduce"]
        last_compute = max(s.end for s in mine if s.kind in ("forward", "backward"))
        assert len(reduces) == 3  # two hand-overs, one wait
        assert reduces[-1].start >= last_compute - 1e-6
    assert "exposed data-parallel comm" in (trace_dir / "overlapped" / "summary.md").read_text()
