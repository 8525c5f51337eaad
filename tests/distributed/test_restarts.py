"""A run that loses a process, hangs, or is preempted finishes by itself, as if nothing had happened.

``tests/distributed/restart_train.py`` is a user's script: p=2 dp=2 v=2 on 4 processes, 12 steps, a checkpoint every
3 steps (``ModelCheckpoint(save_last=True)``), a shuffled ``StatefulDataLoader`` (5 steps an epoch: the checkpoints
fall in mid-epoch), AdamW with a step scheduler, ``EMAWeightAveraging``, random draws in the step, and
``trainer.fit(model, loader, ckpt_path="last")``. Its runs:

- straight, the reference;
- killed: rank 1 SIGKILLed at the start of step 7 in the first attempt, under ``torchrun --max-restarts 2``: every
  rank forms its process groups again (each attempt on a store of its own) and resumes from step 6's checkpoint;
- hung: rank 2 SIGSTOPped at step 5 (``failure_timeout=5``): the watchdog kills it and stops the others, torchrun
  restarts the group, the run resumes from step 3's;
- spent: rank 1 killed at step 7 in both attempts, right after an asynchronous save: the job ends nonzero, with no
  process left and the newest complete checkpoint intact;
- slurm: four tasks started as ``srun`` starts them under SLURM, the requeue signal on one rank, an ``scontrol``
  stand-in on ``PATH``; then the requeued job;
- fewer machines: two torchrun agents ("nodes" of 2 processes, ``--nnodes 1:2``), one lost with its processes at
  step 7; the other re-plans on its 2 processes (data_parallel_size 1) and resumes.

Every job that completes on the same machines equals the straight run bit for bit: every step's loss (the repeated
ones included), the final weights and optimizer state. The run that lost a machine reads at each step the samples the
straight run read, and equals it to fp32 rounding (the global batch is the script's, whatever the machines).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_bfpp.engine.checkpoint import is_sharded_checkpoint
from tests.conftest import LAUNCHER_VARIABLES
from tests.distributed.harness import REPO

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

SCRIPT = "tests/distributed/restart_train.py"
HANG = ("--kill-rank", "2", "--kill-step", "5", "--stop")
# killed in every attempt, right after a save that is written while training goes on (in flight, or just committed)
SPENT = ("--kill-rank", "1", "--kill-step", "7", "--always", "--max-steps", "8", "--async-saves")


def torchrun(out: Path, env: dict[str, str], *args: str, restarts: int) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
        "--max-restarts", str(restarts), SCRIPT, str(out), *args,
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=500)


SCONTROL = '#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\n'  # records the requeue the job asked for


def slurm_job(out: Path, env: dict[str, str], *args: str, restart_count: int) -> tuple[list[int], str]:
    """The script as ``srun`` starts it for a job of 4 tasks on one node (a requeued job: ``restart_count`` 1),
    with an ``scontrol`` stand-in on ``PATH``; each task's exit code, and what they printed."""
    bin_dir = out.parent / "slurm_bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    job = {
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_RESTART_COUNT": str(restart_count),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PATH": f"{bin_dir}:{env['PATH']}",
        "SCONTROL_LOG": str(out / "requeued"),
    }  # fmt: skip
    command, output = (
        [sys.executable, SCRIPT, str(out), *args],
        {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT},
    )
    tasks = [
        subprocess.Popen(
            command, cwd=REPO, text=True, env={**env, **job, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}, **output
        )
        for r in range(4)
    ]
    printed = [task.communicate(timeout=300)[0] for task in tasks]
    return [task.returncode for task in tasks], "\n".join(printed)


