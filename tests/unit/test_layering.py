"""Module hygiene: the engine half imports without Lightning, and drawing changes nothing process-wide.

Only the adapter modules may import Lightning, and ``measure/`` imports nothing above the engine (what it needs
from above, the step's capture and the strategy to train with, it takes as arguments).

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
    """Every module of a layer's folder and its sub-packages (a package as its ``__init__``), read from the folder
    so that a new one cannot be left out."""
    names = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__main__" or parts == (folder, "__init__"):
            continue
        names.append("lightning_bfpp." + ".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _path(module: str) -> Path:
    path = PACKAGE.joinpath(*module.split(".")[1:])
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


ENGINE = _modules("engine")
PLAN = _modules("plan")
MEASURE = _modules("measure")

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
    assert {"lightning_bfpp.engine.checkpoint", "lightning_bfpp.engine.checkpoint.loading"} <= set(ENGINE)  # a package
    proc = _import_blocked(*ENGINE)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


_NOT_IN_PLANNING = ("torch.distributed", "lightning", "lightning_fabric", "pytorch_lightning", "torchmetrics")
_LAYERS_ABOVE = (
    "lightning_bfpp.engine",
    "lightning_bfpp.adapter",
    "lightning_bfpp.measure",
    "lightning_bfpp.integrations",
)


def _imported_names(path: Path, *, typing_only: bool = True) -> list[str]:
    """What a module's import statements name, at any depth (lazy imports in functions too); ``typing_only=False``
    leaves out those under ``if TYPE_CHECKING:``, which never run."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    if not typing_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                skipped |= {id(inner) for inner in ast.walk(node)}
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def _imports_outside_planning(path: Path) -> list[str]:
    """What a module's import statements name that planning must not use (``import torch`` itself loads
    ``torch.distributed``, so this reads the source rather than ``sys.modules``)."""
    names = _imported_names(path)
    return sorted({n for n in names if any(n == b or n.startswith(b + ".") for b in _NOT_IN_PLANNING + _LAYERS_ABOVE)})


