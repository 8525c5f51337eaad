"""The checkpoint engine's file handling and decisions, in one process (the multi-process behaviour is in
tests/distributed/test_resume.py)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.callbacks import ModelCheckpoint

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
    with pytest.raises(CheckpointError, match=r"cannot read its `.metadata`"):
        check_sharded(path, expected, strict=True)
    (path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r": it is an empty folder, not a checkpoint .* a one-device checkpoint"):
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


# -- loading runs no code from the checkpoint -------------------------------------------------------


def _touch(marker: str) -> dict:
    """What a hostile pickle calls: leaves ``marker`` behind, so a test sees whether loading ran it."""
    Path(marker).write_text("code from the checkpoint ran\n")
    return {}


class _Payload:
    """Unpickles by calling :func:`_touch` (any function a pickle names is called the same way, ``os.system`` too)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (_touch, (self.marker,))


TOUCH = f"{__name__}._touch"


def test_weights_only_resolves_as_torch_load_does(monkeypatch):
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", raising=False)
    assert [checkpoint_io.resolve_weights_only(w) for w in (None, True, False)] == [True, True, False]
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # only where the caller left it unset
    assert [checkpoint_io.resolve_weights_only(w) for w in (None, True, False)] == [False, True, False]
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "true")  # even over an explicit False
    assert [checkpoint_io.resolve_weights_only(w) for w in (None, True, False)] == [True, True, True]


def _fit(dirpath: Path, steps: int, ckpt_path: Path | None = None, **fit_kwargs) -> L.Trainer:
    """The suite's module on one process under BFPPStrategy (p=1, v=2), saving ``last.ckpt`` every step."""
    from lightning_bfpp import BFPPStrategy
    from tests.models import RunSpec, make_dataset, make_model

    run = RunSpec(name="one", model={"optimizer": "adamw", "scheduler": "step"}, data={"num_samples": 16})
    strategy = BFPPStrategy(pipeline_parallel_size=1, stages_per_rank=2, num_microbatches=2)
    saving = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=0, save_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, callbacks=[saving],
                        logger=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    loader = torch.utils.data.DataLoader(make_dataset(run), batch_size=8)
    trainer.fit(make_model(run), loader, ckpt_path=ckpt_path, **fit_kwargs)
    return trainer


@pytest.fixture
def one_process_group():
    """The strategy's one-process group, destroyed afterwards: later tests of this process build their own."""
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_resuming_through_fit_runs_no_code_from_the_checkpoint_unless_told_to(tmp_path, monkeypatch, one_process_group):
    """The path `trainer.fit(ckpt_path=...)` takes, on one process: a `meta.pt` that would run code on unpickling
    is refused, naming what it holds and the fix, and nothing runs; trusting the file is the caller's choice.
    (Lightning 2.6 hands `fit`'s `weights_only` to the strategy only when it restores before setup, so under
    `fit` that choice is torch's switch for the default, `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`.)"""
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", raising=False)
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)
    _fit(tmp_path / "ckpts", steps=1)
    last = tmp_path / "ckpts" / "last.ckpt"
    meta = last / METADATA_FILENAME
    # what BFPPStrategy stores itself loads with weights_only=True: nothing in it names a function or class
    assert torch.serialization.get_unsafe_globals_in_checkpoint(meta) == []
    stored = torch.load(meta, weights_only=True)
    assert stored["global_step"] == 1 and stored["hyper_parameters"]["optimizer"] == "adamw"
    marker = tmp_path / "ran"
    stored["hyper_parameters"]["note"] = _Payload(marker)
    torch.save(stored, meta)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(meta) == [TOUCH]

    with pytest.raises(CheckpointError) as refused:
        _fit(tmp_path / "resumed", steps=2, ckpt_path=last)  # weights_only not given: Lightning passes None
    message = str(refused.value)
    assert f"{meta} with `weights_only=True`" in message and f"it holds `{TOUCH}`" in message, message
    assert "unpickling that could run code" in message and "`weights_only=False`" in message
    assert "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1" in message and "add_safe_globals" in message
    assert not marker.exists()

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # the caller trusts it
    trainer = _fit(tmp_path / "resumed", steps=2, ckpt_path=last)
    assert marker.exists() and trainer.global_step == 2


