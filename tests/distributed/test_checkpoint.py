"""Checkpoints: exact resume, any-layout resume, one-file consolidation, single-device checkpoints, atomicity.

48 samples and a global batch of 16 make 3 steps per epoch, and training is epoch-based: a checkpoint after
epoch 1 (step 3) resumed for a second epoch replays exactly the batches the uninterrupted run sees.
(Lightning itself does not replay them when `max_steps` is set: with iteration-based training its fit loop
always treats a resume as mid-epoch, and even one-device training then diverges at the second resumed step.)
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lightning_bfpp.engine.checkpoint import checkpoint_keys, is_sharded_checkpoint
from tests.distributed.harness import REPO, launch, relative_error, run_worker
from tests.models import PipeNet, RunSpec, reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

LAYOUTS = {  # (strategy, local batch size) giving a global batch of 16 on 4 processes
    "p2_dp2_v2": ({"pipeline_parallel_size": 2, "stages_per_rank": 2, "num_microbatches": 4}, 8),
    "p4_dp1_v1": ({"pipeline_parallel_size": 4, "stages_per_rank": 1, "num_microbatches": 4}, 16),
    "p1_dp4_v2": ({"pipeline_parallel_size": 1, "stages_per_rank": 2, "num_microbatches": 2}, 4),
}
MODEL = {"optimizer": "adamw", "param_groups": 2, "scheduler": "step"}


def run(name, layout="p2_dp2_v2", epochs=2, model=MODEL, steps=None, **kwargs) -> RunSpec:
    strategy, batch = LAYOUTS[layout]
    limit = {"max_steps": steps} if steps else {"max_epochs": epochs, "max_steps": -1}
    return RunSpec(
        name=name,
        strategy=strategy,
        model=dict(model),
        data={"num_samples": 48},
        trainer=limit,
        local_batch_size=batch,
        data_parallel_size=16 // batch,
        **kwargs,
    )


SINGLE_MODEL = {"optimizer": "adamw", "scheduler": "step"}  # one param group: see load_full_optimizer


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """A run whose rank 1 fails while writing the step-2 checkpoint: the launch, and what its checkpoint folder
    held right after (read before anything resumes from it)."""
    workdir = tmp_path_factory.mktemp("crash")
    crash = run("crash", steps=3, checks=["last_checkpoint_every_step", "fail_save_at_step_2"])
    proc = run_worker([crash], 4, workdir, timeout=300)
    ckpts = workdir / "out" / "crash" / "ckpts"
    last = ckpts / "last.ckpt"
    sharded = is_sharded_checkpoint(last)
    step = torch.load(last / "meta.pt", weights_only=False)["global_step"] if sharded else None
    names = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else None
    return proc, names, sharded, step, last


@pytest.fixture(scope="module")
def results(tmp_path_factory, crashed):
    workdir = tmp_path_factory.mktemp("checkpoint")
    single = workdir / "single_device_step3.ckpt"
    reference_run(run("single", epochs=1, model=SINGLE_MODEL), save_to=str(single))
    runs = [
        run("straight"),
        run("half", epochs=1, checks=["save_at_end"]),
        run("resume_same", resume_from="half/end.ckpt"),
        run("resume_p4", layout="p4_dp1_v1", resume_from="half/end.ckpt"),
        run("resume_dp4", layout="p1_dp4_v2", resume_from="half/end.ckpt"),
        run("from_single_device", model=SINGLE_MODEL, resume_from=str(single)),
    ]
    _, _, sharded, _, last = crashed
    if sharded:  # the crashed run's last good checkpoint resumes, in this launch (the crash test fails without it)
        runs.append(run("after_crash", steps=2, resume_from=str(last)))
    return workdir, launch(runs, 4, workdir, timeout=600)


def losses(result, rank=0):
    return [s["callback_metrics"]["train_loss"] for s in result.steps(rank)]


def test_resume_is_bit_for_bit(results):
    _, res = results
    straight, resumed = res["straight"], res["resume_same"]
    for rank in range(4):
        assert losses(resumed, rank) == losses(straight, rank)[3:]
        assert resumed.ranks[rank]["holdings"]["counters"] == straight.ranks[rank]["holdings"]["counters"]
        assert resumed.ranks[rank]["holdings"]["lrs"] == straight.ranks[rank]["holdings"]["lrs"]
        assert resumed.ranks[rank]["holdings"]["scheduler"] == straight.ranks[rank]["holdings"]["scheduler"]
    assert resumed.params.keys() == straight.params.keys()
    assert all(torch.equal(resumed.params[k], straight.params[k]) for k in straight.params)
    assert resumed.optimizer_state.keys() == straight.optimizer_state.keys() and straight.optimizer_state
    assert all(torch.equal(resumed.optimizer_state[k], straight.optimizer_state[k]) for k in straight.optimizer_state)


@pytest.mark.parametrize("name", ["resume_p4", "resume_dp4"])
def test_resume_under_another_layout(name, results):
    _, res = results
    straight, resumed = res["straight"], res[name]
    for rank in range(4):
        assert losses(resumed, rank) == pytest.approx(losses(straight)[3:], rel=1e-5)
        assert resumed.ranks[rank]["holdings"]["counters"] == straight.ranks[0]["holdings"]["counters"]
        assert resumed.ranks[rank]["holdings"]["lrs"] == pytest.approx(straight.ranks[0]["holdings"]["lrs"])
    assert max(relative_error(resumed.params[k], straight.params[k]) for k in straight.params) < 1e-5
    assert max(relative_error(resumed.optimizer_state[k], straight.optimizer_state[k])
               for k in straight.optimizer_state) < 1e-5  # fmt: skip


def test_checkpoint_is_a_dcp_folder_with_module_names(results):
    workdir, _res = results
    path = workdir / "out" / "half" / "end.ckpt"
    assert is_sharded_checkpoint(path)
    assert checkpoint_keys(path) == {"model", "optimizer_0"}
    meta = torch.load(path / "meta.pt", weights_only=False)
    assert meta["global_step"] == 3 and meta["lr_schedulers"] and "hyper_parameters" in meta


def test_consolidated_checkpoint_loads_on_one_device(results, tmp_path):
    workdir, res = results
    folder = workdir / "out" / "half" / "end.ckpt"
    single_file = tmp_path / "consolidated.ckpt"
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    cmd = [sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", str(folder),
           "--output_file", str(single_file)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    model = PipeNet.load_from_checkpoint(single_file)
    state = model.state_dict()
    half = res["half"].params
    assert set(half) <= set(state)
    assert all(torch.equal(state[k], half[k]) for k in half)


def test_single_device_checkpoint_resumes_under_the_pipeline(results):
    _, res = results
    ref = reference_run(run("single", epochs=2, model=SINGLE_MODEL))
    ref_steps, ref_params = ref.steps, ref.params
    resumed = res["from_single_device"]
    for rank in range(4):
        assert losses(resumed, rank) == pytest.approx([s["callback_metrics"]["train_loss"] for s in ref_steps[3:]],
                                                      rel=1e-5)  # fmt: skip
    assert max(relative_error(resumed.params[k], ref_params[k]) for k in ref_params) < 1e-5


def test_a_crash_while_saving_keeps_the_last_good_checkpoint(crashed, results):
    proc, names, sharded, step, _ = crashed
    assert proc.returncode != 0 and "injected failure" in proc.stderr
    assert sharded
    assert step == 1  # step 2 never replaced it
    assert names == ["last.ckpt"]  # no half-written folder left behind
    # and it resumes
    _, res = results
    assert res["after_crash"].ranks[0]["holdings"]["counters"]["global_step"] == 2
    assert len(res["after_crash"].steps(0)) == 1
