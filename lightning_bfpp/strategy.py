"""``lightning_bfpp.strategy.BFPPStrategy``: the strategy's public import path (see
:mod:`lightning_bfpp.adapter.strategy`), kept for configs written as ``class_path: lightning_bfpp.strategy...``."""

from lightning_bfpp.adapter.strategy import BFPPStrategy

__all__ = ["BFPPStrategy"]
