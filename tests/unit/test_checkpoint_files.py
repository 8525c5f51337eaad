"""The checkpoint engine's file handling and decisions, in one process (the multi-process behaviour is in
tests/distributed/test_resume.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME

from lightning_bfpp.engine import checkpoint as checkpoint_io
from lightning_bfpp.engine.agreement import raise_shared
from lightning_bfpp.engine.checkpoint import (
    METADATA_FILENAME,
    CheckpointError,
    _swap_in,
    check_full,
    check_sharded,
    raise_on_every_rank,
    replica_loader_states,
    resolve_path,
)


def test_metadata_file_name_is_lightnings():
    assert METADATA_FILENAME == _METADATA_FILENAME  # its consolidate tool reads it


def _folder(path, content):
    path.mkdir()
    (path / METADATA_FILENAME).write_text(content)
    return path


def test_swap_keeps_the_only_complete_checkpoint_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    # a swap killed between its renames left only last.ckpt.old; the next save must not delete it first
    path, old, staging = tmp_path / "last.ckpt", tmp_path / "last.ckpt.old", tmp_path / "last.ckpt.tmp"
    _folder(old, "step 3")
    _folder(staging, "step 5")
    seen = []
    rename = type(staging).rename

    def watched(source, target):
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        return rename(source, target)

    monkeypatch.setattr(type(staging), "rename", watched)
    _swap_in(staging, path)
    assert seen == [["last.ckpt.old", "last.ckpt.tmp"]]  # .old still there when the new one moves in
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert (path / METADATA_FILENAME).read_text() == "step 5"


def test_loading_falls_back_to_the_old_checkpoint_only_when_the_path_is_gone(tmp_path):
    path = tmp_path / "last.ckpt"
    with pytest.raises(CheckpointError, match=r"last.ckpt: it does not exist \(nor last.ckpt.old beside it\)"):
        resolve_path(path)
    old = _folder(tmp_path / "last.ckpt.old", "step 3")
    resolved, warning = resolve_path(path)
    assert resolved == old and "interrupted between its two renames" in warning and str(old) in warning
    _folder(path, "step 4")
    assert resolve_path(path) == (path, None)


def test_each_replica_gets_its_own_loader_state_or_none_with_a_warning():
    stored = {"data_parallel_size": 2, "states": [["replica 0"], ["replica 1"]]}
    assert replica_loader_states(stored, ["replica 0"], data_parallel_rank=1, data_parallel_size=2) == (
        ["replica 1"],
        None,
    )
    states, warning = replica_loader_states(stored, ["replica 0"], data_parallel_rank=0, data_parallel_size=4)
    assert states is None
    assert "data_parallel_size=2" in warning and "this run has data_parallel_size=4" in warning
    assert "starts over from its beginning" in warning
    # one process's state (a single-device file): kept for one replica, not guessed for several
    assert replica_loader_states(None, ["one"], data_parallel_rank=0, data_parallel_size=1) == (["one"], None)
    states, warning = replica_loader_states(None, ["one"], data_parallel_rank=0, data_parallel_size=2)
    assert states is None and "a single-file checkpoint" in warning
    assert replica_loader_states(stored, [], data_parallel_rank=0, data_parallel_size=4) == (None, None)


def test_an_error_becomes_a_checkpoint_error_naming_what_failed():
    raise_on_every_rank(None, "saving")
    with pytest.raises(CheckpointError, match=r"^saving: OSError: disk full$"):
        raise_on_every_rank(OSError("disk full"), "saving")
    with pytest.raises(CheckpointError, match=r"^as it was$"):
        raise_on_every_rank(CheckpointError("as it was"), "saving")


def test_every_rank_builds_the_same_message_from_what_the_ranks_shared():
    # what all_gather_object hands every rank: the failing rank's context and error, None for the others
    only_rank_0 = [("writing meta.pt", "OSError: disk full"), None, None]
    with pytest.raises(CheckpointError, match=r"^writing meta.pt: rank 0 failed: OSError: disk full$"):
        raise_shared(only_rank_0, None, CheckpointError)
    two = [None, ("reading", "OSError: a"), ("reading", "OSError: b")]
    with pytest.raises(CheckpointError, match=r"^reading: rank 1 failed \(and on rank 2\): OSError: a$"):
        raise_shared(two, None, CheckpointError)
    everywhere = [(None, "BFPPStrategy cannot load x: it lacks y")] * 3  # a check every rank made alike
    with pytest.raises(CheckpointError, match=r"^BFPPStrategy cannot load x: it lacks y$"):
        raise_shared(everywhere, None, CheckpointError)
    raise_shared([None, None], None, CheckpointError)


def test_a_single_file_from_another_model_is_refused_with_names_and_shapes(tmp_path):
    expected = {"a.weight": (3, 4), "a.bias": (3,), "b.weight": (2, 2)}
    stored = {"a.weight": torch.zeros(3, 5), "a.bias": torch.zeros(3), "c.weight": torch.zeros(1)}
    with pytest.raises(CheckpointError) as error:
        check_full(tmp_path / "x.ckpt", stored, expected, strict=True)
    message = str(error.value)
    assert "it lacks the module's b.weight" in message
    assert "it holds c.weight, which the module does not have" in message
    assert "shapes differ (checkpoint vs module): a.weight [3, 5] vs [3, 4]" in message
    with pytest.raises(CheckpointError, match="shapes differ") as error:
        check_full(tmp_path / "x.ckpt", stored, expected, strict=False)  # names may differ, shapes may not
    assert "lacks" not in str(error.value)


def test_an_incomplete_folder_is_refused_before_reading_it(tmp_path):
    path = tmp_path / "ckpt"
    dcp.save({"model": {"w": torch.arange(4096.0)}}, checkpoint_id=path, no_dist=True)
    torch.save({"global_step": 1}, path / METADATA_FILENAME)
    expected = {"w": (4096,)}
    check_sharded(path, expected, strict=True)
    with pytest.raises(CheckpointError, match=r"shapes differ \(checkpoint vs module\): w \[4096\] vs \[8\]"):
        check_sharded(path, {"w": (8,)}, strict=True)
    data_file = next(path.glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"cut short: {data_file.name} \(100 of at least \d+ bytes\)"):
        check_sharded(path, expected, strict=True)
    data_file.unlink()
    (path / METADATA_FILENAME).unlink()
    with pytest.raises(CheckpointError, match=rf"{METADATA_FILENAME} .* is missing; data files missing: "):
        check_sharded(path, expected, strict=True)
    (path / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"`.metadata` is unreadable"):
        check_sharded(path, expected, strict=True)
    (path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"not a torch\.distributed\.checkpoint folder"):
        check_sharded(path, expected, strict=True)
    assert checkpoint_io.LOADER_STATES_KEY == "bfpp_loader_states"


def test_a_one_device_optimizer_over_the_trained_parameters_maps_to_their_names():
    """LoRA's and frozen layers' usual optimizer covers the parameters that train: its positions are theirs."""
    from lightning_bfpp.engine.checkpoint import load_full_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    model[0].weight.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    saved_optimizer = torch.optim.AdamW(trained, lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    saved_optimizer.step()
    saved = saved_optimizer.state_dict()
    names = [n for n, _ in model.named_parameters()]
    trained_names = [n for n, p in model.named_parameters() if p.requires_grad]

    model.zero_grad(set_to_none=True)  # as at the start of a resumed fit
    fresh = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    load_full_optimizer(model, fresh, saved, names, trained_parameter_names=trained_names)
    for p, q in zip(trained, [p for p in model.parameters() if p.requires_grad], strict=True):
        assert torch.equal(fresh.state[q]["exp_avg"], saved_optimizer.state[p]["exp_avg"])
    with pytest.raises(RuntimeError, match=r"covers 3 parameters, the model has 4 \(2 that train\)"):
        load_full_optimizer(model, fresh, saved, names, trained_parameter_names=trained_names[:2])
