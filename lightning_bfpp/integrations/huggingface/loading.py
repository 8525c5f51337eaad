"""What the wrappers' ``model`` argument may be (a model, a config object or dict, a ``from_pretrained`` name or
folder) turned into a ``transformers`` model, and the ``dtype`` argument into a torch dtype.

Its own module because a name or folder is built on the meta device here and read later, per stage
(:mod:`.pretrained`): what is built and what is read are decided apart.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PreTrainedConfig, PreTrainedModel


def _config_from_dict(values: Mapping[str, Any]) -> PreTrainedConfig:
    values = dict(values)
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ValueError("A config given as a dict needs its `model_type` (as `config.to_dict()` writes it).")
    return AutoConfig.for_model(model_type, **values)


def _load(
    source: Any, auto_class: Any, attn_implementation: str | None, dtype: torch.dtype | str | None
) -> tuple[PreTrainedModel, Path | None]:
    """A ``transformers`` model from a model, a config (object or dict) or a ``from_pretrained`` name/folder, and,
    for a name or folder, the folder whose safetensors hold its weights.

    A name or folder is built on the meta device, in ``dtype`` (default: the config's, as ``from_pretrained``
    takes it): nothing is allocated or read here. The weights are read where the layers are allocated: under
    ``BFPPStrategy`` each rank reads only its own stages' tensors; elsewhere the wrapper's ``materialize`` (called
    by ``configure_model``, see :mod:`.pretrained`) reads them all.
    """
    kwargs: dict[str, Any] = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if isinstance(source, PreTrainedModel):
        if attn_implementation is not None:
            source.set_attn_implementation(attn_implementation)
        return (source if dtype is None else source.to(_dtype(dtype))), None
    if isinstance(source, Mapping):
        source = _config_from_dict(source)
    if isinstance(source, PreTrainedConfig):
        return auto_class.from_config(source, **kwargs, **({} if dtype is None else {"dtype": _dtype(dtype)})), None
    if isinstance(source, (str, os.PathLike)):
        folder = _local_folder(source)
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = auto_class.from_config(config, dtype=_dtype(dtype or config.dtype or torch.float32), **kwargs)
        # `from_pretrained` returns the model in eval mode, and Lightning keeps each submodule's mode: fine-tune
        # with the dropout the config asks for
        return model.train(), folder
    raise TypeError(
        "Pass a `transformers` model, its config (object or `config.to_dict()`), or a name or folder for"
        f" `from_pretrained`; got {type(source).__name__}."
    )


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.bfloat16`` from itself or from ``"bfloat16"`` / ``"torch.bfloat16"`` (a config's or a YAML's)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"`dtype` must be a torch floating dtype (e.g. torch.bfloat16 or 'bfloat16'); got {dtype!r}.")
    return value


def _local_folder(source: str | os.PathLike[str]) -> Path:
    """The folder of a ``from_pretrained`` name: itself if it is one, else its files in the Hugging Face cache (the
    config and the safetensors only; downloaded unless offline)."""
    path = Path(source)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(os.fspath(source), allow_patterns=["*.json", "*.safetensors"]))
