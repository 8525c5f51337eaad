"""What every test module shares: the repository root, the environment a launched script gets, the
``distributed`` marker for whatever lives in ``tests/distributed/``, and torch's process-wide flags put back.

Every temporary file of a session, its launched processes' included, lives under one folder that is removed
when the session passes (kept, and named, when it fails): a run of the suite writes a few GiB of checkpoints and
pretrained folders, which must not pile up on a CI machine's disk.

Markers are declared in ``pyproject.toml``. The tiers (README, ``.ci/run``): ``-m "not distributed"`` is the
pure half; ``tests/benchmarks/`` tests the benchmark code's own logic without timing anything.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DISTRIBUTED = REPO / "tests" / "distributed"
# what a launcher sets in each process it starts; a script started from a test must not inherit them
LAUNCHER_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK")


_SCRATCH_VARIABLE = "BFPP_TEST_SCRATCH"


def pytest_configure(config: pytest.Config) -> None:
    """Point ``tempfile`` (this process's, and through ``TMPDIR`` every process it starts) at a fresh scratch
    folder, before any test module is imported: modules that build a pretrained folder at import take it there."""
    if _SCRATCH_VARIABLE in os.environ:  # a nested pytest (a test that runs pytest) writes under its parent's
        return
    scratch = tempfile.mkdtemp(prefix="bfpp-tests-")
    os.environ[_SCRATCH_VARIABLE] = os.environ["TMPDIR"] = tempfile.tempdir = scratch


def pytest_unconfigure(config: pytest.Config) -> None:
    scratch = os.environ.get(_SCRATCH_VARIABLE)
    if scratch is None or tempfile.tempdir != scratch:
        return
    if getattr(config, "_bfpp_failed", False):
        print(f"\ntemporary files of this run kept for its failures: {scratch}")
        return
    shutil.rmtree(scratch, ignore_errors=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config._bfpp_failed = exitstatus not in (0, 5) or session.testsfailed > 0  # type: ignore[attr-defined]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under ``tests/distributed/`` starts processes: it carries the ``distributed`` marker whether
    or not its module says so (a unit-tier run must never start a launch by accident)."""
    for item in items:
        if DISTRIBUTED in Path(str(item.path)).parents and item.get_closest_marker("distributed") is None:
            item.add_marker(pytest.mark.distributed)


@pytest.fixture
def repo_root() -> Path:
    return REPO


@pytest.fixture
def script_env() -> dict[str, str]:
    """The environment for a script a test starts (an example, a CLI, a checkpoint tool): this process's,
    without a launcher's rank variables, with one intra-op thread per process (several share 2 cores here)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(autouse=True)
def _torch_process_flags() -> Iterator[None]:
    """Put back torch's process-wide flags a test may leave set (``Trainer(deterministic=True)`` and
    ``detect_anomaly=True`` set them for the process), so that no test runs under another's."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    anomaly = torch.is_anomaly_enabled()
    yield
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.autograd.set_detect_anomaly(anomaly)
