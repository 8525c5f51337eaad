"""A trained wrapper, or a checkpoint of one, written back as a ``save_pretrained`` folder (or ``peft``'s adapter
folder): :func:`export_pretrained`.

Its own module because a checkpoint is exported without building the model's weights in memory: a checkpoint's
tensors are read on demand (:class:`_CheckpointTensors`) and written one safetensors shard at a time
(:func:`_write_shards`), so that a model larger than one process's memory can still be exported on one process.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from lightning_bfpp.engine.checkpoint import MODEL_KEY, TIED_KEY, load_metadata, reader, torch_load
from lightning_bfpp.engine.pretrained import write_safetensors
from lightning_bfpp.integrations.huggingface.lora import _peft
from lightning_bfpp.integrations.huggingface.modules import HFCausalLM, HFSequenceRegressor, _HFPipelineModule

TASK_HEAD_FILE = "bfpp_task_head.pt"


class _CheckpointTensors:
    """A checkpoint's model weights, read on demand: a DCP folder's ``model`` entries (never the optimizer state),
    or a ``torch.save`` file's ``state_dict``, memory-mapped. ``names``: the module names it holds (a parameter tied
    across stages under each of its names, stored once)."""

    def __init__(self, path: Path, weights_only: bool | None) -> None:
        self.path = path
        self.aliases: dict[str, str] = {}
        if path.is_dir():
            self.index = {
                key[len(MODEL_KEY) + 1 :]: meta
                for key, meta in reader(path, weights_only=weights_only).read_metadata().state_dict_metadata.items()
                if key.startswith(MODEL_KEY + ".")
            }
            self.checkpoint = load_metadata(path, weights_only=weights_only)
            self.aliases = dict(self.checkpoint.get(TIED_KEY) or {})
            self.state = None
        else:
            self.checkpoint = torch_load(path, weights_only=weights_only, mmap=True)
            self.state = self.checkpoint.get("state_dict")
        self.weights_only = weights_only
        stored = set(self.index if self.state is None else self.state)
        self.names = [*stored, *(a for a, c in self.aliases.items() if c in stored and a not in stored)]

    def layout(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """A stored tensor's dtype and shape, read from the index (nothing is loaded)."""
        if self.state is not None:
            return self.state[name].dtype, tuple(self.state[name].shape)
        meta = self.index[self.aliases.get(name, name)]
        return meta.properties.dtype, tuple(meta.size)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        if self.state is not None:
            return {name: self.state[name] for name in names}
        keys = {name: self.aliases.get(name, name) for name in names}
        request = {
            f"{MODEL_KEY}.{key}": torch.empty(self.index[key].size, dtype=self.index[key].properties.dtype)
            for key in set(keys.values())
        }
        dcp.load(request, storage_reader=reader(self.path, weights_only=self.weights_only), no_dist=True)
        return {name: request[f"{MODEL_KEY}.{key}"] for name, key in keys.items()}


def _checkpoint_tensors(path: Path, weights_only: bool | None) -> tuple[_HFPipelineModule, _CheckpointTensors]:
    """The module (built on the meta device, for its names and config) and the checkpoint's weights, unread."""
    tensors = _CheckpointTensors(path, weights_only)
    hparams = tensors.checkpoint.get("hyper_parameters") or {}
    if not tensors.names or "model" not in hparams:
        raise ValueError(
            f"{path} is not a checkpoint of an `HFCausalLM`/`HFSequenceRegressor` (it lacks the weights or the"
            " `model` hyper-parameter that holds the config)."
        )
    cls = HFSequenceRegressor if "pooling" in hparams else HFCausalLM
    with torch.device("meta"):
        module = cls(**hparams)
    return module, tensors


