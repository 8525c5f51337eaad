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
kind's runner, registered as ``"weight_passing"``: :func:`~.placement.place_chunks` builds a rank's part
(:mod:`.chunks`: a chunk's weights on a rank; :mod:`.transfers`: fetches and gradient reductions), and
:class:`~.placement.WeightPassingExecutor` runs it with :class:`~.interpreter.WeightPassingRunner`.
"""

from lightning_bfpp.engine.runners.base import Runner, register_runner
from lightning_bfpp.engine.runners.weight_passing.chunks import ChunkWeights, chunk_buffers
from lightning_bfpp.engine.runners.weight_passing.interpreter import WeightPassingRunner
from lightning_bfpp.engine.runners.weight_passing.placement import (
    BATCH_STATISTICS_NOTE,
    WeightPassingExecutor,
    follow_mode,
    place_chunks,
)
from lightning_bfpp.engine.runners.weight_passing.transfers import ChunkTransfers, TopologyGroups, topology_groups

__all__ = [
    "BATCH_STATISTICS_NOTE",
    "ChunkTransfers",
    "ChunkWeights",
    "TopologyGroups",
    "WeightPassingExecutor",
    "WeightPassingRunner",
    "chunk_buffers",
    "follow_mode",
    "place_chunks",
    "topology_groups",
]

WEIGHT_PASSING = register_runner(
    Runner("weight_passing", place_chunks, replicas_keep_statistics=False, statistics_note=BATCH_STATISTICS_NOTE)
)
