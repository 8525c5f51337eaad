"""Layers whose statistics depend on how a batch is cut into forward calls: found, explained, or refused."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_bfpp.engine.layers import batch_statistics_layers, check_no_collective_layers
from lightning_bfpp.engine.runners import get_runner


class Custom(nn.BatchNorm1d):
    """A user's subclass of a public batch-norm class."""


def layers() -> list[tuple[str, nn.Module]]:
    return [
        ("embed", nn.Linear(4, 4)),
        ("blocks.0", nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))),
        ("blocks.1", nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2, track_running_stats=False))),
        ("blocks.2", nn.Sequential(nn.InstanceNorm1d(4, track_running_stats=True), nn.InstanceNorm2d(4))),
        ("blocks.3", nn.Sequential(nn.LayerNorm(4), nn.GroupNorm(2, 4), nn.LazyBatchNorm3d())),
        ("head", Custom(4)),
    ]


def test_batch_and_instance_norms_with_running_statistics_are_found():
    found = batch_statistics_layers(layers())
    assert found == [
        ("blocks.0.1", "BatchNorm1d"),
        ("blocks.1.1", "BatchNorm2d"),  # no running statistics, but normalised by the micro-batch's
        ("blocks.2.0", "InstanceNorm1d"),  # per sample, but its running statistics are updated per call
        ("blocks.3.2", "LazyBatchNorm3d"),
        ("head", "Custom"),
    ]
    assert batch_statistics_layers([("blocks.0", nn.Sequential(nn.LayerNorm(4), nn.InstanceNorm1d(4)))]) == []


def test_the_warning_says_what_differs_and_what_to_use_instead():
    found = batch_statistics_layers(layers())
    text = get_runner("stages").statistics_warning(found, 4, 1)
    assert text is not None
    assert "`blocks.0.1` (BatchNorm1d), `blocks.1.1` (BatchNorm2d), `blocks.2.0` (InstanceNorm1d) and 2 more" in text
    assert "num_microbatches=4 per replica" in text and "not the whole batch's" in text
    assert "once per micro-batch" in text
    for alternative in ("LayerNorm or GroupNorm", "num_microbatches=1", "SyncBatchNorm is not supported"):
        assert alternative in text
    assert "replica keeps its own running statistics" not in text and "chunk owner" not in text
    replicas = get_runner("stages").statistics_warning(found, 1, 2)
    assert replicas is not None and "replica keeps its own running statistics" in replicas
    assert "one micro-batch" not in replicas
    owners = get_runner("weight_passing").statistics_warning(found, 2, 4)
    assert owners is not None and "chunk owner's" in owners and "keeps its own" not in owners


def test_no_warning_where_nothing_differs_from_ddp():
    found = batch_statistics_layers(layers())
    assert get_runner("stages").statistics_warning(found, 1, 1) is None  # the whole batch, one copy
    assert get_runner("weight_passing").statistics_warning(found, 1, 4) is None  # per replica, one owner's
    assert get_runner("stages").statistics_warning([], 8, 4) is None


def test_sync_batch_norm_is_refused():
    check_no_collective_layers(layers())
    with pytest.raises(ValueError, match=r"`blocks.0.1` is a SyncBatchNorm.*cannot run inside a pipeline"):
        check_no_collective_layers([("blocks.0", nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4)))])
