"""Weight passing (WeiPipe, PPoPP 2025; TawPipe, AAAI 2026): the weights travel, the activations stay.

Every rank trains on its own micro-batches, one at a time, through the whole model: forward through the
chunks ``0 … n−1`` (one chunk per rank), backward through ``n−1 … 0``. Each chunk's fp32 weights, gradients
and optimizer state live on one owner (:meth:`NodeTopology.chunk_owner`); before a chunk is computed its
weights are fetched, and after its backward its gradient is sent back to the owner, along TawPipe's
topology:

- fetch: the owner sends the chunk once along its rail to every other node (point-to-point), then each
  node broadcasts it from its rail member to the node's ranks;
- gradient: a reduce inside each node to the rail member, then one point-to-point transfer along the rail
  to the owner, who adds the nodes' sums.

A chunk's persistent buffers (its state in ``state_dict``, e.g. running statistics) are its owner's too and
travel with every fetch, packed as bytes after the weights. They cannot follow one device exactly: every rank
runs its own micro-batches through a chunk at once, where one device would run all of them one after another,
each updating the buffers the next one reads. What this package does instead is DDP's ``broadcast_buffers``
with the chunk's owner as the source:

- the owner's forwards update its buffers, once per micro-batch, in micro-batch order (the backward's
  recomputation runs with the values the forward saw and leaves them as they were): the running statistics
  of one device that ran the owner's micro-batches alone;
- every other rank computes with the owner's values as fetched for that visit (with ``prefetch_stages`` 0 or
  1: those the owner computes the same micro-batch with), and its forward leaves them unchanged: its own
  updates are dropped, like a DDP replica's that rank 0's broadcast overwrites;
- checkpoints hold the owner's buffers, and between fetches every rank's copy is the owner's last sent one.

So a running statistic counts ``1 / world_size`` of the samples one device would. Non-persistent buffers
(derived constants, which ``state_dict`` leaves out) take the owner's values once, at setup, and stay each
rank's own.

Nothing of a chunk's forward is stored but its input: its backward recomputes the forward (with the random
state the forward had) and then frees the graph, so a rank holds its own chunk, at most ``prefetch + 1``
fetched chunks and the chunk inputs of one micro-batch. The last chunk's forward keeps its graph, since its
backward follows at once. Fetches run on one communication thread and gradient reductions on another, each
in the schedule's order (identical on every rank) and on process groups of its own, so a fetch overlaps the
computation before it and is never queued behind a reduction (which completes only when the slowest rank
has finished that chunk's backward); the main thread waits only where the weights are needed, and for the
gradients once, before the optimizer.

Written here, not taken from torch: ``torch.distributed.pipelining`` passes activations between ranks and
FSDP2 shards every parameter over all ranks (an all-gather of slices); neither moves whole chunks from an
owner along a node topology. The action lists are this package's own (the ``"weight_passing"`` schedule kind,
:mod:`lightning_bfpp.plan.schedules.weight_passing`), the same ones the planner simulates. This module is that
kind's runner: :func:`place_chunks` builds a rank's part, :class:`WeightPassingExecutor` runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_bfpp.engine._compat import tree_flatten
from lightning_bfpp.engine.executors import LossFn
from lightning_bfpp.engine.initial_state import Broadcast, PendingBuild, buffers_outside, local_state, pack, unpack
from lightning_bfpp.engine.layers import StageModule, layer_weights, materialize_meta
from lightning_bfpp.engine.pipeline import Pipeline
from lightning_bfpp.engine.placing import Build, BuildContext, finish_module, keep_layers
from lightning_bfpp.engine.random_state import RandomStateSnapshot
from lightning_bfpp.engine.tied import TieGroup, retie
from lightning_bfpp.plan.actions import Action, Kind, Schedule
from lightning_bfpp.plan.plan import Plan
from lightning_bfpp.plan.topology import NodeTopology

TopologyGroups = tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]  # (node group, rail group)


class ChunkWeights:
    """One chunk's parameters on this rank: the real values on its owner; elsewhere storage only while the
    schedule holds the chunk (the parameters' ``.data`` become views of the received buffer, then empty).

    ``buffers``: the chunk's persistent buffers, which travel with the weights (see the module's docstring);
    every rank keeps their storage, they are small.
    """

    def __init__(self, params: Sequence[nn.Parameter], owned: bool, buffers: Sequence[torch.Tensor] = ()) -> None:
        self.params = list(params)
        self.owned = owned
        self.buffers = list(buffers)
        self.buffer_bytes = sum(b.numel() * b.element_size() for b in self.buffers)
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.numel = sum(self.numels)
        self.dtype = self.params[0].dtype if self.params else torch.float32
        if any(p.dtype != self.dtype for p in self.params):
            raise TypeError(
                "BFPPStrategy(schedule='weight_passing'): a chunk's parameters travel as one buffer and must share"
                f" one dtype; this chunk mixes {sorted({str(p.dtype) for p in self.params})}."
            )
        self.device = self.params[0].device if self.params else torch.device("cpu")
        if not owned:
            self.release()

    def flat_values(self) -> torch.Tensor:
        """The owner's weights as one buffer to send."""
        if not self.params:
            return torch.empty(0, dtype=self.dtype, device=self.device)
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def borrow(self, flat: torch.Tensor) -> None:
        """Point the parameters at a received buffer."""
        for p, view, shape in zip(self.params, flat.split(self.numels), self.shapes, strict=True):
            p.data = view.view(shape)

    def flat_buffers(self) -> torch.Tensor | None:
        """The buffers' current values as one byte buffer to send, or None for a chunk without buffers."""
        return pack(self.buffers) if self.buffer_bytes else None

    def load_buffers(self, flat: torch.Tensor | None) -> None:
        """Take the values of a received :meth:`flat_buffers`."""
        if flat is not None:
            unpack(flat, self.buffers)

    def save_buffers(self) -> list[torch.Tensor]:
        """A copy of the buffers' values, for :meth:`restore_buffers`."""
        return [b.detach().clone() for b in self.buffers]

    @torch.no_grad()
    def restore_buffers(self, saved: Sequence[torch.Tensor]) -> None:
        for buffer, value in zip(self.buffers, saved, strict=True):
            buffer.copy_(value)

    def release(self) -> None:
        for p in self.params:
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)
            p.grad = None

    def take_gradient(self) -> torch.Tensor:
        """This micro-batch's gradient of the chunk as one buffer (zeros where a parameter got none)."""
        parts = [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros(n, dtype=self.dtype, device=self.device)
            for p, n in zip(self.params, self.numels, strict=True)
        ]
        for p in self.params:
            p.grad = None
        return torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype, device=self.device)

    def add_gradient(self, flat: torch.Tensor) -> None:
        """Add ``flat`` to the owner's accumulated gradients (``.grad``)."""
        for p, part in zip(self.params, flat.split(self.numels), strict=True):
            part = part.view(p.shape).to(p.dtype)
            p.grad = part.clone() if p.grad is None else p.grad.add_(part)