def _module_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    module(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return module, optimizer


def _save_folder(path: Path, module, optimizer, **replace) -> Path:
    """A BFPPStrategy folder of one process (what `save` writes), entries of ``optimizer_0`` replaced."""
    state = {
        "model": checkpoint_io.model_state(module),
        "optimizer_0": checkpoint_io.optimizer_state(module, optimizer),
    }
    state["optimizer_0"].update(replace)
    dcp.save(state, checkpoint_id=path, no_dist=True)
    torch.save({"global_step": 1}, path / METADATA_FILENAME)
    return path


def _load(path: Path, module, optimizer=None, weights_only=None):
    names = [n for n, _ in module.named_parameters()]
    return checkpoint_io.load(path, module, [optimizer] if optimizer else [], strict=True, weights_only=weights_only,
                              full_parameter_names=names)  # fmt: skip


def test_dcp_files_run_no_code_either(tmp_path):
    """DCP itself unpickles `.metadata` in full and its non-tensor entries (an optimizer's `lr`) with
    weights_only=False; loading checks both first, unless the caller passes weights_only=False."""
    module, optimizer = _module_and_optimizer()
    good = _save_folder(tmp_path / "good.ckpt", module, optimizer)
    assert _load(good, module, optimizer) == ({"global_step": 1}, None)  # the index and entries DCP writes pass
    assert checkpoint_io.read_whole(good)["model"]["weight"].shape == (2, 3)

    marker = tmp_path / "ran"
    hostile_entry = _save_folder(
        tmp_path / "entry.ckpt", module, optimizer, **{"param_groups.weight.lr": _Payload(marker)}
    )
    for read in (lambda: _load(hostile_entry, module, optimizer), lambda: checkpoint_io.read_whole(hostile_entry)):
        with pytest.raises(CheckpointError) as refused:
            read()
        assert "entry optimizer_0.param_groups.weight.lr of the checkpoint with `weights_only=True`" in str(
            refused.value
        )
        assert f"it holds `{TOUCH}`" in str(refused.value)
        assert not marker.exists()

    hostile_index = _save_folder(tmp_path / "index.ckpt", module, optimizer)
    (hostile_index / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    for read in (lambda: _load(hostile_index, module, optimizer), lambda: checkpoint_io.read_whole(hostile_index)):
        with pytest.raises(CheckpointError) as refused:
            read()
        assert f"its `.metadata` names `{TOUCH}`, which is not a type torch.distributed.checkpoint" in str(
            refused.value
        )
        assert not marker.exists()
    with pytest.raises(CheckpointError, match=r"cannot read its `\.metadata`"):  # the caller's choice: it runs
        _load(hostile_index, module, optimizer, weights_only=False)
    assert marker.exists()


def test_a_one_device_file_runs_no_code_either(tmp_path):
    module, _ = _module_and_optimizer()
    marker = tmp_path / "ran"
    file = tmp_path / "one_device.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": {"x": _Payload(marker)}}, file)
    with pytest.raises(CheckpointError, match=rf"{file} with `weights_only=True` .* it holds `{TOUCH}`"):
        _load(file, module)
    assert not marker.exists()
    loaded, _ = _load(file, module, weights_only=False)
    assert marker.exists() and loaded["hyper_parameters"] == {"x": {}}


# -- truncated, empty and foreign checkpoints ------------------------------------------------------


def _message(path: Path, module, optimizer=None) -> str:
    with pytest.raises(CheckpointError) as refused:
        _load(path, module, optimizer)
    return str(refused.value)


