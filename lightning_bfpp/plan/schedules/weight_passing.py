"""Weight passing (WeiPipe, PPoPP 2025; TawPipe, AAAI 2026): the schedule kind, its order and its cost model. Pure.

No pipeline: every rank runs its own micro-batches through the whole model while the layers, cut into one chunk
per rank and each owned by one rank, travel to it; the engine's ``"weight_passing"`` runner moves them
(:mod:`lightning_bfpp.engine.runners.weight_passing`). Everything the package knows about weight passing outside
the engine is here, registered under its name: the kind (:class:`WeightPassing`: its order
(:func:`weight_passing`), its lowering (fetch a chunk per visit, reduce its gradient to the owner after every
backward visit: :func:`reduce_every_visit`) and its options (:class:`WeightPassingOptions`)), the arguments it
fixes (:class:`WeightPassingConfig`), and what a search tries and the model below (:class:`WeightPassingModel`).

``P = D·S`` devices, ``D`` nodes of ``S``. The model's pipeline layers are cut into ``P`` chunks, balanced as
the partitioner balances stages (:func:`~lightning_bfpp.plan.partition.balance_by_weight`); chunk ``c`` is owned
by global rank ``(c mod D)·S + ⌊c/D⌋`` (:meth:`NodeTopology.chunk_owner`: TawPipe's device-bound storage, so
local rank ``j`` of every node owns chunks ``jD … jD + D − 1``, one per node: rail ``j``). Only the owner keeps the
chunk's weights in full precision, its gradients and its optimizer state.

Every device runs its own ``N`` micro-batches of ``B`` samples through the whole model, one micro-batch at
a time: forward chunks ``0 … P−2`` keeping only each chunk's input and ``P−1`` keeping its graph, then
backward ``P−1 … 0``, each but the last chunk recomputing the chunk's forward (``compute`` per visit:
``f_c`` forward, ``b_c + f_c`` backward (``b_{P−1}`` for the last chunk), or ``b_c`` where the profile's
backward already includes the recomputation). The plan is
``Plan("weight_passing", pipeline_parallel_size=1, data_parallel_size=P, stages_per_rank=P,
num_microbatches=N, microbatch_size=B)``, as the strategy lays it out: every device is its own
data-parallel replica and visits all ``P`` chunks, the stages of its one pipeline rank.

Before each visit the chunk's weights (``Ψ_c`` bytes, the profile's parameter bytes) are fetched, unless
the previous visit used the same chunk (the last forward chunk serves the first backward, and the backward
of chunk 0 the next micro-batch's forward). After each backward the chunk's gradient returns to its owner.
With latency ``λ``, collective overhead ``ω``, ``β_rail`` = :attr:`Cluster.rail_bandwidth` and ``β_intra`` the
intra-node bandwidth::

    rail_s(c)     = λ + k · Ψ_c / β_rail                          (0 when D = 1)
                    k = D − 1: the owner sends one copy to each other node, one way at a time (the runtime)
                    k = 1 with the stagger: node g runs g visits behind node 0, so every node's link sends
                      and receives one chunk per visit (not implemented by the runtime; optimistic)
    node_s(c)     = ω + (S − 1) · λ + Ψ_c / β_intra               (0 when S = 1): broadcast, or reduce
                    (a reduce at β_intra · Cluster.reduce_bandwidth_ratio)
    fetch_s(c)    = rail_s(c) + node_s(c)      owner → its rail peer on each node, then a node broadcast
    gradient_s(c) = node_s(c) + rail_s(c)      reduce to the owner's rail peer, then the rail to the owner

Timeline: the nodes run in lockstep (without the stagger all visit chunk ``c`` together), so one device's
timeline is every device's. Fetches and gradients run on a stream each, as the runtime's two communication
threads do (on process groups of their own; a rail carries a fetch one way and a gradient the other at
once), each one transfer at a time in issue order; the fetch for visit ``i + 1`` is issued when visit ``i``
starts (double buffering: one chunk computing, one arriving), a gradient when its backward ends; a visit
starts when the previous one has ended and its chunk has arrived. With the stagger the last node finishes
``D − 1`` visits after the first (``(D − 1)`` mean visit times more).

Bytes per step (:func:`traffic`; ``F`` the bytes fetched per step, with the reuse above):

    F           = N·Ψ − (N − 1)·Ψ_0  +  N·(Ψ − Ψ_{P−1})          forward sweeps + backward sweeps
    cross-node  = (D − 1) · (F + N·Ψ)  ≈ 3·N·(D − 1)·Ψ             total over all rails
    broadcast   = F − F(rail j)   received per device of local rank j (≈ 2·N·Ψ·(1 − 1/S))
    reduced     = N · (Ψ − Ψ(rail j))  sent into node reductions per device (≈ N·Ψ)

Memory per device (:func:`memory`): its own chunk's weights, gradients and optimizer state
(``Ψ_own · (2 + optimizer_state_ratio)``, as the activation pipelines count held state), two weight buffers
and two gradient buffers of the largest chunk (one computing, one in flight), the inputs of every chunk of the
micro-batch in flight, and, during a backward, the chunk's recomputed activations (``activation_bytes``):
``max_c (Σ_{c' ≤ c} input_c' + act_c)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_bfpp.plan.actions import (
    GRADIENT_KINDS,
    REDUCE_GRAD,
    WAIT_REDUCE_GRAD,
    Action,
    B,
    F,
    Schedule,
    add_sharding_actions,
)
from lightning_bfpp.plan.cluster import Cluster
from lightning_bfpp.plan.config import ConfigRules, PipelineConfig, register_config_rules
from lightning_bfpp.plan.costs import LayerCost, ModelProfile, balanced_counts, stage_costs
from lightning_bfpp.plan.mesh import MeshShape
from lightning_bfpp.plan.schedules import register
from lightning_bfpp.plan.schedules.base import PlanView, ScheduleKind, ScheduleOptions, check_sizes
from lightning_bfpp.plan.simulate import PlannerModel, Prediction, register_planner_model
from lightning_bfpp.plan.timeline import Span
from lightning_bfpp.plan.topology import NodeTopology

if TYPE_CHECKING:
    from lightning_bfpp.plan.plan import Plan
    from lightning_bfpp.plan.space import SearchSpace


@dataclass(frozen=True)
class WeightPassingOptions(ScheduleOptions):
    """Weight passing's own plan options (``Plan.options``).

    ``stagger``: node ``g`` runs ``g`` visits behind node 0, so that every node's link sends and receives one chunk
    per visit: TawPipe's node stagger, a what-if of the model below that the runtime does not run (the search
    tries it only where ``SearchSpace.options`` asks for it).
    """

    stagger: bool = False

    def describe(self) -> str:
        return "staggered" if self.stagger else ""


def options_of(plan: PlanView) -> WeightPassingOptions:
    """The plan's weight-passing options (the defaults where it holds none)."""
    options = plan.options
    return options if isinstance(options, WeightPassingOptions) else WeightPassingOptions()


