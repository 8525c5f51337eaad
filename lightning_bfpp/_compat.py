"""Every private torch and Lightning name lightning_bfpp relies on, in one place.

torch's pipelining runtime only accepts custom schedules through private names (its own docs call the
area alpha and say the CSV loader "will most likely get renamed"), and a Lightning strategy that runs
backward itself must reach a few loop internals. Importing them here, and only here, means a torch or
Lightning upgrade breaks one file, and ``tests/unit/test_compat.py`` says which name moved. The versions
in ``pyproject.toml`` are the ones those tests pass on.
"""

from __future__ import annotations

import torch
from lightning.fabric.strategies.model_parallel import _distributed_checkpoint_save
from lightning.fabric.utilities.init import _materialize
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.trainer import call as lightning_call
from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.pipelining.schedules import (
    _Action as TorchAction,
)
from torch.distributed.pipelining.schedules import (
    _add_send_recv as add_send_recv,
)
from torch.distributed.pipelining.schedules import (
    _ComputationType as TorchKind,
)
from torch.distributed.pipelining.schedules import (
    _format_pipeline_order as format_torch_schedule,
)
from torch.distributed.pipelining.schedules import (
    _PipelineScheduleRuntime as PipelineScheduleRuntime,
)
from torch.utils._pytree import tree_flatten, tree_unflatten

SUPPORTED_TORCH = ((2, 13), (2, 14))


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch_version() -> None:
    """Refuse torch releases whose private pipelining API has not been tested with this package."""
    if torch_version() not in SUPPORTED_TORCH:
        supported = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_TORCH)
        raise ImportError(
            f"lightning_bfpp runs on torch.distributed.pipelining's private schedule runtime, tested on torch"
            f" {supported}; this is torch {torch.__version__}. Install a supported torch release."
        )


def set_skip_backward(trainer: object, value: bool) -> None:
    """Tell Lightning's automatic optimization not to zero gradients or call backward after the step.

    The pipeline runs forward and backward inside ``training_step``; Lightning would otherwise zero the
    gradients right after it (see its ``_AutomaticOptimization`` closure). Lightning's own
    ``StochasticWeightAveraging`` callback uses the same switch.
    """
    trainer.fit_loop._skip_backward = value  # type: ignore[attr-defined]


def request_train_dataloader(trainer: object) -> object:
    """The training DataLoader as the user defined it (before Lightning adds a distributed sampler)."""
    return _request_dataloader(trainer.fit_loop._data_source)  # type: ignore[attr-defined]


def prediction_lists(trainer: object) -> list[list[object]]:
    """The per-dataloader lists ``trainer.predict`` returns (the prediction loop's own, mutable in place)."""
    return trainer.predict_loop._predictions  # type: ignore[attr-defined]


def seen_batch_indices(dataloader: object) -> list[list[int]] | None:
    """Dataset indices of each batch a prediction dataloader produced (Lightning's index-recording sampler)."""
    return getattr(getattr(dataloader, "batch_sampler", None), "seen_batch_indices", None)


def metric_step_value(metric: object) -> object:
    """A torchmetrics Metric's value from its last ``forward`` (what Lightning logs per step)."""
    return metric._forward_cache  # type: ignore[attr-defined]


def set_metric_step_value(metric: object, value: object, *, mark_updated: bool) -> None:
    """Set the per-step value Lightning will log for ``metric``; ``mark_updated`` tells torchmetrics that this
    rank's (empty) state takes part in ``compute`` on purpose, so it does not warn about a missing update."""
    metric._forward_cache = value  # type: ignore[attr-defined]
    if mark_updated:
        metric._update_count += 1  # type: ignore[attr-defined]


def get_skip_backward(trainer: object) -> bool:
    return bool(trainer.fit_loop._skip_backward)  # type: ignore[attr-defined]


__all__ = [
    "SUPPORTED_TORCH",
    "_METADATA_FILENAME",
    "PipelineScheduleRuntime",
    "TorchAction",
    "TorchKind",
    "_distributed_checkpoint_save",
    "_materialize",
    "add_send_recv",
    "check_torch_version",
    "format_torch_schedule",
    "get_skip_backward",
    "lightning_call",
    "metric_step_value",
    "prediction_lists",
    "replicate",
    "request_train_dataloader",
    "seen_batch_indices",
    "set_metric_step_value",
    "set_skip_backward",
    "torch_version",
    "tree_flatten",
    "tree_unflatten",
]
