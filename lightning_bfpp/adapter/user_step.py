"""Run the user's unchanged ``training_step`` / ``validation_step`` / … once per micro-batch.

The contract is that a step method is single-device code calling ``self(...)``. Under the pipeline that
call means two things on two ranks:

- on the rank holding the first stage, the arguments of ``self(...)`` are the pipeline's input: the step is
  run until that call (:func:`capture_model_input`), which then stops it, so whatever the step does to the
  batch first (unpacking, reshaping) is honoured without any convention about the batch's layout;
- on the rank holding the last stage, ``self(...)`` returns the pipeline's output for the micro-batch
  (:func:`model_returns`), and the rest of the step (loss, metrics, ``self.log``) runs as written.

``self.log`` calls made there are recorded (:class:`LogRecorder`) rather than passed to Lightning, because
only last-stage ranks make them; :mod:`lightning_bfpp.adapter.logged_values` combines and replays them everywhere.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torchmetrics import Metric

from lightning_bfpp.adapter._lightning_compat import metric_state_snapshot, metric_step_value, restore_metric_state
from lightning_bfpp.engine._compat import instance_attributes, tree_flatten
from lightning_bfpp.engine.generation import sampling_seed
from lightning_bfpp.engine.loss import item_sum

# `self.log`'s options and defaults, read once: a step logs per micro-batch, so no per-call signature binding
_LOG_OPTIONS = list(inspect.signature(LightningModule.log).parameters.values())[3:]  # after self, name, value
_LOG_DEFAULTS = {p.name: p.default for p in _LOG_OPTIONS}
_LOG_POSITIONAL = tuple(p.name for p in _LOG_OPTIONS if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)


class _GenerationCaptured(BaseException):
    """Raised by the stand-in ``generate`` to stop a step at its ``self.generate(...)`` call."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.call = GenerationCall(args, kwargs)