def reduce_every_visit(actions: Sequence[Action]) -> list[Action]:
    """A lowered list (without reductions) with each chunk's gradients reduced to their owner after *every*
    backward visit that computed some (an input-gradient-only visit adds none): a rank then holds no gradients of
    chunks it does not own beyond one visit's. Each ``REDUCE_GRAD`` follows the visit's last action; its
    ``WAIT_REDUCE_GRAD`` comes just before the next one, or at the end, as in
    :func:`~lightning_bfpp.plan.actions.add_sharding_actions`."""
    out: list[Action] = []
    pending: int | None = None
    gradients = False
    for i, a in enumerate(actions):
        out.append(a)
        if not a.is_compute:
            continue
        gradients = gradients or a.kind in GRADIENT_KINDS
        after = actions[i + 1] if i + 1 < len(actions) else None
        if after is not None and after.is_compute and after.stage == a.stage and (after.kind is F) == (a.kind is F):
            continue  # the visit goes on
        if a.kind is not F and gradients:
            if pending is not None:
                out.append(Action(pending, WAIT_REDUCE_GRAD))
            out.append(Action(a.stage, REDUCE_GRAD))
            pending = a.stage
        gradients = False
    if pending is not None:
        out.append(Action(pending, WAIT_REDUCE_GRAD))
    return out


