"""The oldest supported torch trains as one device does: one launch with each runner and a checkpoint resume.

CI runs the whole suite on the newest supported torch and, on the oldest, the unit tier (the compatibility checks
among it) and this module: its action lists lack the newer runtime's wait actions (lightning_bfpp.engine.torch_ir),
and its FSDP2 reductions go through the private post-backward, overlapped here on the communication thread. On
any other torch these runs are part of the whole suite already (test_equivalence, test_weight_passing,
test_checkpoint), so the module skips there.
"""

from __future__ import annotations

import os

import pytest
import torch

from lightning_bfpp.engine._compat import SUPPORTED_TORCH, torch_version
from tests.distributed.harness import assert_trained_as_on_one_device, launch, relative_error
from tests.models import RunSpec

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.oldest_torch,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        torch_version() != SUPPORTED_TORCH[0], reason="the whole suite covers these runs on a newer torch"
    ),
]

TOL = 1e-5
BREADTH_FIRST = {"pipeline_parallel_size": 2, "stages_per_rank": 2, "num_microbatches": 4}


def run(name: str, strategy: dict, local_batch_size: int, data_parallel_size: int, **fields) -> RunSpec:
    fields.setdefault("model", {"optimizer": "adamw"})
    return RunSpec(
        name=name,
        strategy=strategy,
        data={"num_samples": 48},
        local_batch_size=local_batch_size,
        data_parallel_size=data_parallel_size,
        **fields,
    )


EPOCHS = {"max_epochs": 2, "max_steps": -1}  # 3 steps per epoch: a resume after epoch 1 replays the same batches
RUNS = {
    "stages": run("stages", {**BREADTH_FIRST, "overlap_reductions": "thread"}, 8, 2, trainer=EPOCHS),
    "weight_passing": run(
        "weight_passing",
        {"schedule": "weight_passing", "processes_per_node": 2, "num_microbatches": 2},
        4,
        4,
        trainer={"max_steps": 3},
    ),
    "half": run("half", BREADTH_FIRST, 8, 2, trainer={"max_epochs": 1, "max_steps": -1}, checks=["save_at_end"]),
    "resumed": run("resumed", BREADTH_FIRST, 8, 2, trainer=EPOCHS, resume_from="half/end.ckpt"),
}


# a newer torch's checkpoint of test_checkpoint.py's "half" run, which CI's newest-torch part leaves here: its folder
# (whose index this torch may not read), the folder consolidated into one file, and that run resumed from the folder
CROSS_VERSION_DIR = os.environ.get("BFPP_CROSS_VERSION_DIR")
CHECKPOINT_RUN = {  # test_checkpoint.py's layout and model: p=2 dp=2 v=2, AdamW over two groups, a step scheduler
    "model": {"optimizer": "adamw", "param_groups": 2, "scheduler": "step"},
    "trainer": EPOCHS,
}
if CROSS_VERSION_DIR:
    RUNS["newer_folder"] = run(
        "newer_folder", BREADTH_FIRST, 8, 2, resume_from=f"{CROSS_VERSION_DIR}/folder.ckpt", expect_error=True,
        **CHECKPOINT_RUN,
    )  # fmt: skip
    RUNS["newer_file"] = run(
        "newer_file", BREADTH_FIRST, 8, 2, resume_from=f"{CROSS_VERSION_DIR}/consolidated.ckpt", **CHECKPOINT_RUN
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(list(RUNS.values()), 4, tmp_path_factory.mktemp("oldest_torch"), timeout=540)


@pytest.mark.parametrize("name", ["stages", "weight_passing"])
def test_each_runner_trains_as_one_device(name, results):
    assert_trained_as_on_one_device(results[name], RUNS[name], tol=TOL)


def test_a_resume_continues_as_the_straight_run(results):
    straight, resumed = results["stages"], results["resumed"]
    for rank in range(4):
        want = [s["callback_metrics"]["train_loss"] for s in straight.steps(rank)][3:]
        assert [s["callback_metrics"]["train_loss"] for s in resumed.steps(rank)] == pytest.approx(want, rel=TOL)
    assert all(torch.allclose(resumed.params[k], straight.params[k], rtol=TOL, atol=0) for k in straight.params)


@pytest.mark.skipif(not CROSS_VERSION_DIR, reason="CI's newest-torch part leaves its checkpoint for this one")
def test_a_newer_torchs_checkpoint_is_refused_naming_both_releases_and_its_consolidated_file_resumes(results):
    """The newer torch's folder: refused on every rank with one message that names the torch that wrote it and
    this one, and does not call it damaged. The same folder consolidated (under the newer torch) into one file
    resumes here as the newer torch resumed the folder: every loss, weight and optimizer tensor."""
    handed = torch.load(f"{CROSS_VERSION_DIR}/resumed.pt", weights_only=True)
    newer = ".".join(handed["torch"].split(".")[:2])
    errors = {rank["error"] for rank in results["newer_folder"].ranks}
    assert len(errors) == 1, errors
    error = errors.pop()
    assert f"it was written by torch {handed['torch']}" in error, error
    assert f"this process runs torch {torch.__version__}" in error and "The folder is not damaged" in error
    assert f"Either resume under torch {newer} or newer" in error and "lightning_bfpp.consolidate" in error
    resumed = results["newer_file"]
    for rank in range(4):
        got = [s["callback_metrics"]["train_loss"] for s in resumed.steps(rank)]
        assert got == pytest.approx(handed["losses"][rank], rel=1e-6, abs=0)
    for kind in ("params", "optimizer_state"):
        want, got = handed[kind], getattr(resumed, kind)
        assert want and set(got) == set(want), kind
        worst = max(relative_error(got[k], want[k]) for k in want)
        print(f"{kind}: largest relative difference from the newer torch's resume {worst:.1e}")
        assert worst <= 1e-6, (kind, worst)
