"""The launcher every measurement, benchmark and test starts its ranks with: each rank's environment, exit and
log, both start methods, and what it does when a rank fails, hangs or dies in native code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_bfpp.measure import launcher

pytestmark = pytest.mark.distributed  # starts processes
REPO = Path(__file__).resolve().parents[2]
TARGETS = "tests.unit.test_launcher"


def records(rank: int, folder: str) -> None:
    """Write what this rank sees of its environment."""
    names = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS")
    seen = {name: os.environ.get(name) for name in names}
    print(f"rank {rank} here")
    Path(folder, f"seen{rank}.json").write_text(json.dumps({"rank": rank, "pid": os.getpid(), **seen}))


def fails_on_one(rank: int) -> None:
    if rank == 1:
        raise RuntimeError("rank one's own error")
    time.sleep(600)  # waits as a rank left in a collective would


def sleeps_in_a_named_function(rank: int) -> None:
    time.sleep(600)


def crashes_natively(rank: int, as_after_a_trainer: bool = False) -> None:
    if rank == 0:
        import faulthandler
        import signal

        if as_after_a_trainer:  # what Lightning's Trainer does when it ends: every handler back from Python's table
            for signum in (signal.SIGSEGV, launcher.STACK_DUMP_SIGNAL):
                signal.signal(signum, signal.getsignal(signum))
            launcher.rearm_reports()
        faulthandler._sigsegv()
    time.sleep(600)


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_each_rank_gets_its_environment_and_log(tmp_path, start):
    target = records if start == "fork" else f"{TARGETS}:records"
    result = launcher.launch(target, 2, tmp_path, args=(str(tmp_path),), start=start, timeout_s=120)
    assert result.ok and result.exitcodes == (0, 0) and result.failed_rank is None, result.report()
    seen = [json.loads((tmp_path / f"seen{r}.json").read_text()) for r in range(2)]
    assert [s["LOCAL_RANK"] for s in seen] == ["0", "1"]
    assert {s["WORLD_SIZE"] for s in seen} == {"2"} and {s["NODE_RANK"] for s in seen} == {"0"}
    assert {s["OMP_NUM_THREADS"] for s in seen} == {"1"} and {s["MASTER_ADDR"] for s in seen} == {"127.0.0.1"}
    assert len({s["MASTER_PORT"] for s in seen}) == 1 and len({s["pid"] for s in seen} | {os.getpid()}) == 3
    assert [result.log(r).strip() for r in range(2)] == [f"rank {r} here" for r in range(2)]


def test_a_rank_leaves_an_outer_launcher_s_variables_and_finds_its_target(monkeypatch):
    """A launch from inside a torchrun process: its ranks must not read torchrun's ``RANK`` as their own; a
    spawned rank imports the target's package from where this process does."""
    for name, value in (("RANK", "7"), ("GROUP_RANK", "1"), ("LOCAL_WORLD_SIZE", "8")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    env = launcher._spawned_environment(f"{TARGETS}:records", None, {"LOCAL_RANK": "1"})
    assert not {"RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE"} & set(env) and env["LOCAL_RANK"] == "1"
    assert env["PYTHONPATH"] == str(REPO)


def test_a_failed_rank_stops_the_others_after_the_grace(tmp_path):
    started = time.monotonic()
    result = launcher.launch(fails_on_one, 3, tmp_path, timeout_s=120, grace_after_failure_s=1.0)
    assert time.monotonic() - started < 30
    assert result.reason == "rank 1 exited with 1" and result.failed_rank == 1
    assert result.exitcodes == (-9, 1, -9)
    assert "RuntimeError: rank one's own error" in result.log(1)
    assert "rank one's own error" in result.report()


def test_a_hang_is_ended_with_every_rank_s_stacks(tmp_path):
    result = launcher.launch(sleeps_in_a_named_function, 2, tmp_path, timeout_s=2)
    assert result.reason == "timed out after 2 s (a hang)" and result.exitcodes == (-9, -9)
    report = result.report()
    for rank in range(2):
        assert f"stacks.node0.rank{rank}" in report
    assert report.count("sleeps_in_a_named_function") == 2


@pytest.mark.parametrize("as_after_a_trainer", [False, True])
def test_a_native_crash_leaves_its_threads_stacks(tmp_path, as_after_a_trainer):
    result = launcher.launch(crashes_natively, 2, tmp_path, args=(as_after_a_trainer,), timeout_s=120,
                             grace_after_failure_s=0.5)  # fmt: skip
    assert result.reason.startswith("rank 0 exited with -") and result.exitcodes[0] < 0
    report = result.report()
    assert "crash.node0.rank0" in report and "Segmentation fault" in report and "crashes_natively" in report


def test_the_caller_s_streams_and_refusals(tmp_path, capfd):
    result = launcher.launch(records, 2, tmp_path, args=(str(tmp_path),), per_rank_logs=False, timeout_s=120)
    assert result.ok and result.log(0) == ""
    out = capfd.readouterr().out
    assert "rank 0 here" in out and "rank 1 here" in out
    with pytest.raises(ValueError, match="module:function"):
        launcher.launch(records, 2, tmp_path, start="spawn")
    with pytest.raises(ValueError, match="start='spawn'"):
        launcher.launch(records, 2, tmp_path, env={})
    assert sys.modules[__name__].records is records  # the module imports as the spawned ranks import it


UNWINDING = """
import sys
from pathlib import Path
from lightning_bfpp.measure import launcher
def target(rank):
    if rank == 1:
        raise RuntimeError("unwound to the top")
result = launcher.launch(target, 2, Path(sys.argv[1]), per_rank_logs=False, unwind_on_failure=True)
print("after the launch:", result.reason, flush=True)
"""


def test_a_forked_rank_can_leave_through_its_interpreter_s_exit(tmp_path, script_env):
    """With ``unwind_on_failure`` the failing rank's exception reaches the top of the program in that rank only:
    the interpreter prints it and exits with 1; the launching process goes on."""
    proc = subprocess.run([sys.executable, "-c", UNWINDING, str(tmp_path)], cwd=REPO, env=script_env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["after the launch: rank 1 exited with 1"]
    assert proc.stderr.count("Traceback (most recent call last)") == 1
    assert 'File "<string>", line 8, in <module>' in proc.stderr and "RuntimeError: unwound to the top" in proc.stderr


CLOBBERED = """
import faulthandler, signal, sys, time
from pathlib import Path
from lightning_bfpp.measure import launcher
faulthandler.enable()
signal.signal(signal.SIGSEGV, signal.getsignal(signal.SIGSEGV))  # a Trainer ended in this process
def crash(rank):
    faulthandler._sigsegv()
result = launcher.launch(crash, 1, Path(sys.argv[1]))
print(result.exitcodes, "Segmentation fault" in result.report(), flush=True)
"""


def test_a_rank_forked_after_a_trainer_ended_still_reports_its_crash(tmp_path, script_env):
    """faulthandler believes its handlers installed in a process whose Trainer put the defaults back; a rank
    forked from it installs them again (the suite's in-process Trainers left pytest's process so)."""
    proc = subprocess.run([sys.executable, "-c", CLOBBERED, str(tmp_path)], cwd=REPO, env=script_env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.stdout.strip() == "(-11,) True", proc.stdout + proc.stderr[-2000:]


def test_a_launch_from_another_thread(tmp_path):
    """A measurement started off the main thread (which alone may set signal handlers) launches all the same."""
    import threading

    results = []
    thread = threading.Thread(target=lambda: results.append(launcher.launch(records, 2, tmp_path, args=(str(tmp_path),),
                                                                          timeout_s=120)))  # fmt: skip
    thread.start()
    thread.join(timeout=150)
    assert results and results[0].ok, results and results[0].report()
