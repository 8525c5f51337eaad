"""Training loaders for the resume tests (``RunSpec.loader_factory``), and processes killed while saving.

Each factory is called as ``f(run, trainer)`` in the worker, before ``trainer.fit``, and returns the
training loader. The data are ``tests.models.RegressionData`` items as dicts carrying ``"index"``, so the
worker records which samples each rank saw at each step.

- :func:`stateful_loader`: torchdata's ``StatefulDataLoader`` over the map-style data; Lightning puts its
  ``DistributedSampler`` in, as for a plain ``DataLoader``.
- :func:`sharded_stream_loader`: an ``IterableDataset`` that shards by data-parallel replica itself, from
  ``trainer.strategy.distributed_sampler_kwargs``, with a state of its own that differs between replicas.
- :func:`noisy_loader`: a map-style dataset with a state of its own (an augmentation generator seeded by
  the replica).

``run.data`` may also hold ``"kill"`` (``{"where": "dcp_write" | "between_renames", "rank": r, "step": s,
"marker": path}``): the process of global rank ``r`` then kills itself with SIGKILL at that point of the
checkpoint save after step ``s``, after writing ``marker`` to show that it got there; or ``"fail_metadata"``
(``{"rank": r, "step": s}``): writing ``meta.pt`` raises on that rank at that save.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.utils.data import Dataset, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_bfpp.engine.checkpoint import saving as checkpoint_saving
from tests.models import DataSpec, ModelSpec, RegressionData, RunSpec

_DATA_FIELDS = {f.name for f in dataclasses.fields(DataSpec)}


def _data(run: RunSpec) -> RegressionData:
    spec = DataSpec(**{k: v for k, v in run.data.items() if k in _DATA_FIELDS})
    model = ModelSpec(**run.model)
    return RegressionData(dataclasses.replace(spec, batch_format="dict"), model.in_dim, model.out_dim)


def _replica(trainer: L.Trainer) -> tuple[int, int]:
    """(data-parallel rank, replica count), as Lightning's samplers get them; valid once ``fit`` set up."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}  # None on one device
    return int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1))


class ShardedStream(IterableDataset):
    """Replica ``r`` of ``R`` reads positions ``r, r + R, …`` of a per-epoch permutation of the samples.

    Its state (``state_dict``/``load_state_dict``, which ``StatefulDataLoader`` saves) is the epoch and the
    next position, a global one: replica 0's state given to replica 1 would make it read replica 0's share.
    An epoch that reached its end rolls over to the next when iterated again.
    """

    def __init__(self, data: RegressionData, trainer: L.Trainer, seed: int = 0) -> None:
        self.data, self.trainer, self.seed = data, trainer, seed
        self.epoch = 0
        self.position: int | None = None

    def __len__(self) -> int:
        # a known length keeps Lightning from fetching a batch ahead, which would put the saved state one batch on
        rank, replicas = _replica(self.trainer)
        return len(range(rank, len(self.data), replicas))

    def __iter__(self) -> Any:
        rank, replicas = _replica(self.trainer)
        if self.position is None:
            self.position = rank
        if self.position >= len(self.data):
            self.epoch, self.position = self.epoch + 1, rank
        order = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        while self.position < len(self.data):
            index = int(order[self.position])
            self.position += replicas
            yield self.data[index]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


class NoisyData(Dataset):
    """The samples with fresh input noise at every read, drawn from a generator seeded by the replica: an
    augmentation whose state (the generator's) differs between replicas and moves on with every sample."""

    def __init__(self, data: RegressionData, trainer: L.Trainer, seed: int = 5) -> None:
        self.data, self.trainer, self.seed = data, trainer, seed
        self._generator: torch.Generator | None = None

    def _draws(self) -> torch.Generator:
        if self._generator is None:
            rank, _ = _replica(self.trainer)
            self._generator = torch.Generator().manual_seed(1000 * self.seed + rank)
        return self._generator

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = dict(self.data[index])
        item["x"] = item["x"] + 0.3 * torch.randn(item["x"].shape, generator=self._draws())
        return item

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self._draws().get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._draws().set_state(state["generator"])


def stateful_loader(run: RunSpec, trainer: L.Trainer) -> StatefulDataLoader:
    _add_failures(run, trainer)
    return StatefulDataLoader(_data(run), batch_size=run.local_batch_size)


def sharded_stream_loader(run: RunSpec, trainer: L.Trainer) -> StatefulDataLoader:
    _add_failures(run, trainer)
    return StatefulDataLoader(ShardedStream(_data(run), trainer), batch_size=run.local_batch_size)


def noisy_loader(run: RunSpec, trainer: L.Trainer) -> StatefulDataLoader:
    _add_failures(run, trainer)
    return StatefulDataLoader(NoisyData(_data(run), trainer), batch_size=run.local_batch_size)


# -- failures while saving --------------------------------------------------------------------------


def _die(marker: str, rank: int) -> None:
    Path(f"{marker}.rank{rank}").write_text("killed\n")
    os.kill(os.getpid(), signal.SIGKILL)


class KillWhileSaving(L.Callback):
    """Arms, on one rank, a SIGKILL at one point of the checkpoint save that follows step ``step``.

    Armed in ``on_train_batch_start`` of that step, because ``ModelCheckpoint`` saves in its
    ``on_train_batch_end``, which runs before this callback's (it was added after the Trainer sorted them).
    """

    def __init__(self, where: str, rank: int, step: int, marker: str) -> None:
        if where not in ("dcp_write", "between_renames"):
            raise ValueError(f"unknown kill point {where!r}")
        self.where, self.rank, self.step, self.marker = where, rank, step, marker

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step - 1:
            return
        rank, marker = trainer.global_rank, self.marker
        if self.where == "dcp_write":
            write_data = FileSystemWriter.write_data

            def write_then_die(writer: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
                write_data(writer, *args, **kwargs)  # this rank's file is on disk, the checkpoint unfinished
                _die(marker, rank)

            FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
        else:
            rename = Path.rename

            def die_before_second_rename(source: Path, target: Any) -> Any:
                target = Path(target)
                # the swap's second rename: the previous checkpoint was just moved to <target>.old
                if source.name.endswith(".tmp") and not target.exists() and _old(target).exists():
                    _die(marker, rank)
                return rename(source, target)

            Path.rename = die_before_second_rename  # type: ignore[method-assign]


def _old(path: Path) -> Path:
    return path.with_name(path.name + ".old")


class FailMetadataWrite(L.Callback):
    """Makes writing ``meta.pt`` raise on one rank at the save after step ``step`` (a full disk, say)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step
        self.original = checkpoint_saving._write_metadata

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step - 1:

            def broken(*args: Any, **kwargs: Any) -> None:
                raise OSError("injected failure: no space left on device while writing meta.pt")

            checkpoint_saving._write_metadata = broken

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        checkpoint_saving._write_metadata = self.original  # the next runs in these processes save normally

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        checkpoint_saving._write_metadata = self.original


def _add_failures(run: RunSpec, trainer: L.Trainer) -> None:
    if kill := run.data.get("kill"):
        trainer.callbacks.append(KillWhileSaving(kill["where"], kill["rank"], kill["step"], kill["marker"]))
    if fail := run.data.get("fail_metadata"):
        trainer.callbacks.append(FailMetadataWrite(fail["rank"], fail["step"]))