def weight_passing(num_chunks: int, num_microbatches: int) -> Schedule:
    """One rank's order, the same on every rank: forward through chunks ``0 … n−1``, then backward through
    ``n−1 … 0``, one micro-batch at a time. The chunks are the stages of the rank's one-rank "pipeline"
    (``pipeline_parallel_size=1``), all local."""
    _, n, m = check_sizes(1, num_chunks, num_microbatches)
    actions: list[Action] = []
    for mb in range(m):
        actions += [Action(c, F, mb) for c in range(n)]
        actions += [Action(c, B, mb) for c in reversed(range(n))]
    return {0: actions}


def chunks(profile: ModelProfile, num_chunks: int, microbatch_size: int) -> list[LayerCost]:
    """The profile's layers at ``microbatch_size``, summed into ``num_chunks`` chunks balanced by weight."""
    layers = profile.at_microbatch_size(microbatch_size)
    counts = balanced_counts([layer.param_bytes for layer in layers], num_chunks)
    return stage_costs(layers, counts)


def topology_of(cluster: Cluster) -> NodeTopology:
    """The cluster's nodes, which weight passing needs whole."""
    if cluster.num_devices % cluster.devices_per_node:
        raise ValueError(
            f"weight passing needs whole nodes: {cluster.num_devices} devices in nodes of {cluster.devices_per_node}"
        )
    return NodeTopology(cluster.num_devices, cluster.devices_per_node)


def rail_s(nbytes: float, topology: NodeTopology, cluster: Cluster, stagger: bool = False) -> float:
    """One chunk across the rail: the owner's ``D − 1`` copies one after another, or one with the stagger."""
    if topology.num_nodes == 1:
        return 0.0
    copies = 1 if stagger else topology.num_nodes - 1
    return cluster.latency_s + copies * nbytes / cluster.rail_bandwidth


def node_s(nbytes: float, topology: NodeTopology, cluster: Cluster, reduce: bool = False) -> float:
    """A broadcast (or, ``reduce``, a sum to one device, at the reductions' bandwidth) of one chunk among the
    ``S`` devices of a node."""
    if topology.processes_per_node == 1:
        return 0.0
    s = topology.processes_per_node
    bandwidth = cluster.intra_node_bandwidth * (cluster.reduce_bandwidth_ratio if reduce else 1.0)
    return cluster.collective_overhead_s + (s - 1) * cluster.latency_s + nbytes / bandwidth


def fetch_s(nbytes: float, topology: NodeTopology, cluster: Cluster, stagger: bool = False) -> float:
    return rail_s(nbytes, topology, cluster, stagger) + node_s(nbytes, topology, cluster)


def gradient_s(nbytes: float, topology: NodeTopology, cluster: Cluster, stagger: bool = False) -> float:
    """A node reduce then the rail: a fetch's two legs, the other way."""
    return node_s(nbytes, topology, cluster, reduce=True) + rail_s(nbytes, topology, cluster, stagger)


def visits(num_chunks: int, num_microbatches: int) -> list[tuple[str, int, int]]:
    """``(kind, chunk, micro-batch)`` in the order every device runs them."""
    order = []
    for mb in range(num_microbatches):
        order += [("forward", c, mb) for c in range(num_chunks)]
        order += [("backward", c, mb) for c in reversed(range(num_chunks))]
    return order


def fetched(order: Sequence[tuple[str, int, int]]) -> list[bool]:
    """Whether each visit fetches its chunk (not when the previous visit used the same one)."""
    return [i == 0 or order[i][1] != order[i - 1][1] for i in range(len(order))]


