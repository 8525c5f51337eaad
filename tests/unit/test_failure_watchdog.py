"""The failure watchdog on its own: real processes blocked forever, a store they share, a report or a kill.

No process group and no Lightning: each process only starts a :class:`FailureWatchdog` and then blocks, as a
rank stuck in a collective would. The test hosts the store (as torchrun's agent does), so killing any rank
leaves it standing, and checks who exits, with what status and message, and how soon.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

RANK_SCRIPT = """
import tests.lean_imports  # Lightning (imported by lightning_bfpp) without torchmetrics' slow extras
import sys, time
import torch.distributed as dist
from lightning_bfpp.engine.failures import FailureWatchdog

rank, world, port, action = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=__import__("datetime").timedelta(seconds=30))
watchdog = FailureWatchdog(store, rank, world, namespace="test", timeout=2.0, interval=0.2, own_failure_grace=1.0)
watchdog.start()
print("started", flush=True)
if action == "report":
    watchdog.report("ValueError: injected")
time.sleep(120)  # blocked, like a rank waiting in a collective that will never complete
"""


def _start(world: int, actions: dict[int, str]) -> tuple[dist.TCPStore, list[subprocess.Popen]]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(r), str(world), str(store.port), actions.get(r, "block")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    for proc in procs:  # every watchdog is running before anything happens
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "started":  # it died starting: say how, for whoever reads the failure
            for other in procs:
                other.kill()
            _, err = proc.communicate(timeout=30)
            raise AssertionError(f"a rank exited with {proc.returncode} before its watchdog started:\n{err[-4000:]}")
    return store, procs


def _finish(procs: list[subprocess.Popen], within: float) -> list[tuple[int, str]]:
    deadline = time.monotonic() + within
    results = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"a process was still running {within} s after the failure") from None
        results.append((proc.returncode, err))
    return results


def test_a_reported_failure_stops_every_process_with_the_message():
    store, procs = _start(3, {1: "report"})
    start = time.monotonic()
    results = _finish(procs, within=10)
    assert time.monotonic() - start < 5  # 0.2 s polling, 1 s grace for the reporter
    for rank, (code, err) in enumerate(results):
        assert code == 1
        assert f"[rank {rank}] BFPPStrategy: stopping this process because rank 1 failed: ValueError: injected" in err
    del store


def test_a_killed_process_is_noticed_by_its_heartbeat_and_stops_the_others():
    store, procs = _start(3, {})
    procs[2].send_signal(signal.SIGKILL)
    start = time.monotonic()
    results = _finish(procs, within=15)
    assert time.monotonic() - start < 2.0 + 3.0  # timeout 2 s + polling and exit
    assert results[2][0] == -signal.SIGKILL
    for rank in (0, 1):
        code, err = results[rank]
        assert code == 1
        assert "because rank 2 failed: it stopped responding (no heartbeat for 2 s" in err, err
    del store


def test_a_stopped_process_is_killed_by_its_watcher_and_the_others_stop():
    """SIGSTOP: the process is there but does nothing (a hang). Its watcher (rank 1 watches rank 2) kills it on
    this host, so that no launcher has to wait for a stopped process to end."""
    store, procs = _start(3, {})
    procs[2].send_signal(signal.SIGSTOP)
    start = time.monotonic()
    results = _finish(procs, within=15)
    assert time.monotonic() - start < 2.0 + 3.0
    assert results[2][0] == -signal.SIGKILL
    for rank in (0, 1):
        code, err = results[rank]
        assert code == 1
        assert "because rank 2 failed: it stopped responding (no heartbeat for 2 s" in err, err
        assert f"killed it (process {procs[2].pid} on this host)" in err, err
    del store


def test_losing_the_store_stops_every_process():
    store, procs = _start(2, {})
    start = time.monotonic()
    del store  # the process hosting the store (rank 0's, under Lightning's launcher) is gone
    results = _finish(procs, within=20)
    assert time.monotonic() - start < 10  # a 5 s grace for a run that is merely ending
    for code, err in results:
        assert code == 1 and "the process group's store stopped answering" in err, err


EXIT_SCRIPT = """
import atexit, sys
import torch.distributed as dist
from lightning_bfpp.engine import failures

# registered first, so it runs after the package's handler: is the group still there at the very end?
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
store = dist.HashStore()
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
failures.release_groups_at_exit()
failures.release_groups_at_exit()  # once per process, however many strategies set up
if sys.argv[1] == "failed":
    failures.FailureWatchdog(store, 0, 1, namespace="exit").report("ValueError: injected")
"""


@pytest.mark.parametrize(("how", "left"), [("finished", False), ("failed", True)])
def test_process_groups_are_destroyed_at_a_normal_exit_and_kept_after_a_reported_failure(how, left):
    """A normal exit destroys the groups before the interpreter's finalization (gloo's threads may otherwise
    abort it); a process that reported its own failure leaves them (its transfers may wait on its peers)."""
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, how], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"initialized at exit: {left}" in proc.stdout, proc.stdout + proc.stderr[-2000:]
