"""A weight tied across pipeline stages (the head reusing the embedding's weight) trains as on one device.

The model (``tests.tied_models``) has ``head[1].weight is embed.weight``; the embedding sits on the first stage
and the head on the last, so each stage holds a copy. Every step's loss and gradient norm (clipping is active
on every step) and every final parameter must equal one device's within 1e-5 in fp32, and the copies must be
equal to each other, bit for bit: their gradients are summed over the tie, so the optimizer updates them alike.

Clipping at 0.5 (the gradient norms are 1.4–1.5) keeps the clipped gradients away from AdamW's `eps` (1e-8),
where an element's update follows the last bits of its gradient. At 0.05, on an AVX-512 CPU, one device fed the
same batches as accumulated micro-batches of 2 ended 1.9e-5 (relative) from one device fed whole batches, in a
LayerNorm bias, exactly where and as far as the pipeline (micro-batches of 2) ended: reduction order, not the
pipeline, yet above 1e-5. At 0.5 every run here is within 3e-6 of one device.

4 processes: full_shard (p=2, dp=2, v=2) saving a checkpoint after epoch 1, resumed at (p=4, dp=1, v=1) and at
(p=1, dp=4, v=2) (owner and copy on one rank), each equal to an uninterrupted one-device run, as is a one-device
checkpoint file resumed at (p=2, dp=2, v=2); no_shard; shard_grad_op; gradient accumulation; a meta-device
model. 2 processes: (p=2, dp=1), where stages are plain modules; copies that `configure_optimizers` puts in
different parameter groups, refused on every rank.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from lightning_bfpp.engine.checkpoint import TIED_KEY
from tests.distributed.harness import REPO, assert_started_as_one_process, launch, relative_error
from tests.models import PipeNet, RunSpec, make_model_as_the_run_does, reference_run
from tests.tied_models import TIED_MODEL, tied_net

pytestmark = [pytest.mark.distributed]

TOL = 1e-5
P2_DP2_V2 = {"pipeline_parallel_size": 2, "stages_per_rank": 2, "num_microbatches": 4}
# (strategy, local batch size, data-parallel size) for a global batch of 16
LAYOUTS = {
    "p2_dp2_v2": (P2_DP2_V2, 8, 2),
    "p2_dp2_v2_no_shard": ({**P2_DP2_V2, "sharding": "no_shard"}, 8, 2),
    "p2_dp2_v2_shard_grad_op": ({**P2_DP2_V2, "sharding": "shard_grad_op"}, 8, 2),
    "p4_dp1_v1": ({"pipeline_parallel_size": 4, "stages_per_rank": 1, "num_microbatches": 4}, 16, 1),
    "p1_dp4_v2": ({"pipeline_parallel_size": 1, "stages_per_rank": 2, "num_microbatches": 2}, 4, 4),
    "p2_dp1_v2": (P2_DP2_V2, 16, 1),
}
TIED = ("embed.weight", "head.1.weight")


def run(name: str, layout: str, epochs: int = 1, trainer=None, samples: int = 48, model=None, **kwargs) -> RunSpec:
    """48 samples in global batches of 16: 3 steps per epoch, epoch-based, clipping active on every step."""
    strategy, batch, dp = LAYOUTS[layout]
    return RunSpec(
        name=name,
        strategy=dict(strategy),
        model={**TIED_MODEL, "lr": 3e-3, **(model or {})},
        data={"num_samples": samples},
        trainer={"max_epochs": epochs, "max_steps": -1, "gradient_clip_val": 0.5, **(trainer or {})},
        local_batch_size=batch,
        data_parallel_size=dp,
        model_factory="tests.tied_models:tied_net",
        **kwargs,
    )


RUNS_4 = [
    run("full_shard", "p2_dp2_v2", checks=["save_at_end"]),
    run("resume_p4", "p4_dp1_v1", epochs=2, resume_from="full_shard/end.ckpt"),
    run("resume_same_rank", "p1_dp4_v2", epochs=2, resume_from="full_shard/end.ckpt"),
    run("no_shard", "p2_dp2_v2_no_shard"),
    run("shard_grad_op", "p2_dp2_v2_shard_grad_op"),
    # SGD: a gradient-scale error over the window shows at once, and no update sits in AdamW's `eps` regime,
    # where on an AVX-512 CPU the summation order alone moved a weight 2.3e-5 (relative) from one device's
    run("accumulate", "p2_dp2_v2", trainer={"accumulate_grad_batches": 3}, samples=96, model={"optimizer": "sgd"}),
    run("meta_device", "p2_dp2_v2", checks=["empty_init", "save_initial_params"]),
]
RUNS_2 = [
    run("no_data_parallel", "p2_dp1_v2"),
    # the head's copy, seen as `head.1.weight`, put in another parameter group than the embedding's
    RunSpec(
        name="grouped_by_name",
        strategy=dict(P2_DP2_V2),
        model=dict(TIED_MODEL),
        local_batch_size=16,
        model_factory="tests.tied_models:tied_net_grouped_by_name",
        expect_error=True,
    ),
]
# a one-device checkpoint (the tied weight under both names, its optimizer state once) resumed under the pipeline
ONE_DEVICE_FILE = "one_device_epoch1.ckpt"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tied")
    (workdir / "four").mkdir()
    (workdir / "two").mkdir()
    single = workdir / ONE_DEVICE_FILE
    reference_run(run("one_device", "p2_dp2_v2"), save_to=str(single))
    from_file = run("from_one_device", "p2_dp2_v2", epochs=2, resume_from=str(single))
    four = launch([*RUNS_4, from_file], 4, workdir / "four", timeout=840)
    two = launch(RUNS_2, 2, workdir / "two", timeout=300)
    return workdir, {**four, **two}


@pytest.fixture(scope="module")
def references():
    by_name = {r.name: r for r in RUNS_4 + RUNS_2}
    return {
        "one_epoch": reference_run(by_name["full_shard"]),
        "two_epochs": reference_run(run("two_epochs", "p2_dp2_v2", epochs=2)),
        "accumulate": reference_run(by_name["accumulate"]),
    }


def losses(steps):
    return [s["callback_metrics"]["train_loss"] for s in steps]


def run_folder(workdir, name):
    """Where the launch that ran ``name`` wrote its files."""
    four = workdir / "four" / "out" / name
    return four if four.exists() else workdir / "two" / "out" / name


def tied_copies(folder):
    """Each copy of the tied weight, with its optimizer state, as the pipeline rank holding it saved it:
    {name: (pipeline rank, {"value" | state name: tensor})}."""
    copies = {}
    for path in sorted(folder.glob("params_pp*.pt")):
        saved = torch.load(path)
        for name in TIED:
            if name in saved:
                assert name not in copies, f"`{name}` saved by two pipeline ranks"
                state = {k.rsplit("/", 1)[1]: v for k, v in saved.items() if k.startswith(f"optimizer/{name}/")}
                copies[name] = (int(path.stem.removeprefix("params_pp")), {"value": saved[name], **state})
    return copies


def assert_matches(result, reference, folder, *, skip_steps: int = 0) -> None:
    """Every rank's losses and gradient norms at every step, and every final parameter, equal one device's; the
    copies of the tied weight, each saved by the pipeline rank holding it (the first and the last), are identical
    to each other, in value and optimizer state, and equal one device's tied weight."""
    want_losses = losses(reference.steps)[skip_steps:]
    want_norms = [s["grad_norm"] for s in reference.steps][skip_steps:]
    for rank, ranked in enumerate(result.ranks):
        got = losses(ranked["steps"])
        assert got == pytest.approx(want_losses, rel=TOL), f"rank {rank}: {got} vs {want_losses}"
        norms = [s["grad_norm"] for s in ranked["steps"]]  # None on a batch that does not step
        assert [n is None for n in norms] == [n is None for n in want_norms], f"rank {rank}"
        pairs = [(g, w) for g, w in zip(norms, want_norms, strict=True) if w is not None]
        assert all(abs(g - w) <= TOL * w for g, w in pairs), f"rank {rank}: {norms} vs {want_norms}"
    assert set(result.params) == set(reference.params)
    worst = max((relative_error(result.params[k], reference.params[k]), k) for k in reference.params)
    assert worst[0] <= TOL, f"largest relative parameter error {worst[0]:.2e} ({worst[1]})"
    copies = tied_copies(folder)
    (owner_rank, owner), (copy_rank, copy) = copies[TIED[0]], copies[TIED[1]]
    last = result.ranks[0]["holdings"]["layout"]["p"] - 1
    assert (owner_rank, copy_rank) == (0, last), (owner_rank, copy_rank)
    assert owner.keys() == copy.keys() and len(owner) > 1 and "value" in owner  # the value and optimizer state
    for key in owner:
        assert torch.equal(owner[key], copy[key]), f"{key}: pipeline rank {owner_rank}'s and {copy_rank}'s copies"
    error = relative_error(copy["value"], reference.params[TIED[0]])
    assert error <= TOL, f"the tied weight is {error:.2e} from one device's"


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", ["full_shard", "no_shard", "shard_grad_op", "no_data_parallel"])
def test_tied_weight_trains_as_on_one_device(name, results, references):
    workdir, res = results
    assert_matches(res[name], references["one_epoch"], run_folder(workdir, name))


