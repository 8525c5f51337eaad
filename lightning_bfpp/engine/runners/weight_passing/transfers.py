"""Weight passing's communication: chunks fetched from their owners and gradients sent back, along the node
topology (rails across nodes, a broadcast or reduce inside each), each kind on a thread and groups of its own."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from lightning_bfpp.engine.process_groups import reused_subgroup
from lightning_bfpp.engine.runners.weight_passing.chunks import ChunkWeights
from lightning_bfpp.plan.topology import NodeTopology

TopologyGroups = tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]  # (node group, rail group)


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


def topology_groups(topology: NodeTopology, purpose: str) -> TopologyGroups:
    """This rank's node group and rail group for ``purpose``, None where it would hold this rank alone.

    A collective the first time (see :func:`~lightning_bfpp.engine.process_groups.reused`): every rank creates
    every group, in the same order. Called once for fetches and once for reductions: two threads must not
    share a group, or ranks could issue their operations in different orders.
    """
    nodes = [topology.node_ranks(n) for n in range(topology.num_nodes)]
    rails = [topology.rail_ranks(j) for j in range(topology.processes_per_node)]
    node_group = reused_subgroup(f"{purpose}/nodes", nodes)
    rail_group = reused_subgroup(f"{purpose}/rails", rails)
    return (
        node_group if topology.processes_per_node > 1 else None,
        rail_group if topology.num_nodes > 1 else None,
    )
