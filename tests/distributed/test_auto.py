"""``pipeline_parallel_size="auto"``: the planner measures the module and picks one layout for all ranks."""

from __future__ import annotations

import dataclasses

import pytest

from tests.distributed.harness import assert_params_match, assert_steps_match, launch
from tests.models import RunSpec, reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def test_planner_chooses_one_layout_and_training_matches_one_device(tmp_path):
    run = RunSpec(name="auto", strategy={"pipeline_parallel_size": "auto"}, model={"optimizer": "sgd"},
                  local_batch_size=8, trainer={"max_steps": 4})  # fmt: skip
    result = launch([run], 4, tmp_path, timeout=500)["auto"]
    layouts = [r["holdings"]["layout"] for r in result.ranks]
    assert all(layout == layouts[0] for layout in layouts)  # decided once, broadcast
    chosen = layouts[0]
    assert chosen["p"] * chosen["dp"] == 4 and 8 % chosen["m"] == 0
    # whatever it chose, the training is the one-device training of the same global batch
    ref = reference_run(dataclasses.replace(run, data_parallel_size=chosen["dp"]))
    assert_steps_match(result, ref, tol=1e-5)
    assert_params_match(result, ref, tol=1e-5)