class ChunkTransfers:
    """Fetches chunks to this rank and returns their gradients to the owners, on one communication thread.

    ``chunks[c]`` is this rank's :class:`ChunkWeights` of chunk ``c``. Groups come from :meth:`connect`: for
    fetches and for reductions each, this rank's node and its rail (None where a group would be this rank
    alone). Gradients are averaged over the
    world (each rank's loss is its own micro-batches' mean), like FSDP2's reduce-scatter.
    """

    def __init__(
        self,
        chunks: Sequence[ChunkWeights],
        topology: NodeTopology,
        rank: int,
    ) -> None:
        self.chunks = list(chunks)
        self.topology = topology
        self.rank = rank
        self.node_group: dist.ProcessGroup | None = None  # the fetches' groups
        self.rail_group: dist.ProcessGroup | None = None
        self.reduce_node_group: dist.ProcessGroup | None = None  # the reductions' groups
        self.reduce_rail_group: dist.ProcessGroup | None = None
        self._executors: dict[str, ThreadPoolExecutor] = {}
        self._fetches: dict[int, Future[tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self._resident: set[int] = {c for c, chunk in enumerate(self.chunks) if chunk.owned}
        self._pending: list[tuple[int, Future[None]]] = []  # (chunk, its reduction) in the order issued
        self._sums: dict[int, torch.Tensor] = {}  # the owner's gradient sums since the last finish()

    # -- the communication thread ------------------------------------------------------------------

    def _submit(self, thread: str, job: Callable[[], Any]) -> Future[Any]:
        if thread not in self._executors:
            self._executors[thread] = ThreadPoolExecutor(1, thread_name_prefix=f"bfpp-{thread}")
        return self._executors[thread].submit(job)

    def connect(self, fetch_groups: TopologyGroups, reduce_groups: TopologyGroups) -> None:
        """Set the (node, rail) groups of fetches and of reductions (created after setup's agreement, see
        :func:`topology_groups`)."""
        self.node_group, self.rail_group = fetch_groups
        self.reduce_node_group, self.reduce_rail_group = reduce_groups

    def _fetch_job(self, chunk: int, buffers: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunk's weights, and its buffers (``buffers``: the owner's values, taken when the fetch was issued)."""
        weights = self.chunks[chunk]
        if self.rank == self.topology.chunk_owner(chunk):
            sent = self._route(chunk, weights.flat_values())
            return sent, self._route(chunk, buffers) if buffers is not None else None
        received = self._route(chunk, torch.empty(weights.numel, dtype=weights.dtype, device=weights.device))
        if not weights.buffer_bytes:
            return received, None
        return received, self._route(chunk, torch.empty(weights.buffer_bytes, dtype=torch.uint8, device=weights.device))

    def _route(self, chunk: int, buffer: torch.Tensor) -> torch.Tensor:
        """Fill ``buffer`` with the owner's: along the rail to every other node, then inside each node."""
        topo, me = self.topology, self.rank
        owner = topo.chunk_owner(chunk)
        owner_node, my_node = topo.node_of(owner), topo.node_of(me)
        sends = []
        if me == owner:  # once along the rail to every other node
            for node in range(topo.num_nodes):
                if node != owner_node:
                    sends.append(dist.isend(buffer, dst=topo.rail_member(chunk, node), group=self.rail_group))
        elif my_node != owner_node and me == topo.rail_member(chunk, my_node):
            dist.irecv(buffer, src=owner, group=self.rail_group).wait()
        if self.node_group is not None:  # then inside each node from where it entered
            source = owner if my_node == owner_node else topo.rail_member(chunk, my_node)
            dist.broadcast(buffer, src=source, group=self.node_group)
        for work in sends:
            work.wait()
        return buffer

    def _reduce_job(self, chunk: int, gradient: torch.Tensor) -> None:
        topo, me = self.topology, self.rank
        owner = topo.chunk_owner(chunk)
        owner_node, my_node = topo.node_of(owner), topo.node_of(me)
        gathered_at = owner if my_node == owner_node else topo.rail_member(chunk, my_node)
        if self.reduce_node_group is not None:  # the node's sum, at the rank on the owner's rail
            dist.reduce(gradient, dst=gathered_at, op=dist.ReduceOp.SUM, group=self.reduce_node_group)
        if me == owner:
            received = []
            for node in range(topo.num_nodes):
                if node != owner_node:
                    buffer = torch.empty_like(gradient)
                    received.append(
                        (buffer, dist.irecv(buffer, src=topo.rail_member(chunk, node), group=self.reduce_rail_group))
                    )
            for buffer, work in received:
                work.wait()
                gradient += buffer
            total = self._sums.get(chunk)
            self._sums[chunk] = gradient if total is None else total.add_(gradient)
        elif me == gathered_at and my_node != owner_node:
            dist.isend(gradient, dst=owner, group=self.reduce_rail_group).wait()

    # -- the schedule's actions (main thread) ------------------------------------------------------

    def fetch(self, chunk: int) -> None:
        """Start fetching ``chunk`` (every rank takes part, the owner too); no-op if it is here or on its way."""
        weights = self.chunks[chunk]
        if chunk in self._fetches or (chunk in self._resident and not weights.owned):
            return
        # the owner's buffers as they are now, in the schedule's order: the forwards after this one change them
        buffers = weights.flat_buffers() if weights.owned else None
        self._fetches[chunk] = self._submit("fetch", lambda: self._fetch_job(chunk, buffers))

    def ready(self, chunk: int) -> None:
        """Wait until ``chunk``'s weights are here."""
        future = self._fetches.pop(chunk, None)
        if future is not None:
            weights, buffers = future.result()
            if not self.chunks[chunk].owned:
                self.chunks[chunk].borrow(weights)
                self.chunks[chunk].load_buffers(buffers)
            self._resident.add(chunk)
        if chunk not in self._resident:
            raise RuntimeError(f"lightning_bfpp: chunk {chunk} computed without being fetched first")

    def release(self, chunk: int) -> None:
        """Free a borrowed chunk's weights (the owner keeps its own)."""
        if chunk in self._fetches:
            self.ready(chunk)
        if not self.chunks[chunk].owned:
            self.chunks[chunk].release()
            self._resident.discard(chunk)

    def reduce(self, chunk: int, gradient: torch.Tensor) -> None:
        """Send this micro-batch's gradient of ``chunk`` to its owner (in the background)."""
        self._pending.append((chunk, self._submit("reduce", lambda: self._reduce_job(chunk, gradient))))

    def wait_reduced(self, chunk: int) -> None:
        """Wait until ``chunk``'s reductions issued so far are done (the action list's ``WAIT_REDUCE_GRAD``: the
        gradient buffer they send is free again). The gradients reach ``.grad`` at :meth:`finish`."""
        waiting = [future for c, future in self._pending if c == chunk]
        self._pending = [(c, future) for c, future in self._pending if c != chunk]
        for future in waiting:
            future.result()

    def finish(self) -> None:
        """Wait for every transfer issued so far; add the gradients that reached this rank to its chunk's
        ``.grad`` (averaged over the world). Raises the first transfer's error."""
        pending, self._pending = self._pending, []
        fetches, self._fetches = self._fetches, {}
        error: BaseException | None = None
        for future in [*(future for _, future in pending), *fetches.values()]:
            try:
                future.result()
            except BaseException as exc:  # wait for the others before raising
                error = error or exc
        sums, self._sums = self._sums, {}
        if error is not None:
            raise error
        world = self.topology.world_size
        for chunk, total in sums.items():
            self.chunks[chunk].add_gradient(total.div_(world))

    def release_all(self) -> None:
        for chunk in list(self._resident | set(self._fetches)):
            self.release(chunk)

    def close(self) -> None:
        self.finish()
        for executor in self._executors.values():
            executor.shutdown(wait=True)
        self._executors.clear()


def _no_range(name: str) -> Any:
    return nullcontext()


def _requiring_grad(values: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(
        v.detach().requires_grad_(True) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in values
    )


def _as_args(output: Any) -> tuple[Any, ...]:
    return output if isinstance(output, tuple) else (output,)


class WeightPassingRunner:
    """Runs one rank's lowered weight-passing action list over the caller's micro-batches.

    The interface is the one :class:`lightning_bfpp.engine.pipeline.Pipeline` uses for torch's runtime:
    ``run(arg_mbs, kwarg_mbs, targets)``, ``loss_fn(output, target)`` called on the last chunk's output
    of every micro-batch (its result, already scaled, is what the backward starts from), and
    ``last_inputs``. ``action_range(name)`` wraps each action (the trace's hook).

    Each backward's parameter gradient is handed to the chunk's owner by the action list's REDUCE_GRAD. A list
    without any (one process, which owns every chunk: nothing is sent, see ``Plan.lowered``)
    leaves the gradients accumulating in ``.grad``, as on one device.
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        actions: Sequence[Action],
        num_microbatches: int,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        transfers: ChunkTransfers,
        *,
        backward: bool,
        device: torch.device,
    ) -> None:
        self.chunks = list(chunks)
        self.actions = list(actions)
        self.num_microbatches = num_microbatches
        self.loss_fn = loss_fn
        self.transfers = transfers
        self.backward = backward
        self.device = device
        self.inferring_metadata = False  # no shape inference: nothing is sent
        self.reduces = any(action.kind is Kind.REDUCE_GRAD for action in self.actions)
        self.last_inputs: tuple[list[Any], list[Any]] | None = None
        self.action_range: Callable[[str], Any] = _no_range
        self._ready = transfers.ready

    @contextmanager
    def hooked(
        self,
        *,
        action_range: Callable[[Callable[[str], Any]], Callable[[str], Any]],
        p2p_wait: Callable[[Callable[..., Any]], Callable[..., Any]],
        weight_wait: Callable[[Callable[..., Any]], Callable[..., Any]],
    ) -> Iterator[None]:
        """Route each action and each wait for a chunk's weights through the trace's wrappers (there are no
        point-to-point waits: ``p2p_wait`` is not used)."""
        self.action_range, self._ready = action_range(_no_range), weight_wait(self.transfers.ready)
        try:
            yield
        finally:
            self.action_range, self._ready = _no_range, self.transfers.ready

    def run(
        self,
        arg_mbs: list[tuple[Any, ...]] | None,
        kwarg_mbs: list[dict[str, Any]] | None,
        target_mbs: list[torch.Tensor],
    ) -> None:
        assert arg_mbs is not None and kwarg_mbs is not None
        last = len(self.chunks) - 1
        outputs: dict[tuple[int, int], Any] = {}  # a chunk's output, waiting for the next chunk's forward
        saved: dict[tuple[int, int], Any] = {}  # what a chunk's backward starts from
        grads: dict[tuple[int, int], tuple[Any, ...]] = {}  # gradients of a chunk's output
        chunk_grads: dict[int, torch.Tensor] = {}  # a backward's parameter gradient, until its REDUCE_GRAD
        try:
            for action in self.actions:
                with self.action_range(f"PP:{action}"):  # torch's range name, which the trace reads
                    c, kind, mb = action.stage, action.kind, action.microbatch
                    if kind is Kind.UNSHARD:
                        self.transfers.fetch(c)
                    elif kind is Kind.RESHARD:
                        self.transfers.release(c)
                    elif kind is Kind.REDUCE_GRAD:
                        self.transfers.reduce(c, chunk_grads.pop(c))
                    elif kind is Kind.WAIT_REDUCE_GRAD:
                        self.transfers.wait_reduced(c)
                    elif kind is Kind.FORWARD:
                        assert mb is not None
                        args = arg_mbs[mb] if c == 0 else _as_args(outputs.pop((c - 1, mb)))
                        kwargs = kwarg_mbs[mb]
                        self._ready(c)
                        weights = self.transfers.chunks[c]
                        # the buffers this forward computes with: what its recomputation must see again, and on
                        # a borrower what its forward must leave (the owner's values, see the module docstring)
                        before = weights.save_buffers()
                        if self.backward and c == last:
                            inputs = _requiring_grad(args)
                            output = self.chunks[c](*inputs, **kwargs)
                            # a borrower's buffers are restored after the backward: its graph may hold them
                            saved[(c, mb)] = (inputs, self.loss_fn(output, target_mbs[mb]), before)
                        elif self.backward:
                            state = RandomStateSnapshot(self.device)
                            with torch.no_grad():
                                outputs[(c, mb)] = self.chunks[c](*args, **kwargs)
                            saved[(c, mb)] = (args, kwargs, state, before)
                            if not weights.owned:
                                weights.restore_buffers(before)
                        else:
                            with torch.no_grad():
                                output = self.chunks[c](*args, **kwargs)
                            if not weights.owned:
                                weights.restore_buffers(before)
                            if c == last:
                                self.loss_fn(output, target_mbs[mb])
                            else:
                                outputs[(c, mb)] = output
                    elif kind is Kind.BACKWARD:
                        assert mb is not None
                        self._ready(c)
                        weights = self.transfers.chunks[c]
                        accumulated = [p.grad for p in weights.params]
                        if self.reduces:  # the owner's accumulated gradients step aside: only this backward's is sent
                            for p in weights.params:
                                p.grad = None
                        if c == last:
                            inputs, loss, before = saved.pop((c, mb))
                            loss.backward()
                            if not weights.owned:
                                weights.restore_buffers(before)
                        else:
                            args, kwargs, state, before = saved.pop((c, mb))
                            inputs = _requiring_grad(args)
                            # recompute with the buffers the forward saw, and leave them as they are now: the
                            # forward's update counts once
                            current = weights.save_buffers()
                            weights.restore_buffers(before)
                            with state.restored(), torch.enable_grad():
                                output = self.chunks[c](*inputs, **kwargs)
                            pairs = [
                                (o, g)
                                for o, g in zip(tree_flatten(output)[0], grads.pop((c, mb)), strict=True)
                                if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
                            ]
                            if pairs:
                                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                            weights.restore_buffers(current)
                        if c > 0:
                            grads[(c - 1, mb)] = tuple(
                                i.grad if isinstance(i, torch.Tensor) and i.requires_grad else None for i in inputs
                            )
                        if self.reduces:
                            chunk_grads[c] = weights.take_gradient()
                            for p, grad in zip(weights.params, accumulated, strict=True):
                                p.grad = grad
        finally:
            self.transfers.release_all()


def topology_groups(topology: NodeTopology) -> TopologyGroups:
    """This rank's node group and rail group, None where it would hold this rank alone.

    A collective: every rank creates every group, in the same order. Called once for fetches and once for
    reductions: two threads must not share a group, or ranks could issue their operations in different orders.
    """
    nodes = [list(topology.node_ranks(n)) for n in range(topology.num_nodes)]
    rails = [list(topology.rail_ranks(j)) for j in range(topology.processes_per_node)]
    node_group, _ = dist.new_subgroups_by_enumeration(nodes)
    rail_group, _ = dist.new_subgroups_by_enumeration(rails)
    return (
        node_group if topology.processes_per_node > 1 else None,
        rail_group if topology.num_nodes > 1 else None,
    )


def chunk_buffers(chunk: nn.Module) -> list[torch.Tensor]:
    """The chunk's persistent buffers (those its ``state_dict`` holds), each once: what travels with it."""
    persistent = {id(t) for t in chunk.state_dict(keep_vars=True).values()}
    return [b for b in local_state([chunk], parameters=False) if id(b) in persistent]


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
        self.transfers.connect(topology_groups(topology), topology_groups(topology))

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


BATCH_STATISTICS_NOTE = (
    " Under weight passing a layer's running statistics are its chunk owner's, updated by the owner's"
    " micro-batches only (see lightning_bfpp.engine.weight_passing)."
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
            materialize_meta(layer, device)
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
