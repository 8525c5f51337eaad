"""The harness tells a rank that died in native code (run the launch once more) from one that raised (fail), and says
why a launch failed where its message ends."""

from __future__ import annotations

import os
from pathlib import Path

from tests.distributed.harness import CRASH_PREFIX, LAUNCH_FAILED, _native_crash, _why_failed

LOST = (
    "[rank1]: RuntimeError: [../gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:22915: Connection reset by"
    " peer. This is typically caused by a remote worker hanging or bugs in the application."
)


def test_survivors_that_only_lost_a_peer_mean_a_silent_death(tmp_path):
    stderr = f"some output\n{LOST}\n[rank2]: RuntimeError: ... Connection closed by peer [127.0.0.1]:1234\n"
    assert _native_crash(stderr, tmp_path) is not None


def test_a_python_error_of_its_own_is_not_retried(tmp_path):
    stderr = f"{LOST}\n[rank0]: ValueError: BFPPStrategy: unknown `schedule='x'`\n"
    assert _native_crash(stderr, tmp_path) is None
    assert _native_crash("no error at all\n", tmp_path) is None


def test_a_fault_handler_report_is_a_native_crash(tmp_path):
    (tmp_path / f"{CRASH_PREFIX}node0.rank3.txt").write_text("Fatal Python error: Segmentation fault\n\nThread ...")
    (tmp_path / f"{CRASH_PREFIX}node0.rank1.txt").write_text("")  # a rank that did not crash
    report = _native_crash("[rank0]: ValueError: something", tmp_path)
    assert report is not None and "node0.rank3" in report and "Segmentation fault" in report
    assert "rank1" not in report


def test_the_message_ends_with_why_not_with_the_survivors_lost_peers(tmp_path):
    """A failed launch's output ends with the survivors' errors (a peer left); the ranks that raised of their own,
    and where, come after it, where a log's tail shows them."""
    stderr = (
        "[rank2]: Traceback (most recent call last):\n"
        '[rank2]:   File "tests/distributed/worker.py", line 548, in _held_by_process\n'
        "[rank2]:     names.append(Path(comm).read_text())\n"
        "[rank2]: ProcessLookupError: [Errno 3] No such process\n"
        f"{LOST}\n"
        "[rank 3] BFPPStrategy: stopping this process because rank 2 failed: it raised\n"
        "[rank2]: ValueError: a later error of the same rank\n"
        f"{LAUNCH_FAILED} rank 2 exited with 1; exit codes by rank: [1, 1, 1, 1]\n"
    )
    why = _why_failed(stderr, tmp_path)
    assert why.startswith(f"{LAUNCH_FAILED} rank 2 exited with 1")
    assert "ProcessLookupError: [Errno 3]" in why and "line 548, in _held_by_process" in why
    assert "stopping this process because rank 2 failed" in why
    assert "later error" not in why and "Connection reset" not in why
    report = 'Fatal Python error: Aborted\n\nThread 0x1 (most recent call first):\n  File "a.py", line 1 in idle\n\n'
    (tmp_path / f"{CRASH_PREFIX}node0.rank1.txt").write_text(report + 'Current thread 0x2:\n  File "b.py", line 2 in f')
    crashed = _why_failed(LOST, tmp_path)
    assert "--- node0.rank1 ---\nFatal Python error: Aborted\nCurrent thread 0x2" in crashed and "in f" in crashed
    assert "in idle" not in crashed  # the stack of the thread the signal reached, not every thread's
    assert _why_failed(LOST, tmp_path / "none").startswith("no rank said why")


def test_the_census_of_threads_skips_one_that_ends_while_it_is_read(monkeypatch):
    """A thread that ends between the listing and the read is gone before the open (ENOENT) or after it (ESRCH);
    either is skipped, not raised (which failed a launch after its run had passed)."""
    from tests.distributed import worker

    tasks = sorted(os.listdir("/proc/self/task"))
    before = worker._held_by_process()["gloo_threads"]
    read = Path.read_text

    def racing(path: Path, *args, **kwargs) -> str:
        if path.name == "comm" and path.parent.name == "0":  # listed, then gone before the open
            raise FileNotFoundError(2, "No such file or directory")
        if path.name == "comm" and path.parent.name == "1":  # listed, then gone between the open and the read
            raise ProcessLookupError(3, "No such process")
        if path.name == "comm" and path.parent.name == "2":  # a gloo thread listed after them
            return "gloo_tcp_loop\n"
        return read(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", racing)
    monkeypatch.setattr(worker.os, "listdir", lambda folder: [*tasks, "0", "1", "2"])
    # the vanished threads are skipped and the census goes on to count the rest (it raised ProcessLookupError before)
    assert worker._held_by_process()["gloo_threads"] == before + 1
