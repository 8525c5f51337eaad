"""The asynchronous saver on one process: the folder appears only when its write has finished, a callback's
removal of the previous checkpoint waits for the new one, one save at most is in flight, and a failed write is
raised at the next boundary with the previous checkpoint kept."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from lightning_bfpp.adapter.strategy_checkpoints import CheckpointMethods
from lightning_bfpp.engine.checkpoint import CheckpointError, is_sharded_checkpoint
from lightning_bfpp.engine.checkpoint.async_saving import AsyncSaver

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: no process group, saving as one process


@pytest.fixture
def held_writes(monkeypatch):
    """DCP's file writes wait until the test releases them (slow storage, under the test's control); ``reached``
    is set when a write has begun."""
    release, reached = threading.Event(), threading.Event()
    write_data = FileSystemWriter.write_data

    def held(writer, *args, **kwargs):
        reached.set()
        assert release.wait(30)
        return write_data(writer, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "write_data", held)
    return release, reached


def state(value: float) -> dict:
    return {"model": {"w": torch.full((4,), value)}}


def test_the_folder_appears_only_once_written_and_the_previous_is_removed_only_then(tmp_path, held_writes):
    saver = AsyncSaver(None, torch.device("cpu"))
    first, second = tmp_path / "step=1.ckpt", tmp_path / "step=2.ckpt"
    release, reached = held_writes
    release.set()
    saver.save(first, state(1.0), {"global_step": 1}, is_global_zero=True)
    saver.finish()
    assert is_sharded_checkpoint(first)

    release.clear()
    reached.clear()
    tensors = state(2.0)
    saver.save(second, tensors, {"global_step": 2}, is_global_zero=True)
    tensors["model"]["w"].fill_(-1.0)  # training goes on: the save holds its own copy
    removed = []
    assert saver.remove_after_commit(lambda: removed.append(first)) is True  # the callback's removal waits
    assert reached.wait(30)
    saver.at_step_boundary()  # not written yet: nothing changes
    assert not second.exists() and (tmp_path / "step=2.ckpt.tmp").exists() and not removed
    release.set()
    saver.finish()
    assert is_sharded_checkpoint(second) and removed == [first]
    assert torch.load(second / "meta.pt", weights_only=True)["global_step"] == 2
    assert not (tmp_path / "step=2.ckpt.tmp").exists()
    assert saver.remove_after_commit(lambda: None) is False  # nothing in flight: remove at once


def test_a_failed_write_is_raised_at_the_boundary_and_the_previous_checkpoint_stays(tmp_path, monkeypatch):
    saver = AsyncSaver(None, torch.device("cpu"))
    path = tmp_path / "last.ckpt"
    saver.save(path, state(1.0), {"global_step": 1}, is_global_zero=True)
    saver.finish()

    def full(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    saver.save(path, state(2.0), {"global_step": 2}, is_global_zero=True)
    removed = []
    saver.remove_after_commit(lambda: removed.append(path))
    saver.in_flight.settled.wait(30)
    with pytest.raises(CheckpointError, match=rf"could not save the checkpoint {path}; the previous one there is"):
        saver.at_step_boundary()
    assert saver.in_flight is None and not removed  # a failed save removes nothing
    assert torch.load(path / "meta.pt", weights_only=True)["global_step"] == 1
    assert not (tmp_path / "last.ckpt.tmp").exists()


def test_async_checkpoint_must_be_a_bool():
    from lightning_bfpp import BFPPStrategy

    with pytest.raises(ValueError, match="`async_checkpoint` must be True or False, got 'yes'"):
        BFPPStrategy(async_checkpoint="yes")
    assert issubclass(BFPPStrategy, CheckpointMethods)
