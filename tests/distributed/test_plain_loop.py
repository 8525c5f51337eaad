"""The engine without Lightning: a plain torch loop trains equal to one device.

``tests/distributed/plain_loop.py`` builds a pipeline (p=2, dp=2, 2 stages per rank, breadth-first,
``full_shard``) with the engine's builder, Lightning and torchmetrics blocked from import, passes the step
as two callbacks (the first stage's input, the last stage's loss) and steps its own SGD optimizer. Its losses
and final weights must equal the same model trained on one process on the same global batches (1e-5) — what
another trainer (Fabric, a custom loop) would get from the engine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.plain_loop import STEPS, batches, make_model

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
TOL = 1e-5


def test_a_plain_torch_loop_trains_the_engine_equal_to_one_device(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.distributed.plain_loop", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    # after the package's own optional import (the strategy, if Lightning is there) nothing even tried to import
    # Lightning or torchmetrics: an import caught as optional would show here
    assert all(r["blocked_imports"] == [] for r in ranks), [r["blocked_imports"] for r in ranks]

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    want_losses = []
    for x, y in batches():
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        want_losses.append(loss.item())
    assert len(want_losses) == STEPS

    # the last stage's ranks (pipeline rank 1) saw each replica's mean loss; the two replicas' mean is the batch's
    last = [r for r in ranks if 3 in r["stages"]]
    assert len(last) == 2
    for step, want in enumerate(want_losses):
        got = sum(r["losses"][step] for r in last) / 2
        assert abs(got - want) <= TOL * abs(want), (step, got, want)
    # every layer's weights, on every rank that holds its stage, equal one device's
    want = dict(model.named_parameters())
    for r in ranks:
        for name, value in r["weights"].items():
            error = (value.double() - want[name].detach().double()).norm().item()
            assert error <= TOL * want[name].detach().double().norm().item(), (name, error)
    assert set().union(*(r["weights"] for r in ranks)) == set(want)
    # the weights moved, so agreeing is not trivial
    initial = dict(make_model().named_parameters())
    moved = sorted(((want[k] - initial[k]).norm() / initial[k].norm()).item() for k in want)
    assert moved[len(moved) // 2] > 30 * TOL
