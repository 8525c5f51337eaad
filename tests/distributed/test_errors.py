"""Configuration the pipeline cannot run fails on every rank with one clear message, quickly, never hangs."""

from __future__ import annotations

import pytest

from tests.distributed.harness import run_worker
from tests.models import RunSpec

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@pytest.mark.parametrize(
    ("run", "message"),
    [
        (
            RunSpec(name="bad_split", strategy={"pipeline_parallel_size": 3}),
            "`pipeline_parallel_size=3` must divide the world size (2",
        ),
        (
            RunSpec(
                name="too_few_layers",
                strategy={"pipeline_parallel_size": 2, "stages_per_rank": 4},
                model={"num_blocks": 2},
            ),
            "returns 4 layers, fewer than the 8 stages requested",
        ),
    ],
    ids=lambda x: x.name if isinstance(x, RunSpec) else "",
)
def test_misconfiguration_fails_fast_on_every_rank(run, message, tmp_path):
    proc = run_worker([run], 2, tmp_path, timeout=120)
    assert proc.returncode != 0
    raised = [line for line in proc.stderr.splitlines() if "Error: " in line and message in line]
    agreed = [line for line in raised if "AgreedError" in line]
    # raised by both ranks: the configuration error itself (before any process group), or the setup's
    # agreement on a model check, each chained to the rank's own error
    assert len(agreed or raised) == 2, proc.stderr[-3000:]
    assert not agreed or "failed on every rank" in agreed[0]


def test_breadth_first_with_fewer_microbatches_than_ranks_runs_but_warns(tmp_path):
    run = RunSpec(name="few_microbatches", strategy={"pipeline_parallel_size": 2, "num_microbatches": 1},
                  trainer={"max_steps": 2})  # fmt: skip
    proc = run_worker([run], 2, tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "num_microbatches=1 is smaller than pipeline_parallel_size=2" in proc.stdout + proc.stderr