def test_empty_truncated_and_foreign_folders_are_named_for_what_they_are(tmp_path):
    module, optimizer = _module_and_optimizer()
    expected = (
        "BFPPStrategy loads a folder it wrote itself (`trainer.save_checkpoint`, `ModelCheckpoint`) or a one-device"
    )
    (tmp_path / "empty.ckpt").mkdir()
    message = _message(tmp_path / "empty.ckpt", module)
    assert "it is an empty folder, not a checkpoint" in message and expected in message

    no_index = _save_folder(tmp_path / "no_index.ckpt", module, optimizer)
    (no_index / ".metadata").unlink()
    assert "data files but no `.metadata`, which DCP writes after every rank's data" in _message(no_index, module)

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    message = _message(hf, module)
    assert (
        "no `.metadata`, so it is not a torch.distributed.checkpoint folder; it holds config.json, model.safetensors"
        in message
    )
    assert expected in message

    cut = _save_folder(tmp_path / "cut.ckpt", module, optimizer)
    (cut / ".metadata").write_bytes((cut / ".metadata").read_bytes()[:40])
    assert "cannot read its `.metadata`" in _message(cut, module)

    for size in (0, 100):
        meta_cut = _save_folder(tmp_path / f"meta_cut_{size}.ckpt", module, optimizer)
        (meta_cut / METADATA_FILENAME).write_bytes((meta_cut / METADATA_FILENAME).read_bytes()[:size])
        message = _message(meta_cut, module, optimizer)
        assert f"its {METADATA_FILENAME} is unreadable" in message and "truncated or corrupt" in message, message

    # Lightning's ModelParallelStrategy: the same meta.pt, the weights under "state_dict" (its save_checkpoint)
    lightning = tmp_path / "model_parallel.ckpt"
    dcp.save(
        {"state_dict": module.state_dict(), "optimizer_0": optimizer.state_dict()},
        checkpoint_id=lightning,
        no_dist=True,
    )
    torch.save({"global_step": 1}, lightning / _METADATA_FILENAME)
    message = _message(lightning, module, optimizer)
    assert "its weights are under `state_dict`, not `model`: the layout of Lightning's ModelParallelStrategy" in message
    assert expected in message

    # Lightning's FSDPStrategy: "model" as here, but torch's optimizer layout (parameter groups by position)
    fsdp = tmp_path / "fsdp.ckpt"
    by_position = optimizer.state_dict()
    fsdp_optimizer = {"state": {"weight": by_position["state"][0], "bias": by_position["state"][1]},
                      "param_groups": [{**by_position["param_groups"][0], "params": ["weight", "bias"]}]}  # fmt: skip
    dcp.save({"model": module.state_dict(), "optimizer_0": fsdp_optimizer}, checkpoint_id=fsdp, no_dist=True)
    torch.save({"global_step": 1}, fsdp / _METADATA_FILENAME)
    message = _message(fsdp, module, optimizer)
    assert "`optimizer_0` keys its parameter groups by position (`param_groups.0.params`)" in message
    assert "the layout of Lightning's FSDPStrategy" in message
    assert _load(fsdp, module) == ({"global_step": 1}, None)  # its weights alone load

    other = tmp_path / "other.ckpt"
    dcp.save({"app": {"w": torch.zeros(2)}}, checkpoint_id=other, no_dist=True)
    assert "it holds app and no `model` entry, so it was not written by BFPPStrategy" in _message(other, module)


def test_files_that_are_no_lightning_checkpoint_are_named_for_what_they_are(tmp_path):
    module, _ = _module_and_optimizer()
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    assert "it is an empty file (0 bytes): a save that was stopped, or a copy that failed" in _message(empty, module)
    bare = tmp_path / "weights.ckpt"
    torch.save(module.state_dict(), bare)
    message = _message(bare, module)
    assert "it holds tensors under bias, weight: a bare `state_dict`, not a Lightning checkpoint" in message
    assert "model.load_state_dict(torch.load(path))" in message
    other = tmp_path / "other.ckpt"
    torch.save({"epoch": 3, "weights": [1, 2]}, other)
    assert "it holds a dict of epoch, weights, no `state_dict` entry, so it is not a Lightning checkpoint" in _message(
        other, module
    )
    text = tmp_path / "notes.ckpt"
    text.write_text("epoch 3: loss 0.42\n")
    assert "it is not a checkpoint (torch.load failed with" in _message(text, module)


# -- the releases that wrote a folder, and a newer torch's index -------------------------------------


def test_a_folder_records_the_releases_that_wrote_it(tmp_path):
    from lightning_bfpp.engine.checkpoint.saving import _write_metadata

    tmp_path.joinpath("c").mkdir()
    _write_metadata({"global_step": 3}, tmp_path / "c" / METADATA_FILENAME)
    recorded = checkpoint_io.recorded_versions(tmp_path / "c")
    assert recorded == {"torch": torch.__version__, "lightning_bfpp": checkpoint_io.written_by()["lightning_bfpp"]}
    assert torch.load(tmp_path / "c" / METADATA_FILENAME)[checkpoint_io.VERSIONS_KEY] == recorded