def _import_graph(modules: list[str], *, typing: bool = False) -> dict[str, set[str]]:
    """Which of ``modules`` each imports when it runs (a submodule's own parent package not counted: Python
    initialises it first, whatever the submodule imports); ``typing=True`` counts those under ``if TYPE_CHECKING:``
    too, which a type checker and a reader follow."""
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for module in modules:
        targets = {n for n in _imported_names(_path(module), typing_only=typing) if n in known}
        graph[module] = {t for t in targets if t != module and not module.startswith(t + ".")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_planning_modules_use_no_process_groups_lightning_or_engine():
    """Partition, schedules and the planner are pure: unit-tested without processes, usable offline. (The
    command line, ``plan/__main__.py``, imports the measuring code when asked to measure, and what that takes from
    the adapter: the step's capture, the strategy.)"""
    assert {"lightning_bfpp.plan.actions", "lightning_bfpp.plan.simulate", "lightning_bfpp.plan.schedules"} <= set(PLAN)
    assert "lightning_bfpp.plan.schedules.zero_bubble" in PLAN
    found = {m: _imports_outside_planning(_path(m)) for m in PLAN}
    assert not any(found.values()), {m: names for m, names in found.items() if names}
    proc = _import_blocked(*PLAN, "lightning_bfpp.plan")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_planning_imports_form_no_circle():
    """No module of ``plan/`` imports, when it runs, one that imports it back (directly or round a longer
    circle): the registry, the plan, the simulator and the kinds' cost models each depend one way."""
    assert _cycle(_import_graph(PLAN)) is None, _cycle(_import_graph(PLAN))
    # the check finds a circle where there is one
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_planning_types_form_no_circle_either():
    """Counting the imports under ``if TYPE_CHECKING:`` too, ``plan/`` is layered: the schedule kinds (what the
    runtime needs) at the bottom, the plan above them, the configuration with its rules, the planner's models and
    search above that, each schedule module that registers rules of its own above what it registers into."""
    graph = _import_graph(PLAN, typing=True)
    assert _cycle(graph) is None, _cycle(graph)
    # a circle made of type-only imports is found
    typing_only = _import_graph(PLAN, typing=False)
    assert all(graph[m] >= typing_only[m] for m in PLAN)


def test_the_schedule_kind_knows_no_configuration_search_or_simulation():
    """``schedules/base.py`` (what a kind is) and the registry import, even for types, only the action lists and
    the placements: a kind reads a plan through its own protocol."""
    package_imports = {
        module: {n for n in _imported_names(_path(module)) if n.startswith("lightning_bfpp.") and n in set(PLAN)}
        for module in ("lightning_bfpp.plan.schedules.base", "lightning_bfpp.plan.schedules")
    }
    assert package_imports["lightning_bfpp.plan.schedules.base"] == {
        "lightning_bfpp.plan.actions",
        "lightning_bfpp.plan.placement",
    }
    assert package_imports["lightning_bfpp.plan.schedules"] <= {
        "lightning_bfpp.plan.actions",
        "lightning_bfpp.plan.schedules.base",
    }


def _reads_at_import(path: Path, names: tuple[str, ...]) -> list[str]:
    """The calls of ``names`` a module makes when imported (at module or class level; not inside a function)."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in names:
                found.append(f"{name} (line {node.lineno})")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def test_no_planning_module_reads_the_schedule_registry_when_imported(tmp_path):
    """The built-in kinds register themselves as :mod:`lightning_bfpp.plan` imports their modules, after the rest
    of ``plan/``: a module reading the registry at import (e.g. a default of every registered schedule) would see
    it incomplete, so each reads it when called."""
    readers = ("schedule_names", "get_schedule", "planner_model", "config_rules")
    found = {m: _reads_at_import(_path(m), readers) for m in PLAN}
    assert not any(found.values()), {m: calls for m, calls in found.items() if calls}
    assert _reads_at_import(PACKAGE / "plan" / "__init__.py", readers) == []
    module = tmp_path / "module.py"  # the check finds a read where there is one
    module.write_text("NAMES = schedule_names()\n\n\ndef later():\n    return get_schedule('x')\n")
    assert _reads_at_import(module, readers) == ["schedule_names (line 1)"]


def test_the_planning_check_can_fail():
    assert _imports_outside_planning(PACKAGE / "engine" / "sharding.py")  # torch.distributed
    assert _imports_outside_planning(PACKAGE / "adapter" / "strategy.py")  # lightning, the engine


# what ``measure/`` may import of this package: the layers below it, and itself
_BELOW_MEASURING = ("lightning_bfpp.engine", "lightning_bfpp.plan", "lightning_bfpp.measure")


def _imports_above_engine(path: Path) -> list[str]:
    """What a module's import statements name of this package above the engine (the adapter, the integrations,
    the package root and its own modules), at any depth (lazy imports in functions too), and its relative imports
    (which name no package)."""
    names = _imported_names(path)
    above = {
        n
        for n in names
        if (n == "lightning_bfpp" or n.startswith("lightning_bfpp."))
        and not any(n == b or n.startswith(b + ".") for b in _BELOW_MEASURING)
    }
    relative = {
        "." * node.level + (node.module or "")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level
    }
    return sorted(above | relative)


def test_measuring_modules_import_nothing_above_the_engine():
    """``measure/`` sits on the engine and the planner: it takes what it needs from above as arguments (the step's
    capture from the adapter, the strategy its emulated jobs train with), so no module of it names the adapter,
    the integrations or the package root, not even inside a function."""
    assert {"lightning_bfpp.measure.profile", "lightning_bfpp.measure.calibrate"} <= set(MEASURE)
    assert {"lightning_bfpp.measure.fitting", "lightning_bfpp.measure.emulated_jobs"} <= set(MEASURE)
    found = {m: _imports_above_engine(_path(m)) for m in MEASURE}
    assert not any(found.values()), {m: names for m, names in found.items() if names}


def test_the_calibrations_fitting_is_pure():
    """The calibration's fits run without processes or torch, as the planner's code does."""
    path = _path("lightning_bfpp.measure.fitting")
    assert _imports_outside_planning(path) == []
    assert not [n for n in _imported_names(path) if n == "torch" or n.startswith("torch.")]


def test_the_measuring_check_can_fail(tmp_path):
    module = tmp_path / "module.py"
    module.write_text(
        "from lightning_bfpp.engine import layers\n"
        "import lightning_bfpp.integrations.huggingface\n"
        "from . import sibling\n\n\n"
        "def train():\n"
        "    from lightning_bfpp import BFPPStrategy\n"
    )
    assert _imports_above_engine(module) == [
        ".",
        "lightning_bfpp",
        "lightning_bfpp.BFPPStrategy",
        "lightning_bfpp.integrations.huggingface",
    ]
    assert _imports_above_engine(PACKAGE / "adapter" / "auto.py")  # the adapter's own modules


LAUNCHER = PACKAGE / "measure" / "launcher.py"
# what starts a rank process other than through the launcher: a fork, multiprocessing's processes, torch's spawn
_PROCESS_STARTS = {"fork", "spawn", "start_processes", "Process", "Pool"}
# besides the launcher: the tests' server that forks a whole worker per launch (whose ranks then start through the
# launcher), and the plain torch program that drives the engine without Lightning as a user's own script would,
# with torch's spawn (torchrun, too, is started as a program where a test needs it)
_OTHER_STARTS = {REPO / "tests" / "distributed" / "preimported.py", REPO / "tests" / "distributed" / "plain_loop.py"}


def _process_starts(path: Path) -> list[str]:
    """The calls in ``path`` that start a process other than as a program (``subprocess``): ``os.fork``,
    ``multiprocessing``'s ``Process``/``Pool``, ``spawn``/``start_processes``, as ``name:line``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in _PROCESS_STARTS:
                found.append(f"{name}:{node.lineno}")
    return found


def test_every_rank_process_is_started_by_the_launcher():
    """The package's calibration, the benchmarks and the tests start a job's ranks through one launcher
    (``lightning_bfpp/measure/launcher.py``: rank environment, per-rank logs and fault reports, a failed rank
    stopping the others, a hang ended with stacks); a program started with ``subprocess`` is not a rank."""
    files = [p for folder in ("lightning_bfpp", "benchmarks", "tests") for p in sorted((REPO / folder).rglob("*.py"))]
    found = {
        str(p.relative_to(REPO)): s for p in files if p not in {LAUNCHER, *_OTHER_STARTS} if (s := _process_starts(p))
    }
    assert found == {}
    assert _process_starts(LAUNCHER) == ["fork:" + str(_line_of(LAUNCHER, "os.fork()"))]


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_the_launcher_imports_only_the_standard_library():
    """Any process can start ranks with it before importing torch, Lightning or the package's layers."""
    names = _imported_names(LAUNCHER, typing_only=False)
    assert [n for n in names if n.split(".")[0] not in sys.stdlib_module_names] == []


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
