"""Single-process units of the Lightning integration: precision checks, recompute policy, predictions,
the atomic checkpoint swap."""

from collections import namedtuple

import pytest
import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import nn

from lightning_bfpp import BFPPStrategy
from lightning_bfpp.adapter.predictions import in_dataset_order, merge_microbatches
from lightning_bfpp.engine.checkpoint import _swap_in
from lightning_bfpp.engine.layers import Recompute, recompute_policy


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


Pair = namedtuple("Pair", ["logits", "ids"])


def test_merge_concatenates_per_sample_values_and_keeps_the_structure():
    # 3 micro-batches of 2 samples: a dict of tensors, per-sample strings, a nested tuple, a namedtuple
    parts = [
        {
            "y": torch.full((2, 3), float(i)),
            "names": [f"s{2 * i}", f"s{2 * i + 1}"],
            "pair": (torch.arange(2) + 2 * i, (torch.ones(2, 1) * i, [i, i])),
            "named": Pair(torch.zeros(2, 4), torch.tensor([2 * i, 2 * i + 1])),
        }
        for i in range(3)
    ]
    merged = merge_microbatches(parts, microbatch_size=2)
    assert torch.equal(merged["y"], torch.tensor([0.0, 0, 1, 1, 2, 2]).repeat_interleave(3).view(6, 3))
    assert merged["names"] == [f"s{i}" for i in range(6)]
    assert torch.equal(merged["pair"][0], torch.arange(6))
    assert merged["pair"][1][0].shape == (6, 1) and merged["pair"][1][1] == [0, 0, 1, 1, 2, 2]
    assert isinstance(merged["named"], Pair) and merged["named"].logits.shape == (6, 4)
    assert torch.equal(merged["named"].ids, torch.arange(6))


def test_merge_returns_a_batch_level_value_once_when_every_microbatch_has_it():
    parts = [{"p": torch.ones(2), "version": "v1", "scale": torch.tensor(0.5), "k": 3, "none": None} for _ in "ab"]
    merged = merge_microbatches(parts, microbatch_size=2)
    assert merged["version"] == "v1" and merged["k"] == 3 and merged["none"] is None
    assert merged["scale"].dim() == 0 and float(merged["scale"]) == 0.5  # one scalar per batch, as on one device
    assert torch.equal(merged["p"], torch.ones(4))
    # a tensor whose dim 0 is not the micro-batch's size (e.g. class prototypes) is batch-level too
    protos = torch.randn(5, 3)
    assert torch.equal(merge_microbatches([protos, protos.clone()], microbatch_size=2), protos)
    assert merge_microbatches([None, None], microbatch_size=2) is None
    assert merge_microbatches([torch.tensor(float("nan")), torch.tensor(float("nan"))], microbatch_size=2).isnan()


def test_merge_refuses_a_batch_level_value_that_differs_between_microbatches():
    remedy = r"with the batch as dim 0.*on_predict_epoch_end"
    with pytest.raises(ValueError, match=rf"a 0-d tensor at `output`.*2 micro-batches.*{remedy}"):
        merge_microbatches([torch.tensor(1.0), torch.tensor(2.0)], microbatch_size=4)
    # a list of per-batch fields (not one item per sample) must not become 2m items
    with pytest.raises(ValueError, match=r"a list of 3 items at `output\['stats'\]`"):
        merge_microbatches([{"stats": [1.0, 2.0, 3.0]}, {"stats": [1.5, 2.0, 3.0]}], microbatch_size=2)
    with pytest.raises(ValueError, match=r"a tensor of shape \(3,\) at `output.ids`"):
        merge_microbatches([Pair(torch.ones(2), torch.ones(3)), Pair(torch.ones(2), torch.zeros(3))], 2)
    with pytest.raises(ValueError, match=r"a float at `output\[1\]\[0\]`"):
        merge_microbatches([(torch.ones(2), (0.1,)), (torch.ones(2), (0.2,))], microbatch_size=2)
    with pytest.raises(ValueError, match=r"values of different types \(NoneType, Tensor\)"):
        merge_microbatches([torch.ones(3), None], microbatch_size=2)


def test_merge_of_one_microbatch_is_its_output():
    out = {"loss": torch.tensor(2.0), "stats": [1, 2, 3]}
    assert merge_microbatches([out], microbatch_size=8) is out


def test_in_dataset_order_interleaves_replicas_and_drops_padding():
    # DistributedSampler over 5 samples, 2 replicas, batch 2: replica 0 gets 0,2,4 ; replica 1 gets 1,3,0 (padded)
    rep0 = ([[0, 2], [4]], [torch.tensor([0.0, 2.0]), torch.tensor([4.0])])
    rep1 = ([[1, 3], [0]], [torch.tensor([1.0, 3.0]), torch.tensor([0.0])])
    ordered = in_dataset_order([rep0, rep1], batch_size=2)
    assert [b.tolist() for b in ordered] == [[0.0, 1.0], [2.0, 3.0], [4.0]]
    assert in_dataset_order([([[0, 1]], [torch.tensor(7.0)])], batch_size=2) is None  # no per-sample structure


def test_in_dataset_order_keeps_each_fields_structure():
    def out(indices):
        return {
            "y": torch.tensor(indices, dtype=torch.float),
            "names": [f"s{i}" for i in indices],
            "named": Pair(torch.tensor(indices).view(-1, 1), [torch.ones(i + 1) for i in indices]),
            "version": "v1",
        }

    rep0 = ([[0, 2], [4, 6]], [out([0, 2]), out([4, 6])])
    rep1 = ([[1, 3], [5, 7]], [out([1, 3]), out([5, 7])])
    ordered = in_dataset_order([rep0, rep1], batch_size=4)
    assert len(ordered) == 2
    for k, batch in enumerate(ordered):
        expected = out(list(range(4 * k, 4 * k + 4)))
        assert torch.equal(batch["y"], expected["y"]) and batch["names"] == expected["names"]
        assert isinstance(batch["named"], Pair) and torch.equal(batch["named"].logits, expected["named"].logits)
        assert isinstance(batch["named"].ids, list)  # a list of per-sample tensors stays a list
        assert [t.shape for t in batch["named"].ids] == [t.shape for t in expected["named"].ids]
        assert batch["version"] == "v1"
    # a batch-level value that differs between batches cannot be given to one device's batches
    rep1[1][1]["version"] = "v2"
    assert in_dataset_order([rep0, rep1], batch_size=4) is None


def test_swap_in_replaces_atomically(tmp_path):
    path, staging = tmp_path / "last.ckpt", tmp_path / "last.ckpt.tmp"
    path.mkdir()
    (path / "old").write_text("old")
    staging.mkdir()
    (staging / "new").write_text("new")
    _swap_in(staging, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert (path / "new").read_text() == "new"
