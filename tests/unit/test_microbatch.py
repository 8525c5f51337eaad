"""Splitting batches of any structure into micro-batches."""

import pytest
import torch

from lightning_bfpp.engine.microbatch import batch_signature, split_microbatches


def test_tuple_batch():
    x, y = torch.arange(12).reshape(6, 2), torch.arange(6)
    parts = split_microbatches((x, y), 3)
    assert len(parts) == 3 and isinstance(parts[0], tuple)
    assert torch.equal(parts[1][0], x[2:4]) and torch.equal(parts[2][1], y[4:6])


def test_dict_nested_and_non_tensor_leaves():
    batch = {"ids": torch.zeros(4, 5), "meta": {"mask": torch.ones(4, 5)}, "name": "x", "scale": torch.tensor(2.0)}
    parts = split_microbatches(batch, 2)
    assert parts[0]["ids"].shape == (2, 5) and parts[1]["meta"]["mask"].shape == (2, 5)
    assert parts[0]["name"] == "x" and parts[1]["scale"].item() == 2.0


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="cannot be split into num_microbatches=4"):
        split_microbatches(torch.zeros(6, 2), 4)
    with pytest.raises(ValueError, match="disagree on their first"):
        split_microbatches((torch.zeros(6), torch.zeros(4)), 2)
    with pytest.raises(ValueError, match="no tensor"):
        split_microbatches({"a": 1}, 2)


def test_signature_changes_with_shape_only():
    a = batch_signature((torch.zeros(4, 3), torch.zeros(4)))
    assert a == batch_signature((torch.ones(4, 3), torch.ones(4)))
    assert a != batch_signature((torch.zeros(2, 3), torch.zeros(2)))


def test_microbatch_count_refuses_full_batches_it_cannot_split_and_names_the_choices():
    from lightning_bfpp.engine.microbatch import microbatch_count

    assert microbatch_count(8, 4) == 4
    assert microbatch_count(6, 4, last_batch=True) == 3
    assert microbatch_count(3, 4, last_batch=True) == 3
    assert microbatch_count(5, 4, last_batch=True) == 1
    with pytest.raises(
        ValueError,
        match=r"a batch of 6 samples cannot be split into num_microbatches=4 .*\(e\.g\. 4, 8\).*one of \[1, 2, 3, 6\]",
    ):
        microbatch_count(6, 4)
    with pytest.raises(ValueError, match="a batch of 2 samples is smaller than num_microbatches=4"):
        microbatch_count(2, 4)


def test_per_sample_lists_are_cut_with_the_samples():
    batch = {"x": torch.arange(8), "text": [f"s{i}" for i in range(8)], "tag": "all", "pair": ["a", "b"]}
    parts = split_microbatches(batch, 4)
    assert [p["text"] for p in parts] == [["s0", "s1"], ["s2", "s3"], ["s4", "s5"], ["s6", "s7"]]
    assert all(p["tag"] == "all" and p["pair"] == ["a", "b"] for p in parts)
