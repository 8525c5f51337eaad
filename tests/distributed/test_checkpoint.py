"""Checkpoints: exact resume, any-layout resume, one-file consolidation, single-device checkpoints, atomicity.

48 samples and a global batch of 16 make 3 steps per epoch, and training is epoch-based: a checkpoint after
epoch 1 (step 3) resumed for a second epoch replays exactly the batches the uninterrupted run sees.
(Lightning itself does not replay them when `max_steps` is set: with iteration-based training its fit loop
always treats a resume as mid-epoch, and even one-device training then diverges at the second resumed step.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_bfpp.engine.checkpoint import checkpoint_keys, is_sharded_checkpoint
from tests.distributed.harness import REPO, launch, relative_error
from tests.models import PipeNet, RunSpec, reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

LAYOUTS = {  # (strategy, local batch size) giving a global batch of 16 on 4 processes
    "p2_dp2_v2": ({"pipeline_parallel_size": 2, "stages_per_rank": 2, "num_microbatches": 4}, 8),
    "p4_dp1_v1": ({"pipeline_parallel_size": 4, "stages_per_rank": 1, "num_microbatches": 4}, 16),
    "p1_dp4_v2": ({"pipeline_parallel_size": 1, "stages_per_rank": 2, "num_microbatches": 2}, 4),
}
MODEL = {"optimizer": "adamw", "param_groups": 2, "scheduler": "step"}


def run(name, layout="p2_dp2_v2", epochs=2, model=MODEL, steps=None, async_saves=False, **kwargs) -> RunSpec:
    strategy, batch = LAYOUTS[layout]
    strategy = {**strategy, "async_checkpoint": True} if async_saves else strategy
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


# A save fails at each point in turn, one run after the other in the same launch, on the same `last.ckpt`: each
# run resumes from what the failure before left, saves once there, and fails at the next save (the error is
# agreed on every rank, so the processes go on with the next run); the last run saves once more.
CHAIN = ["plan", "write", "metadata", "between_renames", "after_renames"]  # see tests.models.FailWhileSaving
CHAIN_FOLDER = "fail_plan/ckpts"  # the first run's checkpoint folder, where every run of the chain saves
EACH_STEP_FAILS = ["topk_every_step", "fail_save:write:2"]
ASYNC_FOLDER = "ckpts/each_step"  # where the "topk_every_step" check saves, keeping the newest only


def chain_runs() -> list[RunSpec]:
    runs = []
    for k, where in enumerate(CHAIN):  # run k resumes from step k (fresh for k = 0) and fails saving step k + 2
        resume = {"resume_from": f"{CHAIN_FOLDER}/last.ckpt"} if k else {}
        checks = ["last_checkpoint_every_step", f"fail_save:{where}:{k + 2}"]
        checks += ["save_beside_resumed", "checkpoint_folder_at_start"] if k else []
        runs.append(run(f"fail_{where}", steps=k + 2, checks=checks, expect_error=True, **resume))
    beside = ["last_checkpoint_every_step", "save_beside_resumed", "checkpoint_folder_at_start"]
    runs.append(run("after_failures", steps=7, checks=beside, resume_from=f"{CHAIN_FOLDER}/last.ckpt"))
    return runs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("checkpoint")
    single = workdir / "single_device_step3.ckpt"
    reference_run(run("single", epochs=1, model=SINGLE_MODEL), save_to=str(single))
    runs = [
        run("straight"),
        run("half", epochs=1, checks=["save_at_end", "consolidate_at_end"]),
        run("resume_same", resume_from="half/end.ckpt"),
        # the folder consolidated into one file, by this package's tool and by Lightning's, resumed
        run("resume_file", resume_from="half/end.consolidated.ckpt"),
        run("resume_lightning_file", resume_from="half/end.lightning.ckpt"),
        run("resume_file_p4", layout="p4_dp1_v1", resume_from="half/end.consolidated.ckpt"),
        run("resume_p4", layout="p4_dp1_v1", resume_from="half/end.ckpt"),
        run("resume_dp4", layout="p1_dp4_v2", resume_from="half/end.ckpt"),
        run("from_single_device", model=SINGLE_MODEL, resume_from=str(single)),
        *chain_runs(),
        # saves written while training goes on (each file's write takes 0.5 s longer), one a step
        run("async_half", epochs=1, async_saves=True, checks=["topk_every_step", "slow_writes:0.5"]),
        run("async_resumed", resume_from=f"async_half/{ASYNC_FOLDER}/step=3.ckpt"),
        run("async_write_fails", steps=3, async_saves=True, checks=EACH_STEP_FAILS, expect_error=True),
    ]
    return workdir, launch(runs, 4, workdir, timeout=600)


def losses(result, rank=0):
    return [s["callback_metrics"]["train_loss"] for s in result.steps(rank)]


@pytest.mark.parametrize("name", ["resume_same", "resume_file", "resume_lightning_file"])
def test_resume_is_bit_for_bit(results, name):
    """From the folder, and from it consolidated into one file (this package's tool, Lightning's): weights,
    optimizer state (keyed by parameter name in the file), the scheduler, the loops' counters."""
    _, res = results
    straight, resumed = res["straight"], res[name]
    for rank in range(4):
        assert losses(resumed, rank) == losses(straight, rank)[3:]
        assert resumed.ranks[rank]["holdings"]["counters"] == straight.ranks[rank]["holdings"]["counters"]
        assert resumed.ranks[rank]["holdings"]["lrs"] == straight.ranks[rank]["holdings"]["lrs"]
        assert resumed.ranks[rank]["holdings"]["scheduler"] == straight.ranks[rank]["holdings"]["scheduler"]
    assert resumed.params.keys() == straight.params.keys()
    assert all(torch.equal(resumed.params[k], straight.params[k]) for k in straight.params)
    assert resumed.optimizer_state.keys() == straight.optimizer_state.keys() and straight.optimizer_state
    assert all(torch.equal(resumed.optimizer_state[k], straight.optimizer_state[k]) for k in straight.optimizer_state)


