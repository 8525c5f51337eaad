"""Imports Lightning without torchmetrics' optional integrations, in the processes the tests start (imported first).

Importing ``lightning`` imports torchmetrics, which at import time loads each optional integration whose package
is installed: ``transformers`` (for BERTScore), ``scipy.signal`` and ``matplotlib`` (for plots). The test extra
installs all three (transformers for the Hugging Face tests, matplotlib for traces), and loading them made up
about 40% of the start of every such process (py-spy, samples under ``import lightning``): seconds of the 2 cores
per multi-process launch. No test uses those torchmetrics features, so while Lightning is imported here,
torchmetrics is told that the three are absent, which it supports as it supports any missing optional
dependency. The packages themselves stay importable, and availability checks first made after this import answer
truthfully: the Hugging Face runs and ``trace=`` plots import transformers and matplotlib when they need them.

Imported by the processes the tests start (``tests.distributed.worker``, the failure watchdog's ranks), never by
the pytest process.
"""

from __future__ import annotations

import re
from typing import Any

from lightning_utilities.core import imports as _imports

# torchmetrics' optional integrations that are slow to import and unused by the tests
LEFT_OUT = frozenset({"transformers", "scipy", "matplotlib"})


def _package(requirement: str | None) -> str:
    """``"transformers>=4.4.0"`` or ``"scipy.signal"`` -> the top-level package name."""
    return re.split(r"[\s<>=!~;\[.]", requirement or "", maxsplit=1)[0]


def import_lightning() -> None:
    """``import lightning`` with torchmetrics' availability checks answering False for :data:`LEFT_OUT` (a plain
    import where ``lightning_utilities`` no longer has the two checks this relies on)."""
    if not (hasattr(_imports.RequirementCache, "_check_available") and hasattr(_imports, "package_available")):
        import lightning

        return
    check_available = _imports.RequirementCache._check_available
    package_available = _imports.package_available
    importing = [True]  # modules that bound the replacement below keep it: it answers truthfully afterwards

    def left_out(name: str | None) -> bool:
        return importing[0] and _package(name) in LEFT_OUT

    def left_out_check(cache: Any) -> None:
        if not hasattr(cache, "available") and (left_out(cache.requirement) or left_out(cache.module)):
            cache.available = False
            cache.message = f"{cache.requirement or cache.module} left out while importing Lightning in a test worker"
            return
        check_available(cache)

    def left_out_available(package_name: str) -> bool:
        return not left_out(package_name) and package_available(package_name)

    _imports.RequirementCache._check_available = left_out_check  # type: ignore[method-assign]
    _imports.package_available = left_out_available  # type: ignore[assignment]
    try:
        import lightning  # noqa: F401
    finally:
        importing[0] = False
        _imports.RequirementCache._check_available = check_available  # type: ignore[method-assign]
        _imports.package_available = package_available


import_lightning()
