"""The schedules with a split backward train equal to one device.

``schedule="breadth_first_zb"``: breadth-first's sweeps with the backward split into input gradients (``I``,
torch's ``BACKWARD_INPUT``) and weight gradients (``W``, ``BACKWARD_WEIGHT``), the weight gradients placed where
the rank would wait (:func:`lightning_bfpp.plan.schedules.breadth_first.breadth_first_zb`). On 4 CPU processes,
fp32, SGD (a wrong gradient scale shows): p=2 dp=2 v=2 m=4 with each sharding, with the reductions on the
communication thread, with gradient accumulation over 2 batches, with a weight tied across stages (the first and
last blocks', clipped), with activation checkpointing, and p=4 dp=1 v=2 m=2 (fewer micro-batches than ranks, where
the weight gradients also fill the waits between sweeps).

``schedule="interleaved_zb"`` (torch's ZB-H1 order, looping placement) and ``schedule="zbv"`` (ZB-V: the stages in
a V, the tied first and last blocks then on one rank), each at p=2 dp=2 v=2 m=4 under ``full_shard``: plain, with
the tied weight (clipped), and with frozen parameters (the embedding and one block's weight) and gradient
accumulation over 2 batches.

Every step's loss on every rank and every final weight within 1e-5 of one device's; frozen weights unchanged.
"""

from __future__ import annotations

import pytest

from tests.distributed.harness import assert_trained_as_on_one_device, launch
from tests.models import RunSpec

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

TOL = 1e-5
ZB = {"schedule": "breadth_first_zb", "pipeline_parallel_size": 2, "stages_per_rank": 2, "num_microbatches": 4}


def zb_run(name: str, strategy=None, model=None, dp: int = 2, batch: int = 8, **kwargs) -> RunSpec:
    return RunSpec(
        name=f"zb_{name}",
        strategy={**ZB, **(strategy or {})},
        model={"optimizer": "sgd", **(model or {})},
        local_batch_size=batch,
        data_parallel_size=dp,
        **kwargs,
    )


RUNS = [
    zb_run("full_shard"),
    zb_run("shard_grad_op", {"sharding": "shard_grad_op"}),
    zb_run("no_shard", {"sharding": "no_shard"}),
    zb_run("overlap_thread", {"overlap_reductions": "thread"}),
    zb_run("accumulate", trainer={"accumulate_grad_batches": 2, "max_steps": 3}),
    zb_run("tied_clipped", model={"tie_blocks": True}, trainer={"gradient_clip_val": 0.05}),
    zb_run("p4_m2", {"pipeline_parallel_size": 4, "num_microbatches": 2}, dp=1, batch=8),
    # the input-gradient pass recomputes the layer; the weight pass reads what that recomputation saved
    zb_run("recompute", {"activation_checkpointing": True}),
]
FROZEN = {"frozen": ["embed", "blocks.1.up.weight"]}
for _schedule in ("interleaved_zb", "zbv"):
    _kind = {"schedule": _schedule}
    RUNS += [
        zb_run(f"{_schedule}_full_shard", _kind),
        zb_run(f"{_schedule}_tied_clipped", _kind, model={"tie_blocks": True}, trainer={"gradient_clip_val": 0.05}),
        zb_run(
            f"{_schedule}_frozen_accumulate",
            _kind,
            model=FROZEN,
            trainer={"accumulate_grad_batches": 2, "max_steps": 3},
        ),
    ]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(RUNS, 4, tmp_path_factory.mktemp("zero_bubble"), timeout=540)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.name)
def test_trains_as_on_one_device(run, results):
    assert_trained_as_on_one_device(results[run.name], run, tol=TOL)


def test_every_backward_is_split_into_input_and_weight_actions(results):
    """The runs above executed split backwards: every rank's action list holds one ``BACKWARD_INPUT`` and one
    ``BACKWARD_WEIGHT`` per forward and no whole ``FULL_BACKWARD`` (an unsplit list would train the same)."""
    for run in RUNS:
        for rank in results[run.name].ranks:
            placements = rank["holdings"]["receive_placement"]
            assert placements, f"{run.name}: no pipeline schedule was built"
            for placement in placements:
                kinds = placement["kinds"]
                assert kinds.get("FULL_BACKWARD", 0) == 0, (run.name, kinds)
                assert kinds["FORWARD"] == kinds["BACKWARD_INPUT"] == kinds["BACKWARD_WEIGHT"] > 0, (run.name, kinds)