@pytest.mark.parametrize("name", ["resume_p4", "resume_dp4", "resume_file_p4"])
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
    meta = torch.load(path / "meta.pt", weights_only=True)  # what it stores loads with torch's default
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


def _agreed_error(result) -> str:
    errors = {rank["error"] for rank in result.ranks}
    assert len(errors) == 1, f"ranks disagree: {errors}"
    return errors.pop()


def test_a_save_failing_at_any_point_leaves_a_checkpoint_that_resumes_and_no_staging_folder(results):
    """Each failure stops every rank with one agreed `CheckpointError` (not one rank's crash, which had the
    failure watchdog stop rank 0 before it removed `last.ckpt.tmp`: the "write" failure keeps rank 0 in that
    cleanup for 3 s), leaves what the next run resumes from and no staging folder, and the next save at the
    same path succeeds."""
    workdir, res = results
    folder = workdir / "out" / CHAIN_FOLDER
    last = folder / "last.ckpt"
    unchanged = f"BFPPStrategy could not save the checkpoint {last}; the previous one there is unchanged: "
    errors = {
        "plan": unchanged + "rank 1 failed: OSError: injected failure (plan) on rank 1",
        "write": unchanged + "rank 1 failed: OSError: injected failure (write) on rank 1",
        "metadata": unchanged + "rank 0 failed: OSError: injected failure (metadata) on rank 0",
        "between_renames": f"BFPPStrategy could not put the new checkpoint in place at {last}: rank 0 failed:"
        " OSError: injected failure (between_renames) on rank 0",
        "after_renames": f"rank 0 failed: BFPPStrategy saved the checkpoint {last}, but could not remove the"
        " previous one beside it, last.ckpt.old (OSError: injected failure (after_renames) on rank 0)",
    }
    for where in CHAIN:
        error = _agreed_error(res[f"fail_{where}"])
        assert error.startswith(f"CheckpointError: {errors[where]}"), (where, error)
    # what each failure left, read by the next run before it loaded or saved anything: (folder, resumed at)
    left = {
        "write": ({"last.ckpt": 1}, 1),  # after "plan": the step-1 checkpoint, untouched
        "metadata": ({"last.ckpt": 2}, 2),  # after "write", whose staging folder rank 0 removed in its 3 s
        "between_renames": ({"last.ckpt": 3}, 3),  # after "metadata": DCP's files were written, then removed
        "after_renames": ({"last.ckpt.old": 4}, 4),  # the previous one, moved aside; loading falls back to it
    }
    for where, (held, step) in left.items():
        record = json.loads((workdir / "out" / f"fail_{where}" / "checkpoint_folder.json").read_text())
        assert record == {"held": held, "resumed_at": step}, where
    record = json.loads((workdir / "out" / "after_failures" / "checkpoint_folder.json").read_text())
    # the new checkpoint was in place; the previous one stayed beside it, which the next save removes
    assert record == {"held": {"last.ckpt": 6, "last.ckpt.old": 5}, "resumed_at": 6}
    final = res["after_failures"]
    assert [s["step"] for s in final.steps(0)] == [7]
    assert {p.name: torch.load(p / "meta.pt", weights_only=True)["global_step"] for p in folder.iterdir()} == {
        "last.ckpt": 7
    }


