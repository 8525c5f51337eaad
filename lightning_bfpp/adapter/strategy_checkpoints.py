"""The strategy's checkpoint methods: Lightning's ``Strategy`` API for saving, loading and removing checkpoints,
with saves that do not stop training (``async_checkpoint=True``).

Mixed into :class:`~lightning_bfpp.adapter.strategy.BFPPStrategy`; the work is done in
:mod:`~lightning_bfpp.adapter.checkpointing` (Lightning's dict to and from a sharded folder) and in
:mod:`lightning_bfpp.engine.checkpoint` (the files, the asynchronous writes and their commit).

An asynchronous save runs only while ``fit`` trains, where a step boundary follows to commit it: the end of
training waits for the save in flight and commits it (so ``ckpt_path`` after ``fit``, ``trainer.save_checkpoint``
outside it, and a SIGTERM stop see the files in place), and a save outside ``fit`` blocks as without the option.
"""

from __future__ import annotations

from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_bfpp.adapter import _lightning_compat as lc
from lightning_bfpp.adapter import checkpointing, weight_averaging
from lightning_bfpp.adapter.checkpointing import CheckpointPlace
from lightning_bfpp.engine import checkpoint as engine_checkpoint
from lightning_bfpp.engine.checkpoint.async_saving import AsyncSaver
from lightning_bfpp.engine.process_groups import reused


class CheckpointMethods:
    """Mixed into ``BFPPStrategy`` ahead of Lightning's ``ModelParallelStrategy``."""

    lightning_module: Any
    optimizers: list[Optimizer]
    root_device: Any
    tied: Any
    async_checkpoint: bool
    _timeout: timedelta
    _checkpoint_place: CheckpointPlace | None
    _async_saver: AsyncSaver | None

    def _start_async_saves(self) -> None:
        """A collective, once the default process group exists: the writer thread's own group."""
        if self.async_checkpoint and self._async_saver is None:
            group = None
            if dist.is_initialized():
                timeout = self._timeout
                group = reused(("async_saves", timeout), lambda: dist.new_group(backend="gloo", timeout=timeout))
            self._async_saver = AsyncSaver(group, self.root_device)

    def _saves_at_step_boundary(self) -> None:
        if self._async_saver is not None:
            self._async_saver.at_step_boundary()

    def _finish_saves(self) -> None:
        if self._async_saver is not None:
            self._async_saver.finish()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return engine_checkpoint.model_state(self.lightning_module, self.tied.aliases)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.lightning_module is not None
        optimizer = lc.unwrap_optimizer(optimizer)
        return engine_checkpoint.optimizer_state(self.lightning_module, optimizer, self.tied.aliases)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: lc.PathLike, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "BFPPStrategy writes distributed checkpoints with torch.distributed.checkpoint and takes no"
                " `storage_options`."
            )
        assert self._checkpoint_place is not None
        path = Path(self.broadcast(str(filepath)))  # type: ignore[attr-defined]
        trainer = lc.attached_trainer(self.lightning_module) if self.lightning_module is not None else None
        write = engine_checkpoint.save
        if self._async_saver is not None:
            if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
                write = self._async_saver.save
            else:
                self._async_saver.finish()
        checkpointing.save(checkpoint, path, self._checkpoint_place, write=write)

    @override
    def remove_checkpoint(self, filepath: lc.PathLike) -> None:
        # a checkpoint callback removes the previous checkpoint right after its save returns: with the save still
        # being written, the removal waits until the new checkpoint is in place
        remove = partial(super().remove_checkpoint, filepath)  # type: ignore[misc]
        if self._async_saver is None or not self._async_saver.remove_after_commit(remove):
            remove()

    @override
    def load_checkpoint(self, checkpoint_path: lc.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.lightning_module is not None and self._checkpoint_place is not None
        self._finish_saves()
        module = self.lightning_module
        averaged = weight_averaging.average(module.trainer.callbacks)  # type: ignore[attr-defined]
        loaded = checkpointing.load(
            Path(self.broadcast(str(checkpoint_path))), module,  # type: ignore[attr-defined]
            [lc.unwrap_optimizer(o) for o in self.optimizers], self._checkpoint_place,
            strict=module.strict_loading, weights_only=weights_only, warn=rank_zero_warn,
            averaged=None if averaged is None else averaged.module,
        )  # fmt: skip
        if averaged is not None:
            weight_averaging.loaded_states(loaded, module, averaged)
        return loaded
