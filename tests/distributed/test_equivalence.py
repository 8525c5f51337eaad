"""Pipelined training equals one-device training: losses at every step and final parameters, in fp32.

For (p, dp, v, m) in {(2,1,2,4), (2,2,2,4), (4,1,2,8)} and each sharding, the module is trained with
BFPPStrategy on CPU processes (gloo) and with ``strategy="auto"`` on one process on the same global batches;
the logged loss of every step on every rank, and every final parameter, must agree within 1e-5 relative.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import assert_params_match, assert_steps_match, launch, relative_error
from tests.models import RunSpec, assert_same_predictions, make_model, reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

SHARDINGS = ("full_shard", "shard_grad_op", "no_shard")
LAYOUTS = {2: [(2, 1, 2, 4)], 4: [(2, 2, 2, 4), (4, 1, 2, 8)]}
TOL = 1e-5


def make_run(
    p: int,
    dp: int,
    v: int,
    m: int,
    sharding: str,
    optimizer: str = "sgd",
    schedule: str = "breadth_first",
    group: int | None = None,
) -> RunSpec:
    name = f"p{p}_dp{dp}_v{v}_m{m}_{sharding}_{optimizer}"
    if schedule != "breadth_first":
        name = f"{schedule}{'' if group is None else f'_n{group}'}_{name}"
    return RunSpec(
        name=name,
        strategy={
            "pipeline_parallel_size": p,
            "stages_per_rank": v,
            "num_microbatches": m,
            "schedule": schedule,
            "sharding": sharding,
            **({} if group is None else {"microbatch_group_size": group}),
        },
        # dict batches on one layout so both batch structures go through the pipeline
        data={"batch_format": "dict" if (p, dp) == (2, 2) else "tuple"},
        # SGD is sensitive to the gradients' scale (Adam is not), so a wrong 1/m or 1/dp cannot hide
        model={"optimizer": optimizer},
        local_batch_size=m * 2,
        data_parallel_size=dp,
    )


RUNS = {world: [make_run(*layout, s) for layout in layouts for s in SHARDINGS] for world, layouts in LAYOUTS.items()}
# AdamW keeps per-parameter state, which must be sharded along with the parameters
RUNS[4].append(make_run(2, 2, 2, 4, "full_shard", optimizer="adamw"))
# every schedule of the family goes through the same runtime and must give the same result
RUNS[4] += [
    make_run(2, 2, 2, 4, "full_shard", schedule="depth_first"),
    make_run(4, 1, 2, 8, "shard_grad_op", schedule="depth_first"),
    make_run(2, 2, 2, 4, "full_shard", schedule="depth_first", group=4),
    make_run(4, 1, 1, 8, "full_shard", schedule="1f1b"),
    make_run(2, 2, 1, 4, "no_shard", schedule="gpipe"),
]
RUNS[2] += [make_run(2, 1, 3, 8, "full_shard", schedule="depth_first", group=4)]
# strided tensors at stage boundaries: the last stage is the transposing layer alone, and the loss's
# gradient is expanded; both must cross the pipeline as dense tensors
_strided = make_run(2, 1, 2, 4, "full_shard")
_strided.name = "strided_boundaries"
_strided.model["strided"] = True
_strided.strategy["partition"] = [3, 4, 3, 1]
RUNS[2].append(_strided)
# the other mesh order: a data-parallel group's ranks are consecutive (kept inside a node)
_replicas_inner = make_run(2, 2, 2, 4, "full_shard")
_replicas_inner.name += "_pipeline_data"
_replicas_inner.strategy["mesh_order"] = "pipeline_data"
RUNS[4].append(_replicas_inner)
# gradient reductions overlapping the backward: on a communication thread (gloo's way) and the CUDA way (FSDP2's
# reduction stream, final callbacks after the last action; on CPU the streams are no-ops, the order is the same).
# SGD for both, so a reduction of the wrong scale on either path shows
for _mode, _sharding in (("thread", "full_shard"), ("thread", "shard_grad_op"), ("stream", "full_shard")):
    _overlap = make_run(2, 2, 2, 4, _sharding)
    _overlap.name += f"_overlap_{_mode}"
    _overlap.strategy["overlap_reductions"] = _mode
    RUNS[4].append(_overlap)
_overlap_depth_first = make_run(2, 2, 2, 4, "full_shard", schedule="depth_first")
_overlap_depth_first.name += "_overlap_thread"
_overlap_depth_first.strategy["overlap_reductions"] = "thread"
RUNS[4].append(_overlap_depth_first)
# `Trainer(devices=4, strategy="bfpp")` with every default: p=4, dp=1, v=2 (10 layers), m=p=4
RUNS[4].append(
    RunSpec(name="registered_defaults", strategy={"name": "bfpp"}, model={"optimizer": "sgd"}, local_batch_size=8)
)


# predictions at (p=2, dp=1): the pipeline's last stage merges its micro-batches' outputs into one device's
PREDICTING = next(r for r in RUNS[2] if r.name == "p2_dp1_v2_m4_full_shard_sgd")
PREDICTING.checks.append("predict")
PREDICTING.model["predict_output"] = "labelled"


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    return {world: tmp_path_factory.mktemp(f"world{world}") for world in RUNS}


@pytest.fixture(scope="module")
def results(workdirs):
    out = {}
    for world, runs in RUNS.items():
        out.update(launch(runs, world, workdirs[world], timeout=480))
    return out


@pytest.mark.parametrize("run", [r for runs in RUNS.values() for r in runs], ids=lambda r: r.name)
def test_matches_single_device(run, results):
    """Every run's losses and final parameters against one device's.

    The ``_overlap_stream`` run checks the stream mode's host-side order (post-backward per stage as the
    schedule reaches it, the final callbacks after the last action) and, with SGD, the scale of its reduced
    gradients. On CPU the CUDA streams are no-ops: whether the reduction really runs on FSDP2's reduction
    stream, overlaps the backward and is waited for before the optimizer step is not checked here.
    """
    ref = reference_run(run)
    result = results[run.name]
    assert len(ref.steps) == 6
    assert_steps_match(result, ref, tol=TOL, keys=("train_loss", "samples", "max_err"))
    for rank_result in result.ranks:
        for got, want in zip(rank_result["steps"], ref.steps, strict=True):
            assert got["progress_bar"]["train_loss"] == pytest.approx(want["progress_bar"]["train_loss"], rel=TOL)
            assert got["returned_loss"] == pytest.approx(want["returned_loss"], rel=TOL)
    if run.name == "registered_defaults":
        assert sorted(r["holdings"]["pipeline_rank"] for r in result.ranks) == [0, 1, 2, 3]
    if run.name.endswith("_pipeline_data"):  # global ranks 0 and 1 are the two replicas of pipeline rank 0
        placement = [(r["holdings"]["pipeline_rank"], r["holdings"]["data_parallel_rank"]) for r in result.ranks]
        assert placement == [(0, 0), (0, 1), (1, 0), (1, 1)]
    threads = {e[3] for r in result.ranks for e in r["timed"] if e[1] == "reduce_on"}
    if run.name.endswith("_overlap_thread"):  # every stage's reduction ran on the communication thread
        assert threads and all(t.startswith("bfpp-reduce") for t in threads), threads
    elif threads:
        assert threads == {"MainThread"}, threads
    assert_params_match(result, ref, tol=TOL)
    # the parameters actually moved, so agreeing is not trivial
    initial = make_model(run).state_dict()
    assert min(relative_error(ref.params[k], initial[k]) for k in ref.params if k.endswith("weight")) > 1e-3


def test_predict_returns_one_devices_batches(results, workdirs):
    """At (p=2, dp=1) both pipeline ranks return one device's batches: per-sample tensors and label strings
    concatenated over the micro-batches, the batch-level constant once per batch."""
    assert PREDICTING.name in results
    ref = reference_run(PREDICTING).extras["predict"]
    assert len(ref) == 4 and set(ref[0]) == {"prediction", "argmax", "labels", "head"}
    for rank in range(2):
        got = torch.load(workdirs[2] / "out" / PREDICTING.name / f"predictions_rank{rank}.pt")
        assert_same_predictions(got, ref, TOL, where=f"rank {rank}")
