"""lightning-bfpp: breadth-first pipeline parallelism over sharded data parallelism for PyTorch Lightning.

``import lightning_bfpp`` registers the strategy name ``"bfpp"`` with Lightning (Lightning discovers
strategies only through its registry, not through package entry points), so afterwards
``Trainer(strategy="bfpp")`` works as well as ``Trainer(strategy=BFPPStrategy(...))``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_bfpp.loss import mean_over_items
from lightning_bfpp.strategy import BFPPStrategy

__version__ = "0.1.0"

BFPPStrategy.register_strategies(StrategyRegistry)

__all__ = ["BFPPStrategy", "__version__", "mean_over_items"]
