"""The engine's runners, one module (or package) each, registered by name like schedule kinds.

- ``"stages"`` (:mod:`.stages`): each rank keeps its stages, one FSDP2 unit each, run on torch's pipeline runtime;
- ``"weight_passing"`` (:mod:`.weight_passing`): one chunk per rank, the weights travel (TawPipe).

Adding a runner: a module that builds a :class:`~lightning_bfpp.engine.runners.base.Runner` and calls
:func:`~lightning_bfpp.engine.runners.base.register_runner`, one import line below, and a schedule kind whose
``runner`` names it.
"""

from lightning_bfpp.engine.runners import stages, weight_passing  # noqa: F401  (each registers itself)
from lightning_bfpp.engine.runners.base import Runner, get_runner, register_runner, runner_names

__all__ = ["Runner", "get_runner", "register_runner", "runner_names"]
