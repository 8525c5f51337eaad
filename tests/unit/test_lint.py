"""The code base is ruff-clean (lint and format), so style problems fail the test command like any other."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(),
    reason="ruff is part of the test extra",
)
@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff(args):
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    proc = subprocess.run([ruff, *args], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