def test_an_index_this_torch_cannot_read_is_told_apart_by_the_release_that_wrote_it(tmp_path):
    """A newer torch's `.metadata` (torch 2.13 cannot unpickle 2.15's) is not called corrupt: the error names both
    releases and the ways forward, for loading as for consolidating; one written by this torch or an older one is
    damaged; a folder that records nothing gets both explanations."""
    module, optimizer = _module_and_optimizer()
    folders = {}
    for name, versions in (("newer", {"torch": "9.1.0+cu999", "lightning_bfpp": "9.9"}),
                           ("same", {"torch": torch.__version__}), ("unrecorded", None)):  # fmt: skip
        folder = _save_folder(tmp_path / f"{name}.ckpt", module, optimizer)
        (folder / ".metadata").write_bytes((folder / ".metadata").read_bytes()[:40])
        if versions is not None:
            (folder / checkpoint_io.VERSIONS_FILENAME).write_text(json.dumps(versions))
        folders[name] = folder
    for read in (lambda f: _load(f, module, optimizer), checkpoint_io.read_whole):
        messages = {}
        for name, folder in folders.items():
            with pytest.raises(CheckpointError) as refused:
                read(folder)
            messages[name] = str(refused.value)
        newer = messages["newer"]
        running = torch.__version__
        assert f"written by torch 9.1.0+cu999 (lightning-bfpp 9.9), and this process runs torch {running}" in newer
        assert "The folder is not damaged. Either resume under torch 9.1 or newer" in newer
        assert f"`python -m lightning_bfpp.consolidate {folders['newer']} --output_file <file>.ckpt`" in newer
        assert "corrupt" not in newer
        assert "although torch" in messages["same"] and "the folder is truncated or corrupt" in messages["same"]
        unrecorded = messages["unrecorded"]
        assert "does not record which torch wrote it" in unrecorded and "written by a newer torch" in unrecorded


# -- a consolidated file's optimizer state (keyed by parameter name) ---------------------------------


def _two_groups() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(
        [{"params": module[0].parameters(), "lr": 0.1}, {"params": module[1].parameters(), "lr": 0.01}]
    )
    return module, optimizer


@pytest.mark.parametrize("stepped", [True, False])
def test_an_optimizer_state_keyed_by_name_loads_as_torchs_own_would(stepped):
    """What a folder stores and a consolidated file holds (``state.<name>.<key>``, ``param_groups.<name>.<key>``)
    loads into a fresh optimizer as ``Optimizer.load_state_dict`` of the same state would: every tensor and setting,
    several groups; saved before the first step, no state."""
    module, optimizer = _two_groups()
    if stepped:
        module(torch.randn(5, 3)).sum().backward()
        optimizer.step()
    by_name = checkpoint_io.optimizer_state(module, optimizer)
    assert checkpoint_io.one_device.is_keyed_by_name(by_name)
    fresh_module, fresh = _two_groups()
    fresh.param_groups[1]["lr"] = 5.0  # overwritten by the saved value
    names = [n for n, _ in module.named_parameters()]
    checkpoint_io.load_full_optimizer(fresh_module, fresh, by_name, names)
    want, got = optimizer.state_dict(), fresh.state_dict()
    assert [g["lr"] for g in got["param_groups"]] == [0.1, 0.01]
    assert set(got["state"]) == set(want["state"]) == ({0, 1, 2, 3} if stepped else set())
    for index, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


def test_resuming_from_last_takes_the_newest_complete_checkpoint_an_interrupted_save_left(tmp_path, one_process_group):
    """``ckpt_path="last"``: a save killed between its two renames leaves the previous checkpoint as
    ``last.ckpt.old`` and no ``last.ckpt``; the resume takes ``.old`` (Lightning alone sees no last checkpoint and
    starts over, and its first save then removes ``.old``). Beside an older ``last.ckpt``, a newer
    ``last-v1.ckpt.old`` is taken; a folder without ``meta.pt`` (a copy cut short) is never taken."""
    folder = tmp_path / "ckpts"
    _fit(folder, steps=2)
    (folder / "last.ckpt").rename(folder / "last.ckpt.old")
    trainer = _fit(folder, steps=3, ckpt_path="last")
    assert trainer.global_step == 3 and torch.load(folder / "last.ckpt" / METADATA_FILENAME)["global_step"] == 3
    assert not (folder / "last.ckpt.old").exists()  # removed once the new one was in place

    shutil.copytree(folder / "last.ckpt", folder / "last-v1.ckpt.old")  # step 3, newer than what follows
    meta = torch.load(folder / "last.ckpt" / METADATA_FILENAME, weights_only=False)
    torch.save({**meta, "global_step": 1}, folder / "last.ckpt" / METADATA_FILENAME)  # pretend it is older
    os.utime(folder / "last.ckpt", (1, 1))
    chosen = checkpoint_io.complete_last_checkpoints(
        {str(folder / "last.ckpt")}, folder, lambda name: name.startswith("last") and name.endswith(".ckpt")
    )
    assert chosen == {str(folder / "last.ckpt"), str(folder / "last-v1.ckpt.old")}
    (folder / "last-v1.ckpt.old" / METADATA_FILENAME).unlink()  # incomplete: never chosen
    (folder / "last-v2.ckpt").mkdir()
    chosen = checkpoint_io.complete_last_checkpoints(
        {str(folder / "last.ckpt"), str(folder / "last-v2.ckpt")}, folder, lambda name: name.startswith("last")
    )
    assert chosen == {str(folder / "last.ckpt")}
