"""A hung multi-process launch is reported with every rank's Python stacks, not only its last output lines."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from tests.distributed import harness

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(60)]  # forks a launch and kills it

# the worker's start (the launcher forks the ranks, each registering the dump), then a "hang" in each rank
HANGING = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from lightning_bfpp.measure import launcher
    print("before the hang", file=sys.stderr, flush=True)
    def waiting_in_rank(rank):
        # ready from inside the frame the dump must show: a signal that lands while print returns still finds it
        print("ready", rank, flush=True)
        time.sleep(60)
    launcher.launch(waiting_in_rank, 2, Path(sys.argv[1]), per_rank_logs=False)
    """
)


def test_a_killed_launch_leaves_each_rank_stack_in_the_report(tmp_path):
    out = tmp_path / "out"
    with (tmp_path / "stderr").open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", HANGING, str(out)], cwd=harness.REPO, stdout=subprocess.PIPE, stderr=stderr,
            text=True, start_new_session=True,
        )  # fmt: skip
        ready = {proc.stdout.readline().split()[-1] for _ in range(2)}  # type: ignore[union-attr]
        assert ready == {"0", "1"}
        started = time.monotonic()
        harness._kill_hung(proc.pid)
        proc.wait(timeout=10)
    assert time.monotonic() - started < harness.STACK_DUMP_WAIT_S + 5
    report = harness._hang_report((tmp_path / "stderr").read_text(), out)
    assert report.startswith("before the hang")
    for rank in (0, 1):  # the forked process too, each in a section of its own
        section = report.split(f"--- node0.rank{rank} ---\n")[1].split("--- ")[0]
        assert "in waiting_in_rank" in section, report


def test_a_report_without_stacks_is_the_output_tail():
    text = "\n".join(f"line {k}" for k in range(100))
    assert harness._hang_report(text, harness.REPO / "no such folder") == harness._tail(text)
    assert harness._hang_report(None, harness.REPO / "no such folder") == ""
