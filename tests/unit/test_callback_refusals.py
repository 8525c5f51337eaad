"""The callbacks and Trainer options refused up front (guards.check_callbacks, check_layer_sync), the Lightning
private names read for the ones that work (ThroughputMonitor's), and an optimizer saved before its first step."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    BatchSizeFinder,
    EMAWeightAveraging,
    ModelCheckpoint,
    ModelPruning,
    StochasticWeightAveraging,
    ThroughputMonitor,
)
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_bfpp.adapter import _lightning_compat as lc
from lightning_bfpp.adapter import guards
from lightning_bfpp.engine.checkpoint import optimizer_state


@pytest.mark.parametrize(
    ("callback", "named", "instead"),
    [
        (StochasticWeightAveraging(swa_lrs=1e-2), "StochasticWeightAveraging", "`EMAWeightAveraging`"),
        (BackboneFinetuning(), "BackboneFinetuning (a BaseFinetuning callback)", "load_pretrained"),
        (ModelPruning("l1_unstructured"), "ModelPruning", "Prune after training"),
        (BatchSizeFinder(), "BatchSizeFinder", "memory_budget"),
    ],
)
def test_refused_callbacks_are_named_with_what_to_use_instead(callback, named, instead):
    with pytest.raises(RuntimeError, match="cannot run") as raised:
        guards.check_callbacks([ModelCheckpoint(), callback])
    assert named in str(raised.value) and instead in str(raised.value)


def test_callbacks_that_work_pass():
    guards.check_callbacks([ModelCheckpoint(), EMAWeightAveraging(), ThroughputMonitor(batch_size_fn=len)])


def test_sync_batchnorm_is_refused():
    strategy = DDPStrategy()
    assert lc.layer_sync(strategy) is None  # Lightning's private `_layer_sync`, None without sync_batchnorm
    guards.check_layer_sync(lc.layer_sync(strategy))
    from lightning.pytorch.plugins import TorchSyncBatchNorm

    strategy._layer_sync = TorchSyncBatchNorm()
    with pytest.raises(ValueError, match=r"`Trainer\(sync_batchnorm=True\)`"):
        guards.check_layer_sync(lc.layer_sync(strategy))


def test_throughput_counts_replicas_not_processes():
    monitor = ThroughputMonitor(batch_size_fn=len)
    assert monitor._throughputs == {}  # Lightning's private dict of the Throughput objects its `setup` builds
    monitor._throughputs["train"] = Throughput(world_size=4, window_size=2)
    lc.count_replicas_in_throughput([monitor], 2)
    throughput = monitor._throughputs["train"]
    assert throughput.world_size == 2
    throughput.update(time=1.0, batches=1, samples=8)
    throughput.update(time=2.0, batches=2, samples=16)
    metrics = throughput.compute()
    assert metrics["samples_per_sec"] == 2 * metrics["device/samples_per_sec"] == 16.0


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_an_optimizer_saved_before_its_first_step_stays_stateless(kind):
    """torch's `get_optimizer_state_dict` would fill it with a zero-gradient step (SGD momentum from weight decay,
    Adam's step 1); one device saves no state then, and neither do we (nor leave any in the optimizer)."""
    module = nn.Linear(3, 2)
    if kind == "sgd":
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    else:
        optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    saved = optimizer_state(module, optimizer)
    assert saved and all(key.startswith("param_groups.") for key in saved)
    assert not optimizer.state
    module(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    assert any(key.startswith("state.") for key in optimizer_state(module, optimizer))


def test_checkpoint_io_plugins_are_refused():
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    guards.check_checkpoint_io(TorchCheckpointIO())
    with pytest.raises(ValueError, match="does not use CheckpointIO plugins, got AsyncCheckpointIO"):
        guards.check_checkpoint_io(AsyncCheckpointIO())


def test_both_summary_callbacks_print_the_whole_model():
    """`ModelSummary` and `RichModelSummary` get the whole-model summary the strategy takes before the split
    (Lightning's private `_summary`, replaced by `summarize_with`)."""
    from lightning.pytorch.callbacks import ModelSummary, RichModelSummary

    whole = object()
    callbacks = [ModelSummary(), RichModelSummary(), ModelCheckpoint()]
    lc.summarize_with(callbacks, whole)
    assert [c._summary(None, None) for c in callbacks[:2]] == [whole, whole]


def test_manual_optimization_is_refused_at_setup():
    class Manual:
        automatic_optimization = False

    with pytest.raises(
        RuntimeError, match=r"needs automatic optimization; remove `self\.automatic_optimization = False`"
    ):
        guards.check_optimization(Manual())
    guards.check_optimization(type("Automatic", (), {"automatic_optimization": True})())
