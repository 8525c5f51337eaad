"""What ``lightning_bfpp.engine.pretrained`` reads of a safetensors file: a tensor's own bytes, and of a
tensor-parallel part split by rows only those rows (no process group needed: the part is given)."""

from __future__ import annotations

import pytest
import torch

from lightning_bfpp.engine import pretrained
from lightning_bfpp.engine.pretrained import PretrainedWeights, safetensors_header, write_safetensors


@pytest.fixture
def stored(tmp_path):
    torch.manual_seed(0)
    tensors = {"a": torch.randn(10, 4), "b": torch.randn(3).to(torch.bfloat16), "c": torch.randn(6, 8)}
    file = tmp_path / "w.safetensors"
    write_safetensors(file, {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}, [tensors])
    return file, tensors


def test_the_written_file_is_a_safetensors_file(stored):
    from safetensors.torch import load_file

    file, tensors = stored
    loaded = load_file(file)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[n], tensors[n]) for n in tensors)


def test_each_tensor_is_read_by_its_own_bytes_and_converted(stored):
    file, tensors = stored
    targets = {"a": torch.empty(10, 4), "b": torch.empty(3)}  # b stored in bf16, kept in fp32
    read = PretrainedWeights(file).fill(targets)
    assert read == 10 * 4 * 4 + 3 * 2  # a's and b's bytes, not c's
    assert torch.equal(targets["a"], tensors["a"]) and torch.equal(targets["b"], tensors["b"].float())


@pytest.mark.parametrize(("dim", "start", "length"), [(0, 4, 3), (1, 2, 2)])
def test_a_tensor_parallel_part_reads_its_own_bytes_only(stored, monkeypatch, dim, start, length):
    """Split by rows (dimension 0) a part is a contiguous run of the file; split by columns, one run per row: only
    its own bytes are read either way."""
    file, tensors = stored
    shape = [10, 4]
    shape[dim] = length
    local = torch.empty(shape)
    monkeypatch.setattr(pretrained, "_part_of", lambda target: (local, dim, start, length))
    with open(file, "rb") as handle:
        read = pretrained._read_part(handle, safetensors_header(file)["a"], torch.empty(10, 4))
    assert torch.equal(local, tensors["a"].narrow(dim, start, length))
    assert read == local.numel() * 4