@pytest.mark.timeout(1500)
def test_gradient_accumulation(results, references):
    workdir, res = results
    steps = res["accumulate"].steps(0)
    assert len(steps) == 6 and sum(s["grad_norm"] is not None for s in steps) == 2  # 2 optimizer steps
    assert_matches(res["accumulate"], references["accumulate"], run_folder(workdir, "accumulate"))


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", ["resume_p4", "resume_same_rank", "from_one_device"])
def test_resume_under_another_layout(name, results, references):
    """Saved at (p=2, dp=2, v=2), resumed where the copy is on another rank (p=4) or on the owner's (p=1); and
    a one-device (``strategy="auto"``) checkpoint file resumed at (p=2, dp=2, v=2)."""
    workdir, res = results
    assert_matches(res[name], references["two_epochs"], run_folder(workdir, name), skip_steps=3)


@pytest.mark.timeout(1500)
def test_checkpoint_stores_the_tied_weight_once(results):
    workdir, _ = results
    folder = workdir / "four" / "out" / "full_shard" / "end.ckpt"
    keys = set(FileSystemReader(folder).read_metadata().state_dict_metadata)
    assert "model.embed.weight" in keys and "model.head.1.weight" not in keys
    assert any(k.startswith("optimizer_0.state.embed.weight.") for k in keys)
    assert not any(".head.1.weight." in k for k in keys)
    assert torch.load(folder / "meta.pt", weights_only=False)[TIED_KEY] == {"head.1.weight": "embed.weight"}


