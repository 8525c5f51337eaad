"""A model's initial weights read from a full checkpoint, each rank reading only the tensors of its own stages.

A model that needs a pipeline does not fit in one process: it is built on the meta device, each rank keeps its
own stages' layers (:func:`lightning_bfpp.engine.placing.keep_layers`), and :class:`PretrainedWeights` fills just
those layers' tensors from the checkpoint, reading nothing else:

- a Hugging Face folder of safetensors files, sharded (``model.safetensors.index.json`` says which file holds
  which tensor) or not: ``safe_open(...).get_tensor(name)`` reads one tensor's bytes;
- a ``torch.save`` file (a one-device Lightning ``.ckpt``, whose ``state_dict`` is read, or a plain state dict):
  memory-mapped (``torch.load(mmap=True)``), so only the pages of the tensors copied are read;
- a ``torch.distributed.checkpoint`` folder (this strategy's checkpoints, Lightning's model-parallel ones): DCP
  reads the requested entries only, on this process alone (``no_dist``).

Each tensor is converted to its target's dtype as it is copied (a bf16 checkpoint into fp32 layers, or the
reverse). A tensor the checkpoint lacks, one of another shape, a shard file the index names but the folder lacks,
or a folder of ``.bin`` files each raise :class:`PretrainedWeightsError` naming the file and tensor; the build
agrees on it on every rank (:func:`lightning_bfpp.engine.agreement.agree`), so nothing trains half-loaded.

Written here because torch's DCP reads Hugging Face folders only through its ``HuggingFaceStorageReader`` into a
state dict whose entries must all exist (and needs a collective per load), and ``transformers`` loads whole models.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from lightning_bfpp.engine.checkpoint import reader, torch_load

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
# where a DCP checkpoint keeps a module's tensors: this strategy's and Lightning's model-parallel checkpoints
# nest them under "model"; a bare state dict saved with DCP has none
_DCP_PREFIXES = ("model.", "")

Rename = Callable[[str], Sequence[str]]


class PretrainedWeightsError(ValueError):
    """A checkpoint that cannot fill the layers asked for: what is missing or wrong, with its file."""


@dataclass(frozen=True)
class PretrainedWeights:
    """Where a module's initial weights come from (module docstring): ``path``, a safetensors folder or file, a
    ``torch.save`` file, or a DCP folder.

    ``rename(name)`` gives the names a tensor of the module (``"blocks.3.mlp.weight"``) may have in the checkpoint,
    the first one found being read (default: its own name; a one-device Lightning checkpoint keys tensors by the
    module's names). ``optional(name)``: whether the tensor may be absent (it keeps its initialization: a new head,
    LoRA adapters over a base model's checkpoint). ``translate(stored)``: the name a safetensors folder's tensor goes
    by once loaded (``transformers`` renames some checkpoints' keys as it loads them), or None for one that only a
    conversion of several tensors could give (read whole instead).
    """

    path: Path
    rename: Rename | None = None
    optional: Callable[[str], bool] = field(default=lambda name: False)
    translate: Callable[[str], str | None] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    def stored_names(self) -> list[str]:
        """The names of the tensors a safetensors file or folder stores (its index, or its files' headers)."""
        return list(_Safetensors(self.path).files)

    def fill_module(self, module: nn.Module, prefix: str = "") -> int:
        """Fill ``module``'s parameters and persistent buffers (named ``prefix + name``); returns the bytes read."""
        return self.fill({prefix + name: tensor for name, tensor in module.state_dict(keep_vars=True).items()})

    def fill(self, targets: Mapping[str, torch.Tensor]) -> int:
        """Copy each target's values from the checkpoint, converted to its dtype; returns the bytes read."""
        meta = next((name for name, t in targets.items() if t.is_meta), None)
        if meta is not None:
            raise PretrainedWeightsError(
                f"`{meta}` is on the meta device: allocate it before filling it from {self.path}."
            )
        candidates = {name: list(self.rename(name) if self.rename else (name,)) for name in targets}
        path = self.path
        if path.is_dir() and (path / ".metadata").is_file():  # DCP's index of the folder
            source: _Source = _DistributedCheckpoint(path)
        elif path.is_dir() or path.suffix == ".safetensors":
            source = _Safetensors(path, self.translate)
        else:
            source = _TorchFile(path)
        found = {name: source.locate(names) for name, names in candidates.items()}
        missing = [name for name, where in found.items() if where is None and not self.optional(name)]
        if missing:
            shown = ", ".join(f"`{name}` (as {' or '.join(repr(n) for n in candidates[name])})" for name in missing[:4])
            more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
            hint = ""
            if source.unreadable:
                hint = (
                    f" It stores tensors (e.g. `{source.unreadable[0]}`) that `transformers` converts as it loads"
                    " them, several into one, which cannot be read per stage: load it whole with `from_pretrained`"
                    " and pass the model itself."
                )
            raise PretrainedWeightsError(f"{path} has no tensor for {shown}{more}.{hint}")
        # one read per stored tensor, however many of the module's tensors take it (a tied weight's copies)
        readers: dict[str, list[torch.Tensor]] = {}
        for name, where in found.items():
            if where is not None:
                readers.setdefault(where, []).append(targets[name])
        with torch.no_grad():
            read = source.read({where: tensors[0] for where, tensors in readers.items()})
            for tensors in readers.values():
                for other in tensors[1:]:
                    if other is not tensors[0]:
                        other.copy_(tensors[0])
        return read


def _check_shape(name: str, shape: Sequence[int], target: torch.Tensor, where: Path) -> None:
    if tuple(shape) != tuple(target.shape):
        raise PretrainedWeightsError(
            f"`{name}` in {where} has shape {tuple(shape)}; the module's tensor has {tuple(target.shape)}."
        )


def _copy(target: torch.Tensor, value: torch.Tensor) -> int:
    """Copy the whole tensor ``value`` into ``target``, or into the part of it a tensor-parallel ``target`` holds."""
    local, dim, start, length = _part_of(target)
    if dim is not None:
        value = value.narrow(dim, start, length)
    local.copy_(value.to(dtype=local.dtype))
    return value.numel() * value.element_size()


def _part_of(target: torch.Tensor) -> tuple[torch.Tensor, int | None, int, int]:
    """The tensor this process holds of ``target``, and which part of the whole that is: ``(local, dim, start,
    length)``, ``dim`` None for the whole. A tensor-parallel parameter (a DTensor sharded along one dimension over
    its tensor group, as torch chunks it) holds rows ``start … start + length`` of dimension ``dim``."""
    if not isinstance(target, DTensor):
        return target, None, 0, 0
    local = target.to_local()
    sharded = [(i, p.dim) for i, p in enumerate(target.placements) if isinstance(p, Shard)]
    if not sharded:
        return local, None, 0, 0
    if len(sharded) > 1:
        raise PretrainedWeightsError(
            f"a parameter sharded over {len(sharded)} mesh dimensions ({target.placements}) is filled before"
            " sharding; read the checkpoint before the stages are sharded"
        )
    mesh_dim, dim = sharded[0]
    count, rank, full = (
        target.device_mesh.size(mesh_dim),
        target.device_mesh.get_local_rank(mesh_dim),
        target.shape[dim],
    )
    size = -(-full // count)  # torch.chunk's split, which DTensor's Shard follows
    start = min(rank * size, full)
    length = max(0, min(size, full - start))
    if local.shape[dim] != length:
        raise PretrainedWeightsError(
            f"a tensor-parallel parameter holds {local.shape[dim]} of {full} along dimension {dim}, not torch.chunk's"
            f" {length}: it cannot be filled from a whole tensor"
        )
    return local, dim, start, length


class _Source:
    # stored tensors no single module tensor is read from (a conversion of several makes it)
    unreadable: Sequence[str] = ()

    def locate(self, names: Sequence[str]) -> str | None:
        """The first of ``names`` the checkpoint holds."""
        raise NotImplementedError

    def read(self, targets: Mapping[str, torch.Tensor]) -> int:
        """Copy the checkpoint's entry of each name into its target; the bytes read."""
        raise NotImplementedError


# safetensors' dtype names (its format's specification)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def write_safetensors(
    file: Path,
    layout: Mapping[str, tuple[torch.dtype, Sequence[int]]],
    chunks: Iterable[Mapping[str, torch.Tensor]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write a safetensors file whose tensors are ``layout`` (name -> dtype and shape, in file order), their values
    coming in ``chunks`` (consecutive runs of that order), each written straight from its storage and released
    before the next chunk is asked for: the writer holds one chunk, not the file (``safetensors.torch.save_file``
    serializes the whole file in memory first)."""
    names = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, (dtype, shape) in layout.items():
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    order = iter(layout)
    with open(file, "wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for chunk in chunks:
            for name, tensor in chunk.items():
                expected = next(order, None)
                if name != expected or (tensor.dtype, tuple(tensor.shape)) != (layout[name][0], tuple(layout[name][1])):
                    raise ValueError(f"write_safetensors: got `{name}` {tuple(tensor.shape)} where `{expected}` goes")
                if tensor.numel():
                    handle.write(memoryview(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()))
    if next(order, None) is not None:
        raise ValueError(f"write_safetensors: {file} was given fewer tensors than its layout names")


def safetensors_header(file: Path) -> dict[str, Any]:
    """A safetensors file's header: each tensor's ``dtype``, ``shape`` and ``data_offsets`` (from the end of the
    header), read without mapping the file."""
    with open(file, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    for entry in header.values():
        entry["start"] = 8 + length + entry["data_offsets"][0]
    return header


class _Safetensors(_Source):
    """A file, or a folder: its index's weight map, or the tensors its one file (or files) hold (headers only).

    Each tensor is read with a seek and a read of its own bytes into a buffer of its stored dtype: nothing is
    memory-mapped, so a process reads (and holds) its own tensors only, whatever a shard's size (``safe_open``
    maps a whole shard, which a process capped below it cannot do)."""

    def __init__(self, path: Path, translate: Callable[[str], str | None] | None = None) -> None:
        self.path = path
        self.files = self._files(path)
        # the names the stored tensors go by once loaded (None: only a conversion of several tensors makes it)
        self.loaded_as = {} if translate is None else {stored: translate(stored) for stored in self.files}
        self.stored_as = {loaded: stored for stored, loaded in self.loaded_as.items() if loaded is not None}

    def _files(self, path: Path) -> dict[str, Path]:
        if path.is_file():
            return dict.fromkeys(safetensors_header(path), path)
        index = path / SAFETENSORS_INDEX
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: path / file for name, file in weight_map.items()}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            others = sorted(p.name for p in path.glob("*.bin")) or sorted(p.name for p in path.iterdir())[:8]
            raise PretrainedWeightsError(
                f"{path} holds no safetensors file ({', '.join(others) or 'nothing'}): each rank reads its own stages'"
                " tensors from safetensors only. Convert the weights once, e.g. load the model with `transformers`"
                " and `save_pretrained(folder)` (safetensors by default)."
            )
        return {name: file for file in files for name in safetensors_header(file)}

    def locate(self, names: Sequence[str]) -> str | None:
        for name in names:
            if name in self.stored_as:
                return self.stored_as[name]
            if name in self.files and self.loaded_as.get(name, name) is not None:
                return name
        return None

    @property  # type: ignore[override]
    def unreadable(self) -> list[str]:
        return [stored for stored, loaded in self.loaded_as.items() if loaded is None]

    def read(self, targets: Mapping[str, torch.Tensor]) -> int:
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name in targets:
            by_file[self.files[name]].append(name)
        read = 0
        for file, names in by_file.items():
            if not file.exists():
                raise PretrainedWeightsError(
                    f"{file.name}, which {self.path / SAFETENSORS_INDEX} names for `{names[0]}`, is not in"
                    f" {file.parent}."
                )
            header = safetensors_header(file)
            with open(file, "rb") as handle:
                for name in sorted(names, key=lambda n: header.get(n, {}).get("start", 0)):  # in file order
                    entry = header.get(name)
                    if entry is None:
                        raise PretrainedWeightsError(
                            f"{file} has no tensor `{name}`, which {self.path / SAFETENSORS_INDEX} says it holds."
                        )
                    target = targets[name]
                    _check_shape(name, entry["shape"], target, file)
                    read += _read_part(handle, entry, target)
        return read


def _read_part(handle: Any, entry: Mapping[str, Any], target: torch.Tensor) -> int:
    """Read a stored tensor (its safetensors header ``entry``) into ``target``; returns the bytes read. A
    tensor-parallel ``target`` reads only its own part: split along the first dimension, one contiguous run of the
    file; along another, one run per index of the dimensions before it (a column-split matrix: its columns of each
    row). Straight into the tensor where it takes the stored bytes as they are, else through a buffer of the
    stored dtype."""
    dtype, shape = _SAFETENSORS_DTYPES[entry["dtype"]], list(entry["shape"])
    local, dim, start, length = _part_of(target)
    if dim is None:
        dim, start, length = 0, 0, shape[0] if shape else 1
    outer, full = math.prod(shape[:dim]), shape[dim] if shape else 1
    inner = math.prod(shape[dim + 1 :]) * dtype.itemsize  # bytes of one index along `dim`
    part = [*shape[:dim], length, *shape[dim + 1 :]] if shape else []
    direct = local.dtype == dtype and local.device.type == "cpu" and local.is_contiguous()
    value = local.detach() if direct else torch.empty(part, dtype=dtype)
    if value.numel():
        runs = value.view(-1).view(torch.uint8).view(outer, length * inner).numpy()
        for i in range(outer):  # one run of `length` indices along `dim` per index before it
            handle.seek(entry["start"] + (i * full + start) * inner)
            handle.readinto(memoryview(runs[i]))
    if not direct:
        local.copy_(value.to(dtype=local.dtype))
    return value.numel() * value.element_size()


class _TorchFile(_Source):
    """A ``torch.save`` file, memory-mapped: a Lightning checkpoint's ``state_dict``, or a state dict itself."""

    def __init__(self, path: Path) -> None:
        if not path.exists():
            raise PretrainedWeightsError(f"{path} does not exist.")
        self.path = path
        loaded: Any = torch_load(path, weights_only=None, mmap=True)
        state = loaded.get("state_dict", loaded) if isinstance(loaded, Mapping) else None
        if not isinstance(state, Mapping):
            raise PretrainedWeightsError(f"{path} holds no state dict (found {type(loaded).__name__}).")
        self.state = state

    def locate(self, names: Sequence[str]) -> str | None:
        return next((name for name in names if isinstance(self.state.get(name), torch.Tensor)), None)

    def read(self, targets: Mapping[str, torch.Tensor]) -> int:
        read = 0
        for name, target in targets.items():
            value = self.state[name]
            _check_shape(name, value.shape, target, self.path)
            read += _copy(target, value)
        return read


class _DistributedCheckpoint(_Source):
    """A DCP folder, read on this process alone: only the requested entries."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.index = reader(path, weights_only=None).read_metadata().state_dict_metadata

    def locate(self, names: Sequence[str]) -> str | None:
        keys = (prefix + name for name in names for prefix in _DCP_PREFIXES)
        return next((key for key in keys if key in self.index), None)

    def read(self, targets: Mapping[str, torch.Tensor]) -> int:
        request = {}
        for key, target in targets.items():
            _check_shape(key, self.index[key].size, target, self.path)
            # DCP reads into the request's tensors: one of the stored dtype, copied (and converted) afterwards
            request[key] = torch.empty(target.shape, dtype=self.index[key].properties.dtype)
        dcp.load(request, storage_reader=reader(self.path, weights_only=None), no_dist=True)
        return sum(_copy(targets[key], value) for key, value in request.items())


def load_pretrained(
    module: nn.Module,
    path: str | Path,
    *,
    rename: Rename | None = None,
    optional: Callable[[str], bool] | None = None,
) -> PretrainedWeights:
    """Fill ``module``'s weights from the full checkpoint at ``path`` (a safetensors folder or file, a one-device
    Lightning ``.ckpt`` or other ``torch.save`` state dict, or a DCP folder such as ``BFPPStrategy``'s checkpoints).

    Tensors on the meta device are filled where they are allocated: ``BFPPStrategy`` reads, on each rank, only
    its own stages' tensors, right after placing them, before they are sharded. Call this in ``configure_model``
    after building the layers on the meta device (or on a module created under
    ``trainer.init_module(empty_init=True)``). A module with no meta tensor is filled at once, whole.
    ``rename(name)``: the names a tensor of the module may have in the checkpoint (default: its own);
    ``optional(name)``: whether it may be missing there (it then keeps its initialization).
    """
    weights = PretrainedWeights(Path(path), rename=rename, optional=optional or (lambda name: False))
    if any(t.is_meta for t in module.state_dict(keep_vars=True).values()):
        module.pipeline_pretrained = weights  # type: ignore[assignment]  (read by the strategy's build)
    else:
        weights.fill_module(module)
    return weights


def layer_tensors(layers: Mapping[str, nn.Module]) -> dict[str, torch.Tensor]:
    """The parameters and persistent buffers of ``layers`` (by layer name), named as in the whole module."""
    return {
        f"{layer_name}.{name}": tensor
        for layer_name, layer in layers.items()
        for name, tensor in layer.state_dict(keep_vars=True).items()
    }
