"""Mid-epoch resume with every kind of loader, processes killed while saving, and checkpoints refused.

Iteration-based training (``max_steps``) with a ``ModelCheckpoint`` after every step: 64 samples and a
global batch of 16 make 4 steps per epoch, so the step-3 checkpoint is mid-epoch and the resumed steps 4-6
cross an epoch boundary. With torchdata's ``StatefulDataLoader`` Lightning restores the loader's place in
the epoch, so 6 steps straight must equal 3 steps + resume 3: losses, parameters and the very samples each
rank sees. The loaders (``tests/resume_data.py``) include two whose state differs between data-parallel
replicas, so restoring one replica's state on all of them would show up as other samples.

Four launches share the work: A (4 processes, p=2 × dp=2) trains straight, to step 3, and resumed, per
loader; two launches are killed while saving (2 processes, p=2); B (2 processes) resumes under other
layouts, after the kills, and from broken checkpoints prepared by the test from A's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_bfpp.engine.checkpoint import LOADER_STATES_KEY, METADATA_FILENAME
from tests.distributed.harness import load_results, relative_error, run_worker
from tests.models import RunSpec, reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1500)]

P2_V2 = {"pipeline_parallel_size": 2, "stages_per_rank": 2, "num_microbatches": 4}
P1_V2 = {"pipeline_parallel_size": 1, "stages_per_rank": 2, "num_microbatches": 2}
LOADERS = {
    "stateful": "tests.resume_data:stateful_loader",  # StatefulDataLoader + Lightning's DistributedSampler
    "stream": "tests.resume_data:sharded_stream_loader",  # IterableDataset sharded by replica, own state
    "noisy": "tests.resume_data:noisy_loader",  # a dataset with its own per-replica state
}
DATA = {"num_samples": 64, "batch_format": "dict"}
MODEL = {"optimizer": "sgd"}
CHECKPOINT = "ckpts/last.ckpt"  # where the "last_checkpoint_every_step" check saves, in the run's folder
TOL = 1e-5


def spec(name, steps, *, loader="stateful", strategy=P2_V2, dp=2, data=None, **kwargs) -> RunSpec:
    """A run with a global batch of 16 over ``dp`` replicas; ``loader=None``: a plain DataLoader."""
    return RunSpec(
        name=name,
        strategy=strategy,
        model=dict(MODEL),
        data={**DATA, **(data or {})},
        trainer={"max_steps": steps},
        local_batch_size=16 // dp,
        data_parallel_size=dp,
        loader_factory=LOADERS[loader] if loader else None,
        **kwargs,
    )


def half(name, **kwargs) -> RunSpec:
    return spec(name, 3, checks=["last_checkpoint_every_step"], **kwargs)


def resumed(name, source, **kwargs) -> RunSpec:
    return spec(name, 6, resume_from=f"{source}/{CHECKPOINT}", **kwargs)


def launch_logged(runs, devices, workdir, timeout):
    """``harness.launch``, also returning what the processes printed (warnings)."""
    proc = run_worker(runs, devices, workdir, timeout)
    assert proc.returncode == 0, f"pipelined run failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
    return load_results(runs, devices, workdir), proc.stdout + proc.stderr


def kill_run(name, where, rank, workdir) -> RunSpec:
    """2 processes (p=2) saving after every step; global rank ``rank`` kills itself during the step-4 save."""
    kill = {"where": where, "rank": rank, "step": 4, "marker": str(workdir / f"{name}.killed")}
    return spec(name, 6, dp=1, checks=["last_checkpoint_every_step"], data={"kill": kill})


def crash(name, where, rank, tmp_path_factory) -> tuple[Path, Any]:
    workdir = tmp_path_factory.mktemp(name)
    try:
        proc = run_worker([kill_run(name, where, rank, workdir)], 2, workdir, timeout=90)
        outcome: Any = proc.returncode
    except AssertionError as hang:  # the survivors waited for the killed process; the group was killed
        outcome = str(hang)
    return workdir, outcome


def break_copies(source: Path, into: Path) -> dict[str, Path]:
    """Broken copies of a good 4-process checkpoint folder, and a file that is no checkpoint."""
    broken = {}
    for name in ("cut_short", "file_missing", "meta_missing"):
        broken[name] = into / f"{name}.ckpt"
        shutil.copytree(source, broken[name])
    data_file = broken["cut_short"] / "__1_0.distcp"
    data_file.write_bytes(data_file.read_bytes()[: data_file.stat().st_size // 2])
    (broken["file_missing"] / "__3_0.distcp").unlink()
    (broken["meta_missing"] / METADATA_FILENAME).unlink()
    broken["text"] = into / "notes.txt"
    broken["text"].write_text("epoch 3: loss 0.42, looks good\n")
    return broken


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work_a = tmp_path_factory.mktemp("resume_a")
    launch_a = []
    for kind in LOADERS:
        launch_a += [spec(f"{kind}_straight", 6, loader=kind), half(f"{kind}_half", loader=kind)]
        launch_a.append(resumed(f"{kind}_resumed", f"{kind}_half", loader=kind))
    launch_a += [half("plain_half", loader=None), resumed("plain_resumed", "plain_half", loader=None)]
    foreign = RunSpec(name="foreign", strategy=P2_V2, model={**MODEL, "num_blocks": 7, "out_dim": 4},
                      trainer={"max_steps": 1}, data_parallel_size=2, checks=["save_at_end"])  # fmt: skip
    launch_a.append(foreign)
    a, out_a = launch_logged(launch_a, 4, work_a, timeout=900)

    crashes = {
        "in_dcp_write": crash("in_dcp_write", "dcp_write", 1, tmp_path_factory),
        "between_renames": crash("between_renames", "between_renames", 0, tmp_path_factory),
    }

    work_b = tmp_path_factory.mktemp("resume_b")
    a_out = work_a / "out"
    broken = break_copies(a_out / "stateful_half" / CHECKPOINT, work_b)
    launch_b = [
        spec(f"{kind}_p1", 6, loader=kind, strategy=P1_V2, resume_from=str(a_out / f"{kind}_half" / CHECKPOINT))
        for kind in LOADERS
    ]
    for kind in ("stateful", "noisy"):  # a place in the whole epoch, and one replica's own state
        launch_b.append(spec(f"{kind}_dp1", 6, loader=kind, dp=1, resume_from=str(a_out / f"{kind}_half" / CHECKPOINT)))
    for name, (workdir, _) in crashes.items():  # each resumes what its kill left and saves there again
        saving = ["last_checkpoint_every_step", "save_beside_resumed", "checkpoint_folder_at_start"]
        resume = str(workdir / "out" / name / CHECKPOINT)
        launch_b.append(spec(f"after_{name}", 6, dp=1, resume_from=resume, checks=saving))
    fail = {"fail_metadata": {"rank": 0, "step": 2}}
    launch_b.append(
        spec("meta_write_fails", 3, dp=1, checks=["last_checkpoint_every_step"], data=fail, expect_error=True)
    )
    for name, path in {**broken, "foreign": a_out / "foreign" / "end.ckpt"}.items():
        launch_b.append(spec(f"load_{name}", 6, dp=1, resume_from=str(path), expect_error=True))
    b, out_b = launch_logged(launch_b, 2, work_b, timeout=600)
    return {"a": a, "b": b, "out_a": out_a, "out_b": out_b, "work_a": work_a, "work_b": work_b, "crashes": crashes}


# -- helpers ------------------------------------------------------------------------------------------


def losses(result, rank=0):
    return [s["callback_metrics"]["train_loss"] for s in result.steps(rank)]


def batches(result, rank):
    return [s["indices"] for s in result.steps(rank)]


def replica(result, rank):
    return result.ranks[rank]["holdings"]["data_parallel_rank"]


def by_replica(result) -> dict[int, list[list[int]]]:
    """Each replica's batches (its pipeline ranks must agree on them)."""
    seen: dict[int, list[list[int]]] = {}
    for rank in range(len(result.ranks)):
        ours = batches(result, rank)
        assert seen.setdefault(replica(result, rank), ours) == ours, f"rank {rank} saw other batches than its replica"
    return seen


