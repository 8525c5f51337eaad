"""Module hygiene: the engine half imports without Lightning, and drawing changes nothing process-wide.

Only the adapter modules may import Lightning.

Checked in a fresh interpreter whose import system refuses ``lightning`` (and its old names and
torchmetrics): the package itself imports (without the strategy, which needs Lightning), then every engine
module. That keeps the engine reusable outside a Trainer (``tests/distributed/test_plain_loop.py`` trains
with it from a plain torch loop) and the private torch names (``_compat``) apart from Lightning's
(``_lightning_compat``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

ENGINE = [
    "lightning_bfpp._compat",
    "lightning_bfpp.config",
    "lightning_bfpp.partition",
    "lightning_bfpp.schedule",
    "lightning_bfpp.timeline",
    "lightning_bfpp.microbatch",
    "lightning_bfpp.sharding",
    "lightning_bfpp.checkpoint",
    "lightning_bfpp.runtime",
    "lightning_bfpp.layers",
    "lightning_bfpp.trace",
    "lightning_bfpp.clipping",
    "lightning_bfpp.tied",
    "lightning_bfpp.agreement",
    "lightning_bfpp.failures",
    "lightning_bfpp.frozen",
    "lightning_bfpp.initial_state",
    "lightning_bfpp.loss",
    "lightning_bfpp.predictions",
    "lightning_bfpp.random_state",
    "lightning_bfpp.reductions",
    "lightning_bfpp.topology",
    "lightning_bfpp.cpu_threads",
    "lightning_bfpp.weight_passing",
    "lightning_bfpp.executors",
    "lightning_bfpp.pipeline",
    "lightning_bfpp.plan.costs",
    "lightning_bfpp.plan.simulate",
    "lightning_bfpp.plan.search",
    "lightning_bfpp.plan.cluster",
    "lightning_bfpp.plan.weight_passing",
]

_SCRIPT = """
import importlib, importlib.abc, sys

BLOCKED = {"lightning", "lightning_fabric", "pytorch_lightning", "torchmetrics"}

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Refuse())
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[1]).parent))
import lightning_bfpp  # the package itself: without Lightning it imports without the strategy
assert "BFPPStrategy" not in vars(lightning_bfpp)
for name in sys.argv[2:]:
    importlib.import_module(name)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not leaked, leaked
try:  # the blocker works: the Lightning half fails under it
    importlib.import_module("lightning_bfpp._lightning_compat")
except ImportError as error:
    assert "is blocked in this test" in str(error), error
else:
    raise AssertionError("lightning_bfpp._lightning_compat imported with Lightning blocked")
print("ok")
"""


def _import_blocked(*modules: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(REPO / "lightning_bfpp"), *modules],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_engine_modules_import_without_lightning():
    proc = _import_blocked(*ENGINE)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


_DRAW = """
import sys
from pathlib import Path
import matplotlib

matplotlib.use("svg")  # the user's choice, which drawing a timeline must leave alone
from lightning_bfpp.timeline import Span, draw

path = Path(sys.argv[1])
draw([Span(0, "forward", 0.0, 0.01, 0, 0), Span(1, "backward", 0.01, 0.03, 1, 0)], path, "two spans")
assert matplotlib.get_backend() == "svg", matplotlib.get_backend()
pyplot = sys.modules.get("matplotlib.pyplot")  # Lightning itself imports it
assert pyplot is None or pyplot.get_fignums() == [], "a figure was left in pyplot's registry"
assert path.read_bytes()[:4] == b"\\x89PNG"
print("ok")
"""


def test_drawing_a_timeline_has_no_process_wide_side_effects(tmp_path):
    """Tracing runs inside the user's training process: no backend switch, no pyplot figure registry."""
    proc = subprocess.run(
        [sys.executable, "-c", _DRAW, str(tmp_path / "t.png")], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