def traffic(chunk_bytes: Sequence[float], num_microbatches: int, topology: NodeTopology) -> dict[str, float]:
    """Bytes per step: ``fetched`` (``F``); ``cross_node`` over all rails together; per device, the most any
    device sends and receives on its ``rail``, receives by node ``broadcast`` and sends into node ``reduce``
    (the last two zero on one-device nodes)."""
    p, n, d, s = len(chunk_bytes), num_microbatches, topology.num_nodes, topology.processes_per_node
    order = visits(p, n)
    fetch_count = [0] * p
    for (_, c, _), needed in zip(order, fetched(order), strict=True):
        fetch_count[c] += needed
    total = sum(chunk_bytes)
    fetched_bytes = sum(k * b for k, b in zip(fetch_count, chunk_bytes, strict=True))
    rail = 0.0
    if d > 1:
        for owner_chunk in range(p):  # a device sends its chunk's copies, receives its rail's, and the gradients
            peers = [c for c in range(p) if c // d == owner_chunk // d and c != owner_chunk]
            own = (d - 1) * (fetch_count[owner_chunk] + n) * chunk_bytes[owner_chunk]
            rail = max(rail, own + sum((fetch_count[c] + n) * chunk_bytes[c] for c in peers))
    broadcast = reduce = 0.0
    if s > 1:
        for j in range(s):
            sourced = [c for c in range(p) if c // d == j]  # the chunks local rank j sources in its node
            broadcast = max(broadcast, fetched_bytes - sum(fetch_count[c] * chunk_bytes[c] for c in sourced))
            reduce = max(reduce, n * (total - sum(chunk_bytes[c] for c in sourced)))
    return {
        "fetched": fetched_bytes,
        "cross_node": (d - 1) * (fetched_bytes + n * total),
        "rail": rail,
        "broadcast": broadcast,
        "reduce": reduce,
    }


def memory(chunk_costs: Sequence[LayerCost], topology: NodeTopology, optimizer_state_ratio: float) -> int:
    """Peak bytes on the busiest device (see the module docstring)."""
    p = len(chunk_costs)
    owned = max(chunk_costs[c].param_bytes for c in range(p))  # each device owns one chunk
    buffers = 4 * max(cost.param_bytes for cost in chunk_costs)  # two weight and two gradient buffers
    inputs = 0
    activations = 0
    for c, cost in enumerate(chunk_costs):
        inputs += chunk_costs[c - 1].output_bytes if c else 0
        activations = max(activations, inputs + cost.full_activation_bytes)
    return int(owned * (2 + optimizer_state_ratio) + buffers + activations)


def simulate_weight_passing(config: Plan, profile: ModelProfile, cluster: Cluster) -> Prediction:
    """Predict one step of weight passing over the whole cluster (``config.data_parallel_size`` devices)."""
    topology = topology_of(cluster)
    shape = (config.pipeline_parallel_size, config.data_parallel_size, config.stages_per_rank)
    if shape != (1, topology.world_size, topology.world_size):
        raise ValueError(
            f"weight passing runs on every device with one chunk per device: pipeline_parallel_size=1,"
            f" data_parallel_size=stages_per_rank={topology.world_size}; got (p, dp, v) = {shape}"
        )
    p, n = topology.world_size, config.num_microbatches
    if p > profile.num_layers:
        raise ValueError(
            f"weight passing cuts the layers into one chunk per device: {p} chunks > {profile.num_layers} layers"
        )
    costs = chunks(profile, p, config.microbatch_size)
    stagger = options_of(config).stagger
    order = visits(p, n)
    needs = fetched(order)
    overhead = cluster.action_overhead_s
    spans: list[Span] = []
    fetch_free = grad_free = 0.0  # the two communication streams (the runtime's fetch and reduction threads)

    def issue_fetch(i: int, at: float) -> float:
        nonlocal fetch_free
        start = max(at, fetch_free)
        end = start + fetch_s(costs[order[i][1]].param_bytes, topology, cluster, stagger)
        fetch_free = end
        spans.append(Span(0, "gather", start, end, order[i][1]))
        return end

    # the first chunk's fetch is issued before the step's host work (step_overhead_s) and runs beside it, as
    # the runtime prefetches it
    arrival = {0: issue_fetch(0, 0.0)}
    end = cluster.step_overhead_s
    wait = 0.0
    for i, (kind, c, mb) in enumerate(order):
        cost = costs[c]
        ready = arrival.get(i, 0.0)
        start = max(end, ready)
        if ready > end:
            spans.append(Span(0, "gather_wait", end, ready, c))
            wait += ready - end
        if i + 1 < len(order) and needs[i + 1]:
            arrival[i + 1] = issue_fetch(i + 1, start)
        # the last chunk's forward keeps its graph for the backward that follows at once (as the runtime does)
        recompute = 0.0 if profile.recompute or c == p - 1 else cost.forward_s
        compute = cost.forward_s if kind == "forward" else cost.backward_s + recompute
        end = start + compute + overhead
        spans.append(Span(0, kind, start, end, c, mb))
        if kind == "backward":
            g_start = max(end, grad_free)
            g_end = g_start + gradient_s(cost.param_bytes, topology, cluster, stagger)
            grad_free = g_end
            spans.append(Span(0, "reduce", g_start, g_end, c))
    pipeline_end = max(end, fetch_free, grad_free)
    if stagger and topology.num_nodes > 1:
        busy = sum(span.duration for span in spans if span.kind in ("forward", "backward"))
        pipeline_end += (topology.num_nodes - 1) * busy / len(order)
    optimizer_s = profile.optimizer_s_per_byte * max(cost.param_bytes for cost in costs)
    step_time = pipeline_end + optimizer_s
    if end < pipeline_end:
        spans.append(Span(0, "step_sync", end, pipeline_end))
    spans.append(Span(0, "optimizer", pipeline_end, pipeline_end + optimizer_s))
    moved = traffic([cost.param_bytes for cost in costs], n, topology)
    per_device = moved["broadcast"] + moved["reduce"] + moved["rail"]
    return Prediction(
        config,
        step_time,
        wait / step_time,
        memory(costs, topology, profile.optimizer_state_ratio),
        int(per_device),
        spans,
        moved,
    )


class WeightPassing(ScheduleKind):
    name = "weight_passing"
    summary = (
        "TawPipe: no pipeline; every rank trains on its own micro-batches while the layers, one chunk per rank"
        " owned by one rank, travel to it along the node topology"
    )
    runner = "weight_passing"
    plan_options = WeightPassingOptions
    fallback = None  # any micro-batch count runs

    def generate(self, p: int, v: int, m: int, *, microbatch_group_size: int | None = None) -> Schedule:
        if p != 1:
            raise ValueError(
                "schedule='weight_passing' moves weights, not activations: it needs pipeline_parallel_size=1"
                f" (got {p}); its chunks are the stages of that one rank."
            )
        return weight_passing(v, m)

    def lower_rank(self, actions: list[Action], plan: PlanView, *, reduce_grads: bool, sharding: str) -> list[Action]:
        # a chunk's weights are fetched for a visit and freed after it (the look-ahead no longer than the
        # prefetch: TawPipe's cost model fetches once per visit); its gradient goes to its owner after every
        # backward visit, whatever `reduce_grads` (the owner accumulates)
        fetched = add_sharding_actions(
            actions, "full_shard", plan.num_microbatches, prefetch=plan.prefetch_stages, reduce_grads=False,
            keep=plan.prefetch_stages,
        )  # fmt: skip
        return reduce_every_visit(fetched)

    def describe(self, plan: PlanView) -> str:
        staggered = options_of(plan).describe()
        return (
            f"weight_passing{' ' + staggered if staggered else ''} chunks={plan.data_parallel_size}"
            f" m={plan.num_microbatches}×{plan.microbatch_size}"
        )


class WeightPassingConfig(ConfigRules):
    """The arguments weight passing fixes: one chunk per rank, every rank its own replica."""

    tensor_parallel = False

    def arguments(self, plan: Plan) -> dict[str, Any]:
        # the chunks follow the world size; only the micro-batches are the planner's to set
        return {"schedule": plan.schedule, "pipeline_parallel_size": 1, "num_microbatches": plan.num_microbatches}

    def check_config(self, config: PipelineConfig) -> None:
        fixed = {
            "pipeline_parallel_size": (config.pipeline_parallel_size, (None, 1)),
            "stages_per_rank": (config.stages_per_rank, ("auto",)),
            "data_parallel_size": (config.data_parallel_size, ("auto",)),
            "sharding": (config.sharding, ("full_shard",)),
        }
        for name, (value, allowed) in fixed.items():
            if value not in allowed:
                raise ValueError(
                    f"BFPPStrategy: schedule='weight_passing' sets `{name}` itself (every rank runs the whole model"
                    " on its own micro-batches, and the layers are cut into one chunk per rank, owned whole by one"
                    f" rank); got {name}={value!r}. Leave it at its default."
                )
        if config.tensor_parallel_size > 1:
            raise ValueError(
                f"BFPPStrategy: schedule='weight_passing' with tensor_parallel_size={config.tensor_parallel_size} is"
                " not supported: its chunks travel whole between ranks, and a tensor-parallel chunk would have to"
                " travel between matching tensor ranks of two groups. Use schedule='breadth_first' with tensor"
                " parallelism, or weight passing without it."
            )
        super().check_config(config)

    def resolve_mesh(self, config: PipelineConfig, world_size: int) -> MeshShape | None:
        return MeshShape(pipeline_parallel_size=1, data_parallel_size=world_size, mesh_order=config.mesh_order)

    def stages_per_rank_for(self, config: PipelineConfig, mesh: MeshShape, num_layers: int) -> int:
        v = mesh.data_parallel_size  # one chunk per rank
        if isinstance(config.partition, tuple) and len(config.partition) != v:
            raise ValueError(
                f"BFPPStrategy: schedule='weight_passing' cuts the layers into one chunk per rank ({v}), but"
                f" `partition` lists {len(config.partition)}."
            )
        return v

    def default_microbatches(self, mesh: MeshShape) -> int:
        return 1  # every chunk is fetched once per micro-batch: one is the fewest transfers

    def too_few_layers(self, num_layers: int, p: int, v: int) -> str:
        return (
            f"BFPPStrategy: schedule='weight_passing' cuts `pipeline_layers()` into one chunk per rank, but the"
            f" module returns {num_layers} layers for {v} ranks; use fewer processes or more layers."
        )


class WeightPassingModel(PlannerModel):
    """The model above; a search tries one chunk per device on every device, with the options the space asks for."""

    sharded = False  # the chunks' owners replace sharding; the mesh order changes nothing

    def simulate(self, plan: Plan, profile: ModelProfile, cluster: Cluster) -> Prediction:
        return simulate_weight_passing(plan, profile, cluster)

    def search_fields(
        self, kind: ScheduleKind, p: int, dp: int, m: int, space: SearchSpace
    ) -> Iterator[dict[str, Any]]:
        if p == 1:  # every device a replica visiting one chunk per device, whatever the space's stages per rank
            for options in space.options_of(kind.name, WeightPassingOptions()):
                yield {"stages_per_rank": dp, "options": options}

    def infeasible(self, plan: Plan, profile: ModelProfile, cluster: Cluster, space: SearchSpace) -> str | None:
        if cluster.num_devices % cluster.devices_per_node:
            return (
                f"weight passing needs whole nodes ({cluster.num_devices} devices, {cluster.devices_per_node} per node)"
            )
        if plan.num_stages > profile.num_layers:
            return f"{plan.num_stages} chunks > {profile.num_layers} layers"
        return None


register(WeightPassing())
register_config_rules(WeightPassing.name, WeightPassingConfig())
register_planner_model(WeightPassing.name, WeightPassingModel())