def worst(params, reference):
    assert set(params) == set(reference)
    return max(relative_error(params[k], reference[k]) for k in reference)


@pytest.fixture(scope="module")
def plain_reference():
    """One device: 3 steps saving every step, then a resume of the step-3 checkpoint to step 6."""
    first = reference_run(half("reference_half", loader=None))
    ckpt = first.extras["out"] / CHECKPOINT
    return reference_run(spec("reference_resumed", 6, loader=None), resume_from=str(ckpt))


@pytest.fixture(scope="module")
def straight_reference():
    return reference_run(spec("reference_straight", 6, loader=None))


# -- exact mid-epoch resume -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(LOADERS))
def test_stateful_loaders_resume_mid_epoch_exactly(kind, runs):
    straight, resumed_run = runs["a"][f"{kind}_straight"], runs["a"][f"{kind}_resumed"]
    for rank in range(4):
        assert [s["step"] for s in resumed_run.steps(rank)] == [4, 5, 6]
        assert batches(resumed_run, rank) == batches(straight, rank)[3:], f"rank {rank}"
        assert losses(resumed_run, rank) == losses(straight, rank)[3:], f"rank {rank}"
    assert all(torch.equal(resumed_run.params[k], straight.params[k]) for k in straight.params)
    # what makes it a test: the replicas read different samples, the resumed steps are not the first ones again
    replicas = by_replica(straight)
    assert replicas[0] != replicas[1]
    assert replicas[0][3] not in replicas[0][:3] and replicas[1][3] not in replicas[1][:3]