@dataclass
class GenerationCall:
    """A step's ``self.generate(...)`` call: its arguments (the prompts and the decoding options)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class _ModelInputCaptured(BaseException):
    """Raised by the stand-in ``forward`` to stop a step at its ``self(...)`` call (BaseException so that
    a user's ``except Exception`` does not swallow it)."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.model_args = args
        self.model_kwargs = kwargs


def capture_model_input(
    module: LightningModule,
    step: Callable[..., Any],
    step_name: str,
    *step_args: Any,
    metrics: Sequence[Metric] = (),
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Run ``step(*step_args)`` up to its ``self(...)`` call and return that call's arguments.

    What the step does before that call runs here a second time (the last stage runs the whole step), so
    its effects that would count twice are undone: ``self.log`` calls are dropped, and the states of the
    module's torchmetrics ``metrics`` are restored afterwards (an update made here would otherwise join the
    epoch value when Lightning syncs metric states over all processes).
    """

    def stop_at_forward(*args: Any, **kwargs: Any) -> Any:
        raise _ModelInputCaptured(args, kwargs)

    saved = [metric_state_snapshot(metric) for metric in metrics]
    try:
        with instance_attributes(module, forward=stop_at_forward, log=_discard, log_dict=_discard):
            try:
                step(*step_args)
            except _ModelInputCaptured as captured:
                _check_model_input(captured.model_args, captured.model_kwargs, step_name)
                return captured.model_args, captured.model_kwargs
    finally:
        for metric, state in zip(metrics, saved, strict=True):
            restore_metric_state(metric, state)
    raise RuntimeError(
        f"BFPPStrategy: `{step_name}` returned without calling `self(...)`. Under BFPPStrategy the pipeline's"
        f" input is what `{step_name}` passes to `self(...)`, and `self(...)` returns the pipeline's output;"
        " call the model that way instead of calling its layers directly."
    )


def capture_generation(
    module: LightningModule,
    step: Callable[..., Any],
    step_name: str,
    *step_args: Any,
    metrics: Sequence[Metric] = (),
) -> GenerationCall | None:
    """Run ``step(*step_args)`` up to its ``self.generate(...)`` call and return that call; None where the step calls
    ``self(...)`` first (it runs as a pipelined forward). Undone afterwards as :func:`capture_model_input` undoes."""

    def stop_at_forward(*args: Any, **kwargs: Any) -> Any:
        raise _ModelInputCaptured(args, kwargs)

    def stop_at_generate(*args: Any, **kwargs: Any) -> Any:
        raise _GenerationCaptured(args, kwargs)

    saved = [metric_state_snapshot(metric) for metric in metrics]
    stubs = {"forward": stop_at_forward, "generate": stop_at_generate, "log": _discard, "log_dict": _discard}
    try:
        with instance_attributes(module, **stubs):
            try:
                step(*step_args)
            except _GenerationCaptured as captured:
                return captured.call
            except _ModelInputCaptured:
                return None
    finally:
        for metric, state in zip(metrics, saved, strict=True):
            restore_metric_state(metric, state)
    raise RuntimeError(
        f"BFPPStrategy: `{step_name}` returned without calling `self(...)` or `self.generate(...)`; under"
        " BFPPStrategy a step's result must come from the pipeline, through one of them."
    )


def training_step_input(module: LightningModule, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What ``module.training_step(batch, 0)`` passes to ``self(...)``: the pipeline's input for ``batch``, the
    capture a profile's first layer runs on (``lightning_bfpp.measure.profile.profile_module``'s ``capture``)."""
    return capture_model_input(module, module.training_step, "training_step", batch, 0)


_CONSTANT_TYPES = (bool, int, float, type(None))


def _check_model_input(args: tuple[Any, ...], kwargs: dict[str, Any], step_name: str) -> None:
    """Refuse model inputs the pipeline cannot cut into micro-batches or send (strings, arbitrary objects)."""
    for where, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        leaves, _ = tree_flatten(value)
        for leaf in leaves:
            if not isinstance(leaf, (torch.Tensor, *_CONSTANT_TYPES)):
                raise TypeError(
                    f"BFPPStrategy: `{step_name}` passes a {type(leaf).__name__} to `self(...)` ({where}). The"
                    " pipeline's input must be tensors with the batch as dim 0 (numbers and None pass unchanged):"
                    " a per-sample value of another type cannot be cut into micro-batches or sent between stages."
                    " Turn it into a tensor before the model, e.g. tokenize text in the DataLoader's collate_fn."
                )


def _discard(*args: Any, **kwargs: Any) -> None:
    return None


@contextmanager
def model_returns(module: LightningModule, output: Any) -> Iterator[Callable[[], int]]:
    """Inside the block, ``module(...)`` returns ``output``; yields a function telling how often it was called."""
    calls = 0

    def pipeline_output(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return output

    with instance_attributes(module, forward=pipeline_output):
        yield lambda: calls


@contextmanager
def generate_returns(module: LightningModule, output: Any) -> Iterator[Callable[[], int]]:
    """Inside the block, ``module.generate(...)`` returns ``output`` and ``module(...)`` is refused; yields a function
    telling how often ``generate`` was called."""
    calls = 0

    def generated(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return output

    def no_forward(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(_ONE_OR_THE_OTHER)

    with instance_attributes(module, generate=generated, forward=no_forward):
        yield lambda: calls


_ONE_OR_THE_OTHER = (
    "BFPPStrategy: a step that calls `self.generate(...)` cannot also call `self(...)`: the pipeline runs one of them"
    " per step. Compute what needs the model's forward (a loss on the completions) in a step of its own, e.g. in"
    " the next batch, or score the completions with `generate(..., return_dict_in_generate=True,"
    " output_logits=True)`."
)


def check_generate_called(calls: int, step_name: str) -> None:
    """A generating step's last-stage run must call ``self.generate(...)`` exactly once, as its first-stage run did."""
    if calls != 1:
        raise RuntimeError(
            f"BFPPStrategy: `{step_name}` calls `self.generate(...)` {calls} times on the last pipeline stage. The"
            " pipeline generates once per step, for the first call's prompts; generate for every prompt in one call"
            " (concatenate them along the batch dimension), with the same options."
        )


def check_model_called(calls: int, step_name: str) -> None:
    """The last stage's run of a step must call ``self(...)`` exactly once: its result is one micro-batch's output."""
    if calls == 0:
        raise RuntimeError(
            f"BFPPStrategy: `{step_name}` did not call `self(...)` on the last pipeline stage; its result must come"
            " from the pipeline's output, which `self(...)` returns."
        )
    if calls > 1:
        raise RuntimeError(
            f"BFPPStrategy: `{step_name}` calls `self(...)` {calls} times. The pipeline runs the model once per"
            " micro-batch, on the input of the first call, so every further call would silently return that same"
            " output. Call the model once per step (concatenate the inputs along the batch dimension and split"
            " the output), or move the extra forward into `pipeline_layers()`."
        )


class CollectiveInStepError(RuntimeError):
    """A collective was called from inside a pipelined step, where only some ranks run the user's code."""


def collective_refusal(what: str) -> CollectiveInStepError:
    return CollectiveInStepError(
        f"BFPPStrategy: {what} was called inside a step. Under the pipeline a step's code runs on the ranks that"
        " hold the first and last stages only, so a collective there would wait forever for the others."
        " Inside a step, log values with `self.log(...)` (every logged value is already reduced over"
        " data-parallel replicas with its `reduce_fx`, as `sync_dist=True` would); log a torchmetrics Metric"
        " object with `self.log(name, metric)` and let Lightning compute it at epoch end; move other"
        " collectives to a hook that runs on every rank (e.g. `on_train_batch_end`, `on_validation_epoch_end`)."
    )


@contextmanager
def metrics_refuse_sync(metrics: Sequence[Metric]) -> Iterator[None]:
    """Make a metric's cross-process sync inside a step (``compute()``, ``dist_sync_on_step=True``) raise at once.

    torchmetrics syncs through ``torch.distributed`` directly, on the ranks that run the step only; refusing
    at the call turns a certain hang into a message.
    """

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise collective_refusal("a torchmetrics Metric's sync (`compute()` or `dist_sync_on_step=True`)")

    saved = [metric.dist_sync_fn for metric in metrics]
    for metric in metrics:
        metric.dist_sync_fn = refuse
    try:
        yield
    finally:
        for metric, fn in zip(metrics, saved, strict=True):
            metric.dist_sync_fn = fn


@dataclass
class LoggedValue:
    """One ``self.log`` call: the value and the call's other arguments."""

    name: str
    value: torch.Tensor | Metric
    options: dict[str, Any]
    metric_step_value: torch.Tensor | None = None  # a metric's forward value when it was logged
    # a `mean_over_items` value: its summed loss and item count, combined as one sum over one count
    items: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class LogRecorder:
    """Records ``self.log`` / ``self.log_dict`` calls instead of passing them to Lightning."""

    records: list[LoggedValue] = field(default_factory=list)

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(_LOG_POSITIONAL):
            raise TypeError(f"`self.log` takes at most {2 + len(_LOG_POSITIONAL)} positional arguments")
        unknown = kwargs.keys() - _LOG_DEFAULTS.keys()
        if unknown:
            raise TypeError(f"`self.log` got an unexpected keyword argument {sorted(unknown)[0]!r}")
        options = {**_LOG_DEFAULTS, **dict(zip(_LOG_POSITIONAL, args, strict=False)), **kwargs}
        if isinstance(value, numbers.Number):
            value = torch.tensor(value, dtype=torch.float32)
        summed = item_sum(value)
        if summed is not None:
            items = (summed.total.detach().reshape(()), summed.count)
            self.records.append(LoggedValue(name, value.detach().reshape(()), options, items=items))
            return
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
        with instance_attributes(module, log=self.log):
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


class LightningStep:
    """A LightningModule's step methods as the pipeline's step code (:class:`lightning_bfpp.engine.pipeline.StepCode`):
    the first stage runs a step up to ``self(...)`` for the model's input, the last stage runs it whole with
    ``self(...)`` returning the pipeline's output and its ``self.log`` calls recorded, and its torchmetrics may
    not sync meanwhile. The engine sees only these calls, so it imports no Lightning."""

    def __init__(self, module: LightningModule) -> None:
        self.module = module
        # the module's torchmetrics: restored after input capture, and refused to sync inside a step
        self.metrics = [m for m in module.modules() if isinstance(m, Metric)]

    def capture(self, step_name: str, microbatch: Any, step_args: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict]:
        step = getattr(self.module, step_name)
        return capture_model_input(self.module, step, step_name, microbatch, *step_args, metrics=self.metrics)

    @property
    def can_generate(self) -> bool:
        """Whether the module has a ``generate`` method (``HFCausalLM``'s, or one of the module's own calling
        :func:`lightning_bfpp.generate`): its evaluation steps may call ``self.generate(...)`` instead of
        ``self(...)``."""
        return callable(getattr(self.module, "generate", None))

    def capture_generation(self, step_name: str, batch: Any, step_args: tuple[Any, ...]) -> GenerationCall | None:
        step = getattr(self.module, step_name)
        return capture_generation(self.module, step, step_name, batch, *step_args, metrics=self.metrics)

    def generate(self, call: GenerationCall, seed: int) -> Any:
        """The step's ``self.generate(...)`` call, run by every rank of the pipeline; sampling draws from ``seed``."""
        with sampling_seed(seed):
            return self.module.generate(*call.args, **call.kwargs)

    def finish_generated(
        self, step_name: str, batch: Any, step_args: tuple[Any, ...], output: Any, recorder: LogRecorder
    ) -> Any:
        """The step run whole on the last stage, its ``self.generate(...)`` returning ``output``."""
        with generate_returns(self.module, output) as calls, recorder.recording(self.module):
            step_output = getattr(self.module, step_name)(batch, *step_args)
        check_generate_called(calls(), step_name)
        return step_output

    def running(self) -> Any:
        return metrics_refuse_sync(self.metrics)

    def new_recorder(self) -> LogRecorder:
        return LogRecorder()

    def finish(
        self, step_name: str, microbatch: Any, step_args: tuple[Any, ...], output: Any, recorder: LogRecorder
    ) -> Any:
        with model_returns(self.module, output) as calls, recorder.recording(self.module):
            step_output = getattr(self.module, step_name)(microbatch, *step_args)
        check_model_called(calls(), step_name)
        return step_output

    def loss(self, step_output: Any, step_name: str) -> torch.Tensor:
        return step_loss(step_output, step_name)
