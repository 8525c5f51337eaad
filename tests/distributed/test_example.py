"""The README's main job (examples/train_gpt.py) runs end to end, shortened."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def test_train_gpt_example_runs(tmp_path):
    cmd = [
        sys.executable, "examples/train_gpt.py", "--devices", "2", "--pipeline-parallel-size", "2",
        "--max-steps", "12", "--val-every", "6", "--layers", "4", "--dim", "32", "--root", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final metrics:" in proc.stdout and "val_acc" in proc.stdout