def two_nodes(out: Path, env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess, ...]:
    """The script under two torchrun agents on this machine, as on two machines (``--nnodes 1:2``, c10d rendezvous
    hosted by the first); the second is the one ``LoseNode`` kills. Both agents' outcomes."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
        "--max-restarts", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job",
        # both join the first round (one joining a round already complete makes torch restart the other's workers,
        # which we do not test here); a lost agent is dropped after 2 s without a heartbeat
        "--rdzv-conf", "last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=2",
        "--monitor-interval", "0.5", SCRIPT, str(out), *args,
    ]  # fmt: skip
    output = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    kept = subprocess.Popen(cmd, cwd=REPO, env=env, **output)
    time.sleep(0.5)  # the first hosts the rendezvous: a job's store outlives the machines it may lose
    lost = subprocess.Popen(cmd, cwd=REPO, env={**env, "LOSE_THIS_NODE": "1"}, start_new_session=True, **output)
    done = []
    for agent in (kept, lost):
        stdout, stderr = agent.communicate(timeout=400)
        done.append(subprocess.CompletedProcess(cmd, agent.returncode, stdout, stderr))
    return tuple(done)


def losses(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"losses_rank{rank}.jsonl").read_text().splitlines()]


def final_state(out: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in sorted(out.glob("final_pp*.pt")):
        state.update(torch.load(path))
    return state


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # a script's environment (tests.conftest's `script_env`), for the module's runs
    script_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES} | {"OMP_NUM_THREADS": "1"}
    root = tmp_path_factory.mktemp("restarts")
    straight = torchrun(root / "straight", script_env, restarts=0)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = torchrun(root / "killed", script_env, "--kill-rank", "1", "--kill-step", "7", restarts=2)
    hung = torchrun(root / "hung", script_env, *HANG, "--failure-timeout", "5", restarts=1)  # rank 2 hangs at step 5
    spent = torchrun(root / "spent", script_env, *SPENT, "--failure-timeout", "5", restarts=1)
    # SLURM: rank 2 gets the requeue signal at the start of step 4; the job ends; the requeued job resumes
    preempted = slurm_job(root / "slurm", script_env, "--kill-rank", "2", "--requeue-step", "4", restart_count=0)
    requeued = slurm_job(root / "slurm", script_env, restart_count=1)
    return root, straight, killed, hung, spent, (preempted, requeued)


@pytest.fixture(scope="module")
def fewer_machines(tmp_path_factory):
    """The straight run and the run that loses a machine, both without random draws in the step (a draw belongs to
    its micro-batch, and the micro-batches of 2 replicas are not those of 1)."""
    script_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES} | {"OMP_NUM_THREADS": "1"}
    root = tmp_path_factory.mktemp("fewer_machines")
    straight = torchrun(root / "straight", script_env, "--without", "noise", restarts=0)
    assert straight.returncode == 0, straight.stderr[-3000:]
    kept, lost = two_nodes(root / "elastic", script_env, "--without", "noise", "--lose-node-step", "7")
    return root, kept, lost


def steps_read(out: Path, attempt: int | None = None) -> dict[int, dict]:
    """Per step (of ``attempt``, or all): the samples every replica read, its replica count, and the mean loss."""
    steps: dict[int, dict] = {}
    for path in out.glob("losses_rank*.jsonl"):
        for line in map(json.loads, path.read_text().splitlines()):
            if line["stage_rank"] == 0 and attempt in (None, line["attempt"]):
                step = steps.setdefault(line["step"], {"samples": [], "replicas": line["replicas"], "losses": []})
                step["samples"] += line["samples"]
                step["losses"].append(line["loss"])
    return {
        k: {**v, "samples": sorted(v["samples"]), "loss": sum(v["losses"]) / len(v["losses"])} for k, v in steps.items()
    }


def test_a_run_that_loses_a_machine_goes_on_on_the_others_reading_each_sample_once(fewer_machines):
    """Two "machines" of 2 processes (p=2, dp=2); at step 7 one is lost with its agent. torchrun's agent on the other
    finds its workers failed, forms a rendezvous of one machine, and starts 2 processes: the strategy plans p=2 dp=1,
    ``ckpt_path="last"`` resumes step 6's checkpoint (written at dp=2), and the loader's place in its epoch (one
    step in) moves to the one replica, which reads with the script's batch of 8 the rest of the epoch. Each later
    step reads the samples the straight run read at it, each sample of the epoch once; losses and the final weights
    and optimizer state equal the straight run's to fp32 rounding."""
    root, kept, lost = fewer_machines
    assert kept.returncode == 0, kept.stderr[-4000:]
    assert lost.returncode != 0
    assert "data_parallel_size=1" in kept.stdout + kept.stderr
    straight, first, second = (steps_read(root / "straight"), steps_read(root / "elastic", 0),
                               steps_read(root / "elastic", 1))  # fmt: skip
    assert sorted(first) == list(range(1, 7)) and sorted(second) == list(range(7, 13))
    assert {step["replicas"] for step in first.values()} == {2} and {s["replicas"] for s in second.values()} == {1}
    for step, read in (first | second).items():
        assert read["samples"] == straight[step]["samples"], step
        assert read["loss"] == pytest.approx(straight[step]["loss"], rel=1e-6, abs=1e-7), step
    epoch_one = [index for step in range(6, 11) for index in (first | second)[step]["samples"]]
    assert sorted(epoch_one) == list(range(40))  # steps 6-10, across the loss: each sample once
    want, got = final_state(root / "straight"), final_state(root / "elastic")
    assert want.keys() == got.keys() and any(key.startswith("optim/") for key in want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)


def test_a_killed_rank_is_restarted_and_the_run_resumes_by_itself(runs):
    root, _, killed, _, _, _ = runs
    assert killed.returncode == 0, killed.stderr[-4000:]
    for rank in range(4):
        attempts = [(line["attempt"], line["step"]) for line in losses(root / "killed", rank)]
        first = [step for attempt, step in attempts if attempt == 0]
        assert first == list(range(1, 7)), attempts  # killed at the start of step 7
        assert [step for attempt, step in attempts if attempt == 1] == list(range(7, 13)), attempts  # from step 6's


