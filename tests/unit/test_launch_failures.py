"""The harness tells a rank that died in native code (run the launch once more) from one that raised (fail)."""

from __future__ import annotations

from tests.distributed.harness import CRASH_PREFIX, _native_crash

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
