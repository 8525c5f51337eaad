"""Which ranks share a node, and which rank owns which weight-passing chunk. Pure.

Ranks are numbered node by node: rank ``r`` is local rank ``r mod S`` on node ``r // S`` (``S`` processes
per node, ``D`` nodes), as torchrun and Slurm number them. A *rail* is the set of ranks with one local rank
on every node: on clusters with one network card per device, the ranks a card connects across nodes.

Chunk ownership is TawPipe's device-bound storage (Wu & Chen, AAAI 2026): chunk ``c`` lives on rank
``(c mod D)·S + ⌊c / D⌋``, so the ``D`` consecutive chunks of local rank ``j`` are spread over the nodes of
rail ``j``: consecutive chunks come from different nodes, and a chunk crosses nodes once, along its rail.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeTopology:
    """``world_size`` ranks in nodes of ``processes_per_node``."""

    world_size: int
    processes_per_node: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.processes_per_node < 1 or self.world_size % self.processes_per_node:
            raise ValueError(
                f"processes_per_node={self.processes_per_node} must divide the world size ({self.world_size})"
            )

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.processes_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.processes_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.processes_per_node

    def node_ranks(self, node: int) -> tuple[int, ...]:
        start = node * self.processes_per_node
        return tuple(range(start, start + self.processes_per_node))

    def rail_ranks(self, local_rank: int) -> tuple[int, ...]:
        return tuple(node * self.processes_per_node + local_rank for node in range(self.num_nodes))

    def chunk_owner(self, chunk: int) -> int:
        """The rank holding chunk ``chunk``'s weights, gradients and optimizer state (one chunk per rank)."""
        if not 0 <= chunk < self.world_size:
            raise ValueError(f"chunk {chunk} out of range: there is one chunk per rank ({self.world_size})")
        return (chunk % self.num_nodes) * self.processes_per_node + chunk // self.num_nodes

    def rail_member(self, chunk: int, node: int) -> int:
        """The rank of ``node`` on the owner's rail: where ``chunk`` enters that node and its gradient leaves it."""
        return node * self.processes_per_node + self.local_rank(self.chunk_owner(chunk))