@pytest.mark.timeout(1500)
def test_consolidated_checkpoint_loads_into_a_tied_model_on_one_device(results, tmp_path):
    workdir, res = results
    folder = workdir / "four" / "out" / "full_shard" / "end.ckpt"
    single_file = tmp_path / "consolidated.ckpt"
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    cmd = [sys.executable, "-m", "lightning_bfpp.adapter.consolidate", str(folder), "--output_file", str(single_file)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    saved = torch.load(single_file, weights_only=False)["state_dict"]
    assert saved[TIED[1]] is saved[TIED[0]]  # one tensor under both names: stored once
    model = tied_net(RunSpec(name="load", model={}))
    model.load_state_dict(saved, strict=True)
    assert model.head[1].weight is model.embed.weight
    trained = res["full_shard"].params
    assert all(torch.equal(model.state_dict()[k], trained[k]) for k in trained)


@pytest.mark.timeout(1500)
def test_meta_device_model_trains_as_on_one_device(results):
    """Each rank materialized its own layers; the owner's values reached the copy before training, and the run
    is one device's from those values: losses, gradient norms, parameters, and copies equal to each other."""
    workdir, res = results
    folder = run_folder(workdir, "meta_device")
    initial = [torch.load(folder / f"initial_pp{rank}.pt") for rank in range(2)]
    assert TIED[0] in initial[0] and TIED[1] in initial[1]
    assert torch.equal(initial[0][TIED[0]], initial[1][TIED[1]])
    meta = next(r for r in RUNS_4 if r.name == "meta_device")
    assert_started_as_one_process(folder, make_model_as_the_run_does(meta))  # nothing copied from the run
    ref = reference_run(meta)
    assert_matches(res["meta_device"], ref, folder)


@pytest.mark.timeout(1500)
def test_copies_optimized_differently_are_refused_on_every_rank(results):
    _, res = results
    errors = [r["error"] for r in res["grouped_by_name"].ranks]
    assert len(errors) == 2 and len(set(errors)) == 1, errors  # the same message everywhere, no rank left waiting
    assert "copies of the tied parameter `embed.weight` are optimized differently" in errors[0]
    assert "`head.1.weight`" in errors[0]


def test_one_device_model_is_tied():
    model = tied_net(RunSpec(name="x", model={}))
    assert isinstance(model, PipeNet) and model.head[1].weight is model.embed.weight
    assert [n for n, _ in model.named_parameters()].count("embed.weight") == 1
    assert TIED_MODEL["in_dim"] == TIED_MODEL["width"] == TIED_MODEL["out_dim"]
