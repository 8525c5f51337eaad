"""Single-process units of the Lightning integration: precision checks, recompute policy, predictions,
the atomic checkpoint swap."""

import pytest
import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import nn

from lightning_bfpp import BFPPStrategy
from lightning_bfpp.checkpoint import _swap_in
from lightning_bfpp.layers import Recompute, recompute_policy
from lightning_bfpp.predictions import in_dataset_order, merge_microbatches


def test_precision_plugins():
    strategy = BFPPStrategy()
    for plugin in (Precision(), MixedPrecision("bf16-mixed", "cpu"), HalfPrecision("bf16-true")):
        strategy.precision_plugin = plugin
    with pytest.raises(ValueError, match=r"does not support `precision='16-mixed'`.*bf16-mixed"):
        strategy.precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


def test_recompute_policy_and_wrapper():
    assert recompute_policy(True)(nn.Linear(1, 1)) and not recompute_policy(False)(nn.Linear(1, 1))
    policy = recompute_policy((nn.Linear, nn.Conv1d))
    assert policy(nn.Linear(1, 1)) and not policy(nn.ReLU())
    assert recompute_policy(lambda layer: isinstance(layer, nn.ReLU))(nn.ReLU())
    with pytest.raises(TypeError, match="activation_checkpointing"):
        recompute_policy("yes")
    layer = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    wrapped = Recompute(layer)
    torch.testing.assert_close(wrapped(x), layer(x))
    wrapped(x).sum().backward()
    assert layer.weight.grad is not None


def test_merge_microbatches_keeps_the_structure():
    parts = [{"y": torch.ones(2, 3), "ids": [1, 2], "pair": (torch.zeros(2), torch.tensor(1.0))} for _ in range(3)]
    merged = merge_microbatches(parts)
    assert merged["y"].shape == (6, 3) and merged["ids"] == [1, 2] * 3
    assert merged["pair"][0].shape == (6,) and merged["pair"][1].shape == (3,)


def test_in_dataset_order_interleaves_replicas_and_drops_padding():
    # DistributedSampler over 5 samples, 2 replicas, batch 2: replica 0 gets 0,2,4 ; replica 1 gets 1,3,0 (padded)
    rep0 = ([[0, 2], [4]], [torch.tensor([0.0, 2.0]), torch.tensor([4.0])])
    rep1 = ([[1, 3], [0]], [torch.tensor([1.0, 3.0]), torch.tensor([0.0])])
    ordered = in_dataset_order([rep0, rep1], batch_size=2)
    assert [b.tolist() for b in ordered] == [[0.0, 1.0], [2.0, 3.0], [4.0]]
    assert in_dataset_order([([[0, 1]], [torch.tensor(7.0)])], batch_size=2) is None  # no per-sample structure


def test_swap_in_replaces_atomically(tmp_path):
    path, staging = tmp_path / "last.ckpt", tmp_path / "last.ckpt.tmp"
    path.mkdir()
    (path / "old").write_text("old")
    staging.mkdir()
    (staging / "new").write_text("new")
    _swap_in(staging, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert (path / "new").read_text() == "new"