@pytest.mark.parametrize("name", ["killed", "hung"])
def test_every_loss_and_the_final_state_equal_the_uninterrupted_runs_bit_for_bit(runs, name):
    root, _, killed, hung, _, _ = runs
    job = {"killed": killed, "hung": hung}[name]
    assert job.returncode == 0, job.stderr[-4000:]
    for rank in range(4):
        want = {line["step"]: line["loss"] for line in losses(root / "straight", rank)}
        assert sorted(want) == list(range(1, 13))
        for line in losses(root / name, rank):  # the repeated steps included
            assert line["loss"] == want[line["step"]], (rank, line)
    straight, resumed = final_state(root / "straight"), final_state(root / name)
    assert straight and straight.keys() == resumed.keys()
    assert any(key.startswith("optim/") for key in straight)
    differ = [key for key in straight if not torch.equal(straight[key], resumed[key])]
    assert not differ, differ[:5]


def test_a_hung_rank_is_killed_by_the_failure_timeout_and_the_group_restarted(runs):
    """Rank 2 stopped (SIGSTOP) at the start of step 5: its watcher (rank 1) finds no heartbeat for 5 s, kills it
    and stops, the others stop with it, torchrun restarts the group (without the 30 s it waits for a stopped
    process), and the next attempt resumes from step 3's checkpoint."""
    root, _, _, hung, _, _ = runs
    assert hung.returncode == 0, hung.stderr[-4000:]
    assert "rank 2 failed: it stopped responding (no heartbeat for 5 s" in hung.stderr
    assert "killed it (process " in hung.stderr
    for rank in range(4):
        attempts = [(line["attempt"], line["step"]) for line in losses(root / "hung", rank)]
        assert [step for attempt, step in attempts if attempt == 0] == [1, 2, 3, 4], attempts
        assert [step for attempt, step in attempts if attempt == 1] == list(range(4, 13)), attempts


def test_a_run_failing_in_every_attempt_ends_nonzero_naming_the_rank_and_keeps_the_last_checkpoint(runs):
    """Rank 1 killed at the start of step 7 in both attempts, while step 6's asynchronous save may still be written:
    torchrun gives up with a nonzero exit naming the rank, no process is left (writer threads included), and the
    newest complete checkpoint is intact: step 6's if it was committed before the kill, step 3's otherwise."""
    root, _, _, _, spent, _ = runs
    assert spent.returncode != 0
    assert "rank 1 failed" in spent.stderr or "rank      : 1" in spent.stderr, spent.stderr[-4000:]
    steps = {line["attempt"]: line["step"] for line in losses(root / "spent", 0)}  # each attempt's last step
    assert steps == {0: 6, 1: 6}  # both attempts ran until the kill at step 7
    last = root / "spent" / "ckpts" / "last.ckpt"
    assert is_sharded_checkpoint(last)
    assert torch.load(last / "meta.pt", weights_only=True)["global_step"] in (3, 6)
    left = subprocess.run(["pgrep", "-f", str(root / "spent")], capture_output=True, text=True)
    assert left.stdout.strip() == "", "processes left behind: " + left.stdout


def test_slurms_requeue_signal_saves_on_every_rank_at_one_step_and_the_requeued_job_resumes_exactly(runs):
    """``SLURMEnvironment(auto_requeue=True)`` (Lightning's default under SLURM): the signal reaches rank 2 at the
    start of step 4; the step's collective carries it, and at the next step boundary every rank saves Lightning's
    requeue checkpoint (``hpc_ckpt_1.ckpt``, after step 4) and global rank 0 calls ``scontrol requeue`` once. SLURM
    then ends the job (SIGTERM to every task, during step 5): every rank saves again where they stop
    (``hpc_ckpt_2.ckpt``, after step 5). The requeued job's ``ckpt_path="last"`` finds that checkpoint, newer than
    the callback's (step 3; Lightning alone looks for it only without a ``ckpt_path``), and ends as the
    uninterrupted run, bit for bit."""
    root, *_, ((preempted_codes, preempted_out), (requeued_codes, requeued_out)) = runs
    out = root / "slurm"
    assert (out / "requeued").read_text() == "requeue 4242\n", preempted_out[-4000:]
    saved = {p.name: torch.load(p / "meta.pt", weights_only=True)["global_step"] for p in out.glob("hpc_ckpt_*")}
    assert saved == {"hpc_ckpt_1.ckpt": 4, "hpc_ckpt_2.ckpt": 5}
    assert len(set(preempted_codes)) == 1, preempted_out[-4000:]  # one clean stop (SIGTERMException) on every task
    assert requeued_codes == [0, 0, 0, 0], requeued_out[-4000:]
    for rank in range(4):
        attempts = [(line["attempt"], line["step"]) for line in losses(out, rank)]
        assert [step for attempt, step in attempts if attempt == 0] == [1, 2, 3, 4, 5], attempts
        assert [step for attempt, step in attempts if attempt == 1] == list(range(6, 13)), attempts
        want = {line["step"]: line["loss"] for line in losses(root / "straight", rank)}
        assert all(line["loss"] == want[line["step"]] for line in losses(out, rank)), rank
    straight, resumed = final_state(root / "straight"), final_state(out)
    assert all(torch.equal(straight[key], resumed[key]) for key in straight)
