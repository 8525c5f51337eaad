"""``python -m benchmarks.gpu_check --device cpu``: the one-process check of everything the package does on a GPU,
run on the CPU at small sizes so that it never rots (a GPU runs it with ``--device cuda``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.distributed.harness import REPO

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def test_every_check_passes_on_the_cpu_and_every_schedule_is_measured(tmp_path, script_env):
    env = {**script_env, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    names = [c["name"] for c in result["checks"]]
    from lightning_bfpp.plan import schedule_names

    # every schedule, both models, the three precisions; the reductions, compile and resume
    for model in ("gpt", "llama"):
        for precision in ("32-true", "bf16-mixed", "bf16-true"):
            for schedule in schedule_names():
                assert any(n.startswith(f"{model} {precision} {schedule} ") for n in names), (
                    model,
                    precision,
                    schedule,
                )
    assert {"reductions overlapped (thread)", "compile per layer (eager)", "save and resume"} <= set(names)
    assert all(c["passed"] for c in result["checks"]), [c for c in result["checks"] if not c["passed"]]
    # the fp32 runs agree to the tolerance, not trivially (the reference and the pipeline trained the same steps)
    assert all(c["measured"]["error"] <= 1e-5 for c in result["checks"] if " 32-true " in c["name"])
    assert [row["schedule"] for row in result["schedules"]] == list(schedule_names())
    assert all(row["step_ms"] > 0 for row in result["schedules"])
    assert all(row["peak_bytes"] > 0 for row in result["schedules"] if row["schedule"] != "weight_passing")
    assert "| schedule | v | step (ms) |" in proc.stdout
