"""Module hygiene: the engine half imports without Lightning, and drawing changes nothing process-wide.

Only the adapter modules may import Lightning.

Checked in a fresh interpreter whose import system refuses ``lightning`` (and its old names and
torchmetrics): the package itself imports (without the strategy, which needs Lightning), then every engine
module. That keeps the engine reusable outside a Trainer (``tests/distributed/test_plain_loop.py`` trains
with it from a plain torch loop) and the private torch names (``_compat``) apart from Lightning's
(``_lightning_compat``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PACKAGE = REPO / "lightning_bfpp"


def _modules(folder: str) -> list[str]:
    """Every module of a layer's folder, read from the folder so that a new one cannot be left out."""
    return sorted(
        f"lightning_bfpp.{folder}.{path.stem}"
        for path in (PACKAGE / folder).glob("*.py")
        if path.stem not in ("__init__", "__main__")
    )


ENGINE = _modules("engine")
PLAN = _modules("plan")

_SCRIPT = """
import importlib, importlib.abc, sys

BLOCKED = {"lightning", "lightning_fabric", "pytorch_lightning", "torchmetrics"}
def blocked(name):
    return any(name == b or name.startswith(b + ".") for b in BLOCKED)

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if blocked(name):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Refuse())
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[1]).parent))
import lightning_bfpp  # the package itself: without Lightning it imports without the strategy
assert "BFPPStrategy" not in vars(lightning_bfpp)
for name in sys.argv[2:]:
    importlib.import_module(name)
leaked = sorted(m for m in sys.modules if blocked(m))
assert not leaked, leaked
try:  # the blocker works: the Lightning half fails under it
    importlib.import_module("lightning_bfpp.adapter._lightning_compat")
except ImportError as error:
    assert "is blocked in this test" in str(error), error
else:
    raise AssertionError("lightning_bfpp.adapter._lightning_compat imported with Lightning blocked")
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
    assert len(ENGINE) >= 20 and "lightning_bfpp.engine.pipeline" in ENGINE
    proc = _import_blocked(*ENGINE)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


_NOT_IN_PLANNING = ("torch.distributed", "lightning", "lightning_fabric", "pytorch_lightning", "torchmetrics")
_LAYERS_ABOVE = (
    "lightning_bfpp.engine",
    "lightning_bfpp.adapter",
    "lightning_bfpp.measure",
    "lightning_bfpp.integrations",
)


def _imports_outside_planning(path: Path) -> list[str]:
    """What a module's import statements name that planning must not use (``import torch`` itself loads
    ``torch.distributed``, so this reads the source rather than ``sys.modules``)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return sorted({n for n in names if any(n == b or n.startswith(b + ".") for b in _NOT_IN_PLANNING + _LAYERS_ABOVE)})


def test_planning_modules_use_no_process_groups_lightning_or_engine():
    """Partition, schedules and the planner are pure: unit-tested without processes, usable offline. (The
    command line, ``plan/__main__.py``, imports the measuring code when asked to measure.)"""
    assert "lightning_bfpp.plan.schedule" in PLAN and "lightning_bfpp.plan.simulate" in PLAN
    found = {m: _imports_outside_planning(PACKAGE / "plan" / f"{m.rsplit('.', 1)[1]}.py") for m in PLAN}
    assert not any(found.values()), {m: names for m, names in found.items() if names}
    proc = _import_blocked(*PLAN, "lightning_bfpp.plan")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_the_planning_check_can_fail():
    assert _imports_outside_planning(PACKAGE / "engine" / "sharding.py")  # torch.distributed
    assert _imports_outside_planning(PACKAGE / "adapter" / "strategy.py")  # lightning, the engine


_DRAW = """
import sys
from pathlib import Path
import matplotlib

matplotlib.use("svg")  # the user's choice, which drawing a timeline must leave alone
from lightning_bfpp.plan.timeline import Span, draw

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