@pytest.mark.parametrize("kind", ["stream", "noisy"])
def test_every_replica_keeps_its_own_loader_state(kind, runs):
    # loads with torch's default: the loaders' states are plain values and tensors
    meta = torch.load(runs["work_a"] / "out" / f"{kind}_half" / CHECKPOINT / METADATA_FILENAME, weights_only=True)
    stored = meta[LOADER_STATES_KEY]
    assert stored["data_parallel_size"] == 2 and len(stored["states"]) == 2
    dataset_states = [states[0]["dataset_state"] for states in stored["states"]]
    assert dataset_states[0] is not None and repr(dataset_states[0]) != repr(dataset_states[1])


def test_stateful_loader_straight_run_is_one_devices(runs, straight_reference):
    straight = runs["a"]["stateful_straight"]
    want = [s["callback_metrics"]["train_loss"] for s in straight_reference.steps]
    assert losses(straight) == pytest.approx(want, rel=TOL)
    replicas = by_replica(straight)
    for step, reference_step in enumerate(straight_reference.steps):
        assert replicas[0][step] == reference_step["indices"][0::2]
        assert replicas[1][step] == reference_step["indices"][1::2]
    assert worst(straight.params, straight_reference.params) < TOL


@pytest.mark.parametrize("kind", list(LOADERS))
def test_resume_under_another_pipeline_size_is_exact(kind, runs):
    """p=2 → p=1 with data_parallel_size 2 kept: each replica resumes its own place."""
    straight, moved = runs["a"][f"{kind}_straight"], runs["b"][f"{kind}_p1"]
    replicas = by_replica(straight)
    for rank in range(2):
        assert replica(moved, rank) == rank
        assert batches(moved, rank) == replicas[rank][3:]
        assert losses(moved, rank) == pytest.approx(losses(straight)[3:], rel=TOL)
    assert worst(moved.params, straight.params) < TOL


def test_another_data_parallel_size_takes_the_epochs_place_to_the_replicas_left(runs, straight_reference):
    """dp 2 → 1, the global batch of 16 kept (a run resumed on fewer machines): the place of Lightning's sampler in
    the epoch moves to the one replica, which reads at steps 4-6 the samples both replicas of the straight run read
    there (interleaved: one device's order), and trains as one device does."""
    moved, replicas = runs["b"]["stateful_dp1"], by_replica(runs["a"]["stateful_straight"])
    for rank in range(2):
        assert [s["step"] for s in moved.steps(rank)] == [4, 5, 6]
        for step, batch in enumerate(batches(moved, rank), start=3):
            assert batch[0::2] == replicas[0][step] and batch[1::2] == replicas[1][step], (rank, step)
    want = [s["callback_metrics"]["train_loss"] for s in straight_reference.steps]
    assert losses(moved) == pytest.approx(want[3:], rel=TOL)
    assert worst(moved.params, straight_reference.params) < TOL


def test_a_state_of_each_replicas_own_warns_under_another_data_parallel_size_and_starts_the_epoch_over(runs):
    """A dataset with a per-replica state of its own: its states cannot be split or merged for another replica
    count, so none is restored (with the warning) and the epoch starts over, as with a plain DataLoader."""
    warning = "this run has data_parallel_size=1"
    assert runs["out_b"].count(warning) == 1  # that run only: the stateful loader's place moved
    assert "one data-loader state per replica for data_parallel_size=2" in runs["out_b"]
    moved = runs["b"]["noisy_dp1"]
    assert [s["step"] for s in moved.steps(0)] == [4, 5, 6]
    assert batches(moved, 0)[0] == _first_global_batch(runs)  # the epoch started over


def _first_global_batch(runs) -> list[int]:
    """Step 1's samples of the whole straight run, in one device's order (replicas interleave)."""
    replicas = by_replica(runs["a"]["stateful_straight"])
    first = [None] * 16
    first[0::2], first[1::2] = replicas[0][0], replicas[1][0]
    return first


def test_plain_dataloader_resume_does_what_one_device_does(runs, plain_reference):
    pipelined = runs["a"]["plain_resumed"]
    reference_steps = plain_reference.steps
    assert reference_steps[0]["indices"] == _first_global_batch(runs)  # Lightning replayed the epoch's start
    replicas = by_replica(pipelined)
    for step, reference_step in enumerate(reference_steps):
        assert replicas[0][step] == reference_step["indices"][0::2]
        assert replicas[1][step] == reference_step["indices"][1::2]
    want = [s["callback_metrics"]["train_loss"] for s in reference_steps]
    for rank in range(4):
        assert losses(pipelined, rank) == pytest.approx(want, rel=TOL)
    assert worst(pipelined.params, plain_reference.params) < TOL