def _bytes(size: int | str) -> int:
    """``5_000_000``, ``"5GB"``, ``"500MB"`` or ``"2GiB"`` as bytes (``save_pretrained``'s ``max_shard_size``)."""
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    for suffix, factor in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6),
                           ("KB", 10**3), ("B", 1)):  # fmt: skip
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def _read_in_parts(
    tensors: _CheckpointTensors, shard: list[tuple[str, str]], part_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    """An output shard's tensors (``transformers`` name -> tensor), read from the checkpoint a part of about
    ``part_bytes`` at a time (a tensor larger than that on its own), in the shard's order."""
    part: list[tuple[str, str]] = []
    size = 0
    for hf_name, ours in [*shard, ("", "")]:
        nbytes = 0 if not ours else math.prod(tensors.layout(ours)[1]) * tensors.layout(ours)[0].itemsize
        if part and (not ours or size + nbytes > part_bytes):
            read = tensors.read([name for _, name in part])
            yield {hf: read[name] for hf, name in part}
            del read
            part, size = [], 0
        if ours:
            part.append((hf_name, ours))
            size += nbytes


def _write_shards(
    module: _HFPipelineModule, tensors: _CheckpointTensors, out: Path, max_shard_size: int | str, kwargs: dict
) -> Path:
    """A ``save_pretrained`` folder written one safetensors shard at a time, each read from the checkpoint a quarter
    shard at a time as it is written: host memory holds a part of one output shard. A tied weight is written once,
    under the model's first name for it, as ``save_pretrained`` does."""
    if kwargs:
        raise TypeError(f"export_pretrained from a checkpoint takes `max_shard_size` only; got {sorted(kwargs)}")
    out.mkdir(parents=True, exist_ok=True)
    limit, written = _bytes(max_shard_size), set()
    shards: list[list[tuple[str, str]]] = [[]]  # (transformers name, this module's name) per output shard
    size = 0
    for hf_name, ours in module.hf_names.items():
        if ours in written:
            continue
        written.add(ours)
        dtype, shape = tensors.layout(ours)
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((hf_name, ours))
        size += nbytes
    count = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        file = "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        layout = {hf_name: tensors.layout(ours) for hf_name, ours in shard}
        write_safetensors(out / file, layout, _read_in_parts(tensors, shard, limit // 4), metadata={"format": "pt"})
        total += sum(math.prod(shape) * dtype.itemsize for dtype, shape in layout.values())
        weight_map.update(dict.fromkeys(layout, file))
    if count > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config = copy.deepcopy(module.hf_config)
    with torch.device("meta"):  # the model's class, for the config's `architectures` (as `save_pretrained` sets it)
        model = module._auto_class.from_config(config)
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    if isinstance(module, HFSequenceRegressor):
        _save_task_head(module, tensors.read([n for n in tensors.names if n.startswith("head.classifier.")]), out)
    return out


def _save_task_head(module: HFSequenceRegressor, tensors: dict[str, torch.Tensor], out: Path) -> None:
    """An encoder's task head, which ``transformers`` does not know, beside the model: ``{"pooling", "num_labels",
    "state_dict"}`` in :data:`TASK_HEAD_FILE`, the classifier's of ``tensors`` (this module's names) as its state."""
    head = {k[len("head.") :]: v for k, v in tensors.items() if k.startswith("head.classifier.")}
    torch.save(
        {"pooling": module.head.pooling, "num_labels": module.num_labels, "state_dict": head}, out / TASK_HEAD_FILE
    )


def export_pretrained(
    source: _HFPipelineModule | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    merge: bool = False,
    weights_only: bool | None = None,
    **save_kwargs: Any,
) -> Path:
    """Write a trained :class:`HFCausalLM` / :class:`HFSequenceRegressor` as a ``save_pretrained`` folder.

    ``source`` is the module itself (on one process: after ``fit`` with ``strategy="auto"``, or after a
    pipelined ``fit`` of a single process), a checkpoint file (one-device, or made by
    ``python -m lightning.pytorch.utilities.consolidate_checkpoint``), or a ``BFPPStrategy`` checkpoint folder
    (read whole, on one process). ``AutoModelForCausalLM.from_pretrained(out_dir)`` (causal LMs) or
    ``AutoModel.from_pretrained(out_dir)`` (encoders) then loads the trained model; an encoder's task head,
    which ``transformers`` does not know, is saved beside it in ``bfpp_task_head.pt``
    (``{"pooling", "num_labels", "state_dict"}``). ``save_kwargs`` go to ``save_pretrained``. ``weights_only``
    for a checkpoint ``source`` as ``torch.load`` takes it (``None``: torch's default, ``True``; its hyper-parameters
    are plain values): ``False`` only for a file you trust, as unpickling it in full can run code.

    A module trained with LoRA is written as ``peft``'s adapter folder (``adapter_config.json`` and the adapter
    weights), which ``PeftModel.from_pretrained(base_model, out_dir)`` loads onto the base model; with
    ``merge=True``, as the whole model with the adapters merged into its weights (``merge_and_unload``), which
    ``from_pretrained`` loads without ``peft``.
    """
    if not isinstance(source, _HFPipelineModule):
        module, tensors = _checkpoint_tensors(Path(source), weights_only)
        if module.lora_config is None:  # the model's weights alone, one output shard at a time
            return _write_shards(module, tensors, Path(out_dir), save_kwargs.pop("max_shard_size", "5GB"), save_kwargs)
        full = {name: tensors.read([name])[name] for name in tensors.names}
    else:
        module, full = source, source.full_state_dict()
    state = {hf: full[ours] for hf, ours in module.hf_names.items()}
    config = copy.deepcopy(module.hf_config)
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    model = module._auto_class.from_config(config, dtype=dtypes.pop() if len(dtypes) == 1 else None)
    out = Path(out_dir)
    if module.lora_config is None:
        if merge:
            raise ValueError("`merge=True` merges LoRA adapters; this module has none.")
        model.load_state_dict(state, strict=True)
        model.save_pretrained(out, **save_kwargs)
    else:
        peft_model = _peft().get_peft_model(model, copy.deepcopy(module.lora_config), adapter_name=module.adapter_name)
        model.load_state_dict(state, strict=True)
        if merge:
            peft_model.merge_and_unload().save_pretrained(out, **save_kwargs)
        else:
            peft_model.save_pretrained(out, **save_kwargs)
    if isinstance(module, HFSequenceRegressor):
        _save_task_head(module, full, out)
    return out
