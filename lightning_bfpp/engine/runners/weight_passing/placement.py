"""Weight passing's build: keep the owned chunk in the module, the others beside it without storage, and the
executor the pipeline runs them with (see :mod:`lightning_bfpp.engine.runners.weight_passing`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_bfpp.engine.executors import LossFn
from lightning_bfpp.engine.initial_state import Broadcast, PendingBuild, buffers_outside, local_state
from lightning_bfpp.engine.layers import StageModule, layer_weights, materialize_meta
from lightning_bfpp.engine.pipeline import Pipeline
from lightning_bfpp.engine.placing import Build, BuildContext, finish_module, keep_layers
from lightning_bfpp.engine.runners.weight_passing.chunks import ChunkWeights, chunk_buffers
from lightning_bfpp.engine.runners.weight_passing.interpreter import WeightPassingRunner
from lightning_bfpp.engine.runners.weight_passing.transfers import ChunkTransfers, topology_groups
from lightning_bfpp.engine.tied import TieGroup, retie
from lightning_bfpp.plan.actions import Schedule
from lightning_bfpp.plan.plan import Plan
from lightning_bfpp.plan.topology import NodeTopology


def follow_mode(layer: nn.Module, module: nn.Module) -> None:
    """Run ``layer`` in ``module``'s mode: a borrowed layer is not a submodule of the LightningModule, whose
    ``train()`` / ``eval()`` (Lightning's, around evaluation) would otherwise never reach it."""

    def hook(layer: nn.Module, args: Any) -> None:
        if layer.training != module.training:
            layer.train(module.training)

    layer.register_forward_pre_hook(hook)


class WeightPassingExecutor:
    """Every chunk on every rank, weights and gradients travelling (see the module docstring)."""

    def __init__(self, transfers: ChunkTransfers, device: torch.device) -> None:
        self.transfers = transfers
        self.device = device

    def build(
        self, plan: Plan, lowered: Schedule, stage_modules: Sequence[nn.Module], loss_fn: LossFn, *, train: bool
    ) -> WeightPassingRunner:
        # one rank's list: the plan has one pipeline rank, whose list every rank runs
        return WeightPassingRunner(
            stage_modules,
            lowered[0],
            plan.num_microbatches,
            loss_fn,
            self.transfers,
            backward=train,
            device=self.device,
        )

    def prefetch_first(self, stage_modules: Sequence[nn.Module]) -> None:
        self.transfers.fetch(0)  # the first chunk, the first visit of every schedule

    def connect(self) -> None:
        topology = self.transfers.topology
        # fetches and reductions each on groups of their own
        self.transfers.connect(
            topology_groups(topology, "weight_fetches"), topology_groups(topology, "weight_reductions")
        )

    @property
    def waits_at_end(self) -> bool:
        return True

    def finish(self) -> None:
        self.transfers.finish()

    def close(self) -> None:
        self.transfers.close()

    @property
    def gradient_group(self) -> Any:
        # each chunk's gradients are its owner's alone: the model's norm spans every rank
        return dist.group.WORLD if self.transfers.topology.world_size > 1 else None

    @property
    def output_group(self) -> Any:
        return None  # every rank runs its own micro-batches through the whole model

    @contextmanager
    def generation_weights(self, stage_modules: Sequence[nn.Module]) -> Iterator[None]:
        """Every chunk fetched once (in chunk order, every rank taking part, as in a step), kept for the whole call
        (each rank then decodes its own sequences through the whole model), released at its end."""
        chunks = range(len(self.transfers.chunks))
        for chunk in chunks:
            self.transfers.fetch(chunk)
        for chunk in chunks:
            self.transfers.ready(chunk)
        try:
            yield
        finally:
            for chunk in chunks:
                self.transfers.release(chunk)


BATCH_STATISTICS_NOTE = (
    " Under weight passing a layer's running statistics are its chunk owner's, updated by the owner's"
    " micro-batches only (see lightning_bfpp.engine.runners.weight_passing)."
)


def place_chunks(
    module: nn.Module,
    named: Sequence[tuple[str, nn.Module]],
    ties: list[TieGroup],
    plan: Plan,
    context: BuildContext,
) -> Build:
    """Weight passing's runner: one chunk per rank, owned whole by the rank TawPipe's placement gives it; the module
    keeps the owned layers (so the optimizer and checkpoints see exactly those), the other chunks' layers are kept
    beside it with no storage until fetched.

    A chunk's parameters and persistent buffers are its owner's: the buffers travel with every fetch, and at
    setup every buffer of a chunk (persistent or not) takes the owner's value, as do the buffers outside the
    layers global rank 0's. Borrowed layers follow the module's mode (``train()`` / ``eval()``), which a trainer
    sets on the module and so on its own layers only."""
    if ties:
        raise ValueError(
            f"BFPPStrategy(schedule='weight_passing') cannot train parameters shared by several layers yet"
            f" (`{ties[0].canonical}`); use schedule='breadth_first', which supports them."
        )
    device, me = context.device, context.global_rank
    topology = NodeTopology(context.world_size, context.processes_per_node)
    chunk_owner = [topology.chunk_owner(c) for c in range(plan.num_stages)]
    layer_stage = plan.stage_of_layer()
    owner = [chunk_owner[s] for s in layer_stage]
    local, identities = keep_layers(module, named, owner, me, context, tied_slots=range(len(named)))
    borrowed = {}
    for (name, layer), rank in zip(named, owner, strict=True):
        if rank != me:
            materialize_meta(layer, device, name=name, seed=context.base_seed)
            borrowed[name] = context.convert_module(layer.to(device))
            follow_mode(borrowed[name], module)
    tied = retie(identities, ties, layer_stage, chunk_owner)  # a layer's own ties, broken by to_empty
    finish_module(module, context)
    layers_by_name = {**local, **borrowed}
    stage_modules, chunks = [], []
    world = dist.group.WORLD if context.world_size > 1 else None
    broadcasts = [Broadcast(buffers_outside(module, [name for name, _ in named]), 0, world)]
    for c in range(plan.num_stages):
        names = plan.stage_layers(c)
        layers = [layers_by_name[name] for name in names]
        broadcasts.append(Broadcast(local_state(layers, parameters=False), chunk_owner[c], world))
        stage_module = StageModule(
            [context.prepare(layer) for layer in layers], c, names=names, is_last=c == plan.num_stages - 1
        )
        stage_modules.append(stage_module)
        chunks.append(
            ChunkWeights(
                list(stage_module.parameters()), owned=chunk_owner[c] == me, buffers=chunk_buffers(stage_module)
            )
        )
    weights = layer_weights(named)
    context.info(
        f"BFPPStrategy: schedule=weight_passing over {context.world_size} ranks ({topology.num_nodes} node(s) of"
        f" {topology.processes_per_node}), num_microbatches={plan.num_microbatches} per rank\n"
        + "\n".join(
            f"chunk {c:>3} owned by rank {chunk_owner[c]:>3}: {len(plan.stage_layers(c)):>3} layers,"
            f" {sum(weights[i] for i in plan.layer_range(c)):,} parameters"
            for c in range(plan.num_stages)
        )
    )

    def finish() -> Pipeline:
        return Pipeline(
            module,
            plan,
            stage_modules,
            context.device_mesh,
            device,
            base_seed=context.base_seed,
            step_code=context.step_code,
            executor=WeightPassingExecutor(ChunkTransfers(chunks, topology, me), device),
            agreement_timeout=context.agreement_timeout,
        )

    return Build(tied, PendingBuild(broadcasts, finish))