# -- processes killed while saving ----------------------------------------------------------------


def _killed(runs, name, rank) -> Path:
    workdir, outcome = runs["crashes"][name]
    assert outcome != 0, "the run that should have been killed finished"
    assert (workdir / f"{name}.killed.rank{rank}").is_file(), f"rank {rank} never reached the kill point: {outcome}"
    return workdir / "out" / name / "ckpts"


def _resumed_equals_uninterrupted(result, reference):
    want = reference.steps[3:]
    for rank in range(2):
        assert [s["step"] for s in result.steps(rank)] == [4, 5, 6]
        assert batches(result, rank) == [s["indices"] for s in want]
        assert losses(result, rank) == pytest.approx([s["callback_metrics"]["train_loss"] for s in want], rel=TOL)
    assert worst(result.params, reference.params) < TOL


def _left_by_the_kill(runs, name) -> dict[str, Any]:
    """What the killed run's checkpoint folder held when the run resuming it started (each folder's
    `global_step`, None without meta.pt), recorded before it loaded or saved anything."""
    return json.loads((runs["work_b"] / "out" / f"after_{name}" / "checkpoint_folder.json").read_text())["held"]


def _saved_there_again(ckpts: Path) -> None:
    """The resumed run's saves at the same path succeeded over what the kill left, and nothing else is there."""
    held = {p.name: torch.load(p / METADATA_FILENAME, weights_only=True)["global_step"] for p in ckpts.iterdir()}
    assert held == {"last.ckpt": 6}


def test_sigkill_inside_the_dcp_write_keeps_the_previous_checkpoint(runs, straight_reference):
    ckpts = _killed(runs, "in_dcp_write", rank=1)
    held = _left_by_the_kill(runs, "in_dcp_write")
    assert held["last.ckpt"] == 3
    # the unfinished save is gone (a survivor cleaned up) or left without meta.pt, never swapped in
    assert set(held) <= {"last.ckpt", "last.ckpt.tmp"} and held.get("last.ckpt.tmp") is None
    _resumed_equals_uninterrupted(runs["b"]["after_in_dcp_write"], straight_reference)
    _saved_there_again(ckpts)


def test_sigkill_between_the_renames_falls_back_to_the_old_checkpoint(runs, straight_reference):
    ckpts = _killed(runs, "between_renames", rank=0)
    # the previous checkpoint moved aside, and the new one still in the staging folder, which loading never reads
    assert _left_by_the_kill(runs, "between_renames") == {"last.ckpt.old": 3, "last.ckpt.tmp": 4}
    assert f"{ckpts / 'last.ckpt'} does not exist, but last.ckpt.old beside it does" in runs["out_b"]
    _resumed_equals_uninterrupted(runs["b"]["after_between_renames"], straight_reference)
    _saved_there_again(ckpts)


# -- failures every rank agrees on -----------------------------------------------------------------


def _errors(result) -> str:
    errors = {rank["error"] for rank in result.ranks}
    assert len(errors) == 1, f"ranks disagree: {errors}"
    return errors.pop()


def test_metadata_write_failing_on_rank_zero_fails_every_rank(runs):
    error = _errors(runs["b"]["meta_write_fails"])
    assert error.startswith("CheckpointError: BFPPStrategy could not save the checkpoint")
    assert "rank 0 failed: OSError: injected failure: no space left on device while writing meta.pt" in error
    ckpts = runs["work_b"] / "out" / "meta_write_fails" / "ckpts"
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt"]  # the staging folder was removed
    assert torch.load(ckpts / "last.ckpt" / METADATA_FILENAME, weights_only=True)["global_step"] == 1


@pytest.mark.parametrize(
    ("name", "fragments"),
    [
        ("cut_short", ["the folder is incomplete", "data files cut short: __1_0.distcp (", "copy it again"]),
        ("file_missing", ["the folder is incomplete", "data files missing: __3_0.distcp.", "earlier checkpoint"]),
        ("meta_missing", ["the folder is incomplete", f"{METADATA_FILENAME} (Lightning's loop", "copy it again"]),
        ("text", ["it is not a checkpoint (torch.load failed with", "Pass a folder written by BFPPStrategy"]),
        (
            "foreign",
            [
                "it lacks the module's blocks.7.down.bias, blocks.7.down.weight, blocks.7.norm.bias,",
                "shapes differ (checkpoint vs module): head.1.bias [4] vs [3], head.1.weight [4, 16] vs [3, 16].",
                "It was saved from a different model",
            ],
        ),
    ],
)
def test_broken_or_foreign_checkpoints_are_refused_on_every_rank(name, fragments, runs):
    error = _errors(runs["b"][f"load_{name}"])
    assert error.startswith("CheckpointError: BFPPStrategy cannot load"), error
    for fragment in fragments:
        assert fragment in error, error