# where CI keeps this torch's checkpoint for the oldest supported torch to open (tests/distributed/test_oldest_torch.py)
CROSS_VERSION_DIR = os.environ.get("BFPP_CROSS_VERSION_DIR")


@pytest.mark.skipif(not CROSS_VERSION_DIR, reason="CI hands this torch's checkpoint to the oldest torch's run")
def test_hand_the_checkpoint_to_the_oldest_torch(results):
    """The folder, its consolidated file, the run resumed from the folder and the releases that wrote them, for the
    oldest torch's part of CI: it must refuse the folder naming both releases when it cannot read it, and resume
    the file as this torch resumed the folder."""
    import shutil

    workdir, res = results
    target = Path(CROSS_VERSION_DIR)
    half = workdir / "out" / "half"
    shutil.copytree(half / "end.ckpt", target / "folder.ckpt", dirs_exist_ok=True)
    shutil.copy(half / "end.consolidated.ckpt", target / "consolidated.ckpt")
    resumed = res["resume_same"]
    torch.save(
        {
            "torch": str(torch.__version__),
            "params": resumed.params,
            "optimizer_state": resumed.optimizer_state,
            "losses": [losses(resumed, rank) for rank in range(4)],
        },
        target / "resumed.pt",
    )


# -- saves that do not stop training (async_checkpoint=True) -------------------------------------------------------


def test_an_asynchronous_save_is_written_while_training_goes_on_and_counts_once_every_rank_wrote_it(results):
    """A checkpoint every step, each rank's write slowed by 0.5 s: at the start of each next step the save is still
    being written (its staging folder there), the previous checkpoint is in place and still kept (the callback's
    removal of it waits for the new one), and one save at most is in flight; the end of training commits the last."""
    workdir, res = results
    seen = json.loads((workdir / "out" / "async_half" / "saves_seen.json").read_text())
    assert seen == [
        {"step": 0, "names": []},
        {"step": 1, "names": ["step=1.ckpt.tmp"]},
        {"step": 2, "names": ["step=1.ckpt", "step=2.ckpt.tmp"]},
    ]
    folder = workdir / "out" / "async_half" / ASYNC_FOLDER
    assert sorted(p.name for p in folder.iterdir()) == ["step=3.ckpt"]
    assert torch.load(folder / "step=3.ckpt" / "meta.pt", weights_only=True)["global_step"] == 3
    for rank in range(4):  # saving did not change training, and its checkpoint resumes exactly
        assert losses(res["async_half"], rank) == losses(res["straight"], rank)[:3]
        assert losses(res["async_resumed"], rank) == losses(res["straight"], rank)[3:]
    straight, resumed = res["straight"], res["async_resumed"]
    assert all(torch.equal(resumed.params[k], straight.params[k]) for k in straight.params)
    assert all(torch.equal(resumed.optimizer_state[k], straight.optimizer_state[k]) for k in straight.optimizer_state)


def test_an_asynchronous_write_that_fails_is_raised_on_every_rank_at_the_next_step_and_keeps_the_previous(results):
    workdir, res = results
    folder = workdir / "out" / "async_write_fails" / ASYNC_FOLDER
    error = _agreed_error(res["async_write_fails"])
    assert error.startswith(
        f"CheckpointError: BFPPStrategy could not save the checkpoint {folder / 'step=2.ckpt'}; the previous one"
        " there is unchanged: rank 1 failed: OSError: injected failure (write) on rank 1"
    ), error
    assert sorted(p.name for p in folder.iterdir()) == ["step=1.ckpt"]  # no staging folder, the previous kept
