"""Checkpoints that keep the module's own names and load under any pipeline or data-parallel layout.

A checkpoint is a ``torch.distributed.checkpoint`` (DCP) folder holding ``"model"`` (each parameter and
buffer under its fully-qualified name in the LightningModule) and ``"optimizer_<i>"`` (optimizer state
keyed by parameter name), plus ``meta.pt`` with everything else Lightning saves (loops, callbacks, LR
schedulers, hyper-parameters). DCP records global shapes, so a checkpoint written by one layout is read by
any other: each rank asks for the names of its own stages, in its own sharding. The ``"model"`` key is the
one Lightning's ``consolidate_checkpoint`` expects, so that tool turns the folder into one ordinary
checkpoint file. A tied parameter is stored once, under its canonical name; ``meta.pt`` records its other
names, so that consolidating writes a file holding both, as a one-device tied model's ``state_dict`` does.
``meta.pt`` also records the torch and lightning-bfpp releases that wrote the folder: an older torch may not
read a newer one's DCP index, and then says so, with the ways forward.

One concern per module, all re-exported here:

- :mod:`~lightning_bfpp.engine.checkpoint.names`: the stored names, what a rank saves, tied parameters'
  canonical names;
- :mod:`~lightning_bfpp.engine.checkpoint.errors`: :class:`CheckpointError`, raised on every rank together;
- :mod:`~lightning_bfpp.engine.checkpoint.unpickling`: ``weights_only`` for every pickle of a checkpoint;
- :mod:`~lightning_bfpp.engine.checkpoint.saving`: the atomic save (staging folder, two renames, ``meta.pt``);
- :mod:`~lightning_bfpp.engine.checkpoint.checks`: a checkpoint checked against the module before loading;
- :mod:`~lightning_bfpp.engine.checkpoint.loading`: a DCP folder or a one-device file into this rank;
- :mod:`~lightning_bfpp.engine.checkpoint.one_device`: a one-device file's tensors and optimizer state, sliced;
- :mod:`~lightning_bfpp.engine.checkpoint.loader_states`: one data-loader state per data-parallel replica.

This package is the engine side: it does not import Lightning; the strategy passes in what it needs.
"""

from __future__ import annotations

from lightning_bfpp.engine.checkpoint.checks import (
    Shapes,
    check_full,
    check_sharded,
    checkpoint_keys,
    local_shapes,
    read_index,
    recorded_versions,
)
from lightning_bfpp.engine.checkpoint.errors import CheckpointError, raise_on_every_rank
from lightning_bfpp.engine.checkpoint.loader_states import gather_loader_states, replica_loader_states
from lightning_bfpp.engine.checkpoint.loading import load, read_whole
from lightning_bfpp.engine.checkpoint.names import (
    CURRENT_MODEL_STATE,
    LOADER_STATES_KEY,
    METADATA_FILENAME,
    MODEL_KEY,
    TIED_KEY,
    VERSIONS_FILENAME,
    VERSIONS_KEY,
    from_canonical,
    is_sharded_checkpoint,
    model_state,
    optimizer_key,
    optimizer_state,
    to_canonical,
    with_tied_names,
    written_by,
)
from lightning_bfpp.engine.checkpoint.one_device import load_full_optimizer, load_full_weights
from lightning_bfpp.engine.checkpoint.saving import _swap_in as _swap_in
from lightning_bfpp.engine.checkpoint.saving import complete_last_checkpoints, resolve_path, save
from lightning_bfpp.engine.checkpoint.unpickling import load_metadata, reader, resolve_weights_only, torch_load

__all__ = [
    "CURRENT_MODEL_STATE",
    "LOADER_STATES_KEY",
    "METADATA_FILENAME",
    "MODEL_KEY",
    "TIED_KEY",
    "VERSIONS_FILENAME",
    "VERSIONS_KEY",
    "CheckpointError",
    "Shapes",
    "check_full",
    "check_sharded",
    "checkpoint_keys",
    "complete_last_checkpoints",
    "from_canonical",
    "gather_loader_states",
    "is_sharded_checkpoint",
    "load",
    "load_full_optimizer",
    "load_full_weights",
    "load_metadata",
    "local_shapes",
    "model_state",
    "optimizer_key",
    "optimizer_state",
    "raise_on_every_rank",
    "read_index",
    "read_whole",
    "reader",
    "recorded_versions",
    "replica_loader_states",
    "resolve_path",
    "resolve_weights_only",
    "save",
    "to_canonical",
    "torch_load",
    "with_tied_names",
    "written_by",
]
