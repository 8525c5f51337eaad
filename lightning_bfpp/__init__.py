"""lightning-bfpp: breadth-first pipeline parallelism over sharded data parallelism for PyTorch Lightning.

``import lightning_bfpp`` registers the strategy name ``"bfpp"`` with Lightning (Lightning discovers
strategies only through its registry, not through package entry points), so afterwards
``Trainer(strategy="bfpp")`` works as well as ``Trainer(strategy=BFPPStrategy(...))``.

The engine (``lightning_bfpp.engine.pipeline``, ``.executors``, ``.sharding``, ``.runtime``, …) imports no Lightning:
without Lightning installed the package imports without the strategy, and a plain torch loop can drive the
engine (see ``tests/distributed/plain_loop.py``).
"""

from typing import Any

from lightning_bfpp.engine.loss import mean_over_items
from lightning_bfpp.engine.pretrained import PretrainedWeights, load_pretrained

__version__ = "0.1.0"

try:
    from lightning.pytorch.strategies import StrategyRegistry
except ImportError:  # the engine alone
    StrategyRegistry = None

if StrategyRegistry is not None:
    from lightning_bfpp.adapter.generation import generate
    from lightning_bfpp.adapter.strategy import BFPPStrategy

    BFPPStrategy.register_strategies(StrategyRegistry)


def __getattr__(name: str) -> Any:
    if name in ("BFPPStrategy", "generate"):
        raise ImportError(f"`lightning_bfpp.{name}` needs Lightning (`pip install lightning`).")
    raise AttributeError(f"module 'lightning_bfpp' has no attribute {name!r}")


__all__ = ["BFPPStrategy", "PretrainedWeights", "__version__", "generate", "load_pretrained", "mean_over_items"]
