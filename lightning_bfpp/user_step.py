"""Run the user's unchanged ``training_step`` / ``validation_step`` / … once per micro-batch.

The contract is that a step method is single-device code calling ``self(...)``. Under the pipeline that
call means two things on two ranks:

- on the rank holding the first stage, the arguments of ``self(...)`` are the pipeline's input: the step is
  run until that call (:func:`capture_model_input`), which then stops it, so whatever the step does to the
  batch first (unpacking, reshaping) is honoured without any convention about the batch's layout;
- on the rank holding the last stage, ``self(...)`` returns the pipeline's output for the micro-batch
  (:func:`model_returns`), and the rest of the step (loss, metrics, ``self.log``) runs as written.

``self.log`` calls made there are recorded (:class:`LogRecorder`) rather than passed to Lightning, because
only last-stage ranks make them; :mod:`lightning_bfpp.logged_values` combines and replays them everywhere.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torchmetrics import Metric

from lightning_bfpp._compat import metric_step_value

_LOG_SIGNATURE = inspect.signature(LightningModule.log)


class _ModelInputCaptured(BaseException):
    """Raised by the stand-in ``forward`` to stop a step at its ``self(...)`` call (BaseException so that
    a user's ``except Exception`` does not swallow it)."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.model_args = args
        self.model_kwargs = kwargs


@contextmanager
def _patched(module: LightningModule, **attrs: Any) -> Iterator[None]:
    for name, value in attrs.items():
        object.__setattr__(module, name, value)
    try:
        yield
    finally:
        for name in attrs:
            module.__dict__.pop(name, None)


def capture_model_input(
    module: LightningModule, step: Callable[..., Any], step_name: str, *step_args: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Run ``step(*step_args)`` up to its ``self(...)`` call and return that call's arguments."""

    def stop_at_forward(*args: Any, **kwargs: Any) -> Any:
        raise _ModelInputCaptured(args, kwargs)

    with _patched(module, forward=stop_at_forward, log=_discard, log_dict=_discard):
        try:
            step(*step_args)
        except _ModelInputCaptured as captured:
            return captured.model_args, captured.model_kwargs
    raise RuntimeError(
        f"BFPPStrategy: `{step_name}` returned without calling `self(...)`. Under BFPPStrategy the pipeline's"
        f" input is what `{step_name}` passes to `self(...)`, and `self(...)` returns the pipeline's output;"
        " call the model that way instead of calling its layers directly."
    )


def _discard(*args: Any, **kwargs: Any) -> None:
    return None


@contextmanager
def model_returns(module: LightningModule, output: Any) -> Iterator[Callable[[], bool]]:
    """Inside the block, ``module(...)`` returns ``output``; yields a function telling whether it was called."""
    called = False

    def pipeline_output(*args: Any, **kwargs: Any) -> Any:
        nonlocal called
        called = True
        return output

    with _patched(module, forward=pipeline_output):
        yield lambda: called


@dataclass
class LoggedValue:
    """One ``self.log`` call: the value and the call's other arguments."""

    name: str
    value: torch.Tensor | Metric
    options: dict[str, Any]
    metric_step_value: torch.Tensor | None = None  # a metric's forward value when it was logged


@dataclass
class LogRecorder:
    """Records ``self.log`` / ``self.log_dict`` calls instead of passing them to Lightning."""

    records: list[LoggedValue] = field(default_factory=list)

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        bound = _LOG_SIGNATURE.bind(None, name, value, *args, **kwargs)
        bound.apply_defaults()
        options = dict(bound.arguments)
        for key in ("self", "name", "value"):
            options.pop(key)
        if isinstance(value, numbers.Number):
            value = torch.tensor(value, dtype=torch.float32)
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"`self.log({name!r}, ...)` was given a tensor with {value.numel()} elements; Lightning"
                    " logs scalars."
                )
            value = value.detach().reshape(())
        elif isinstance(value, Metric):
            cache = metric_step_value(value)
            step_value = None if cache is None else torch.as_tensor(cache).detach().clone()
            self.records.append(LoggedValue(name, value, options, step_value))
            return
        else:
            raise TypeError(
                f"`self.log({name!r}, ...)` under BFPPStrategy takes a number, a scalar tensor or a torchmetrics"
                f" Metric, got {type(value).__name__}."
            )
        self.records.append(LoggedValue(name, value, options))

    @contextmanager
    def recording(self, module: LightningModule) -> Iterator[None]:
        # log_dict calls self.log, so patching log alone records both
        with _patched(module, log=self.log):
            yield


def step_loss(output: Any, step_name: str) -> torch.Tensor:
    """The loss a ``training_step`` returned, by Lightning's rules (a tensor, or a mapping with ``"loss"``)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    if output is None:
        raise RuntimeError(
            f"BFPPStrategy: `{step_name}` returned None. Skipping a batch by returning None is not possible in a"
            " pipeline (the other stages have already run it); return the loss for every batch."
        )
    raise RuntimeError(
        f"BFPPStrategy: `{step_name}` must return the loss tensor or a dict with a 'loss' tensor, got"
        f" {type(output).__name__}."
    )
