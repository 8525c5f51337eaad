"""Simulate one training step of a configuration as an event timeline. Pure.

:func:`simulate` asks the plan's schedule for its :class:`PlannerModel` (its cost model, what a search varies
for it and refuses), registered by the schedule's name (:func:`register_planner_model`, from the schedule's own
module); a schedule that registers none gets the default, this module's model of every activation pipeline. It
executes the very action lists the runtime executes (:meth:`lightning_bfpp.plan.plan.Plan.lowered`), rank by rank,
on the ranks the kind's placement gives each stage, with this model of a device:

- compute (a stage's forward or backward of a micro-batch) runs in list order, one at a time, and waits
  for its input (the neighbour's activation or gradient) and for the stage's weights to be gathered; a
  split backward's input gradient (``I``) takes ``LayerCost.input_grad_s`` and sends the gradient on, its
  weight gradient (``W``) takes ``LayerCost.weight_grad_s`` and waits only for its ``I`` (stage 0, with no
  input gradient to compute, spends its whole backward in ``W``, as torch's runtime does), and the
  micro-batch's activations are held until its ``W``, with what the ``I`` keeps for the ``W`` beside them from
  the ``I`` on (``LayerCost.intermediate_grad_bytes``: the output gradients of the layers' weighted operations);
  a stage's output is held from its forward to its ``B`` or ``I`` beside what autograd saves (torch's stage keeps
  it for the backward, and from torch 2.15 until its send's ``WAIT_SEND_F``, which the runtime's lists put right
  after that ``B`` or ``I``: :mod:`lightning_bfpp.engine.torch_ir`; the last stage's is the loss), and the
  computing layer's transient (its temporaries, its backward's activation gradients) adds the rank's largest
  layer's activations for one micro-batch to its peak;
- a weight gather (``UNSHARD``) is issued where it stands in the list and runs on the rank's
  data-parallel stream, one collective at a time, overlapping compute; the step's first takes
  ``Cluster.first_gather_slowdown`` times as long, every rank issuing it at once beside the step's host work;
- a gradient reduction (``REDUCE_GRAD``) holds up the compute that follows it, as torch's own action does
  (and ``BFPPStrategy`` on gloo by default), or with ``Cluster.overlap_reductions`` runs beside it until the
  stage's ``WAIT_REDUCE_GRAD`` (just before the rank's next reduction, or at the end), as the strategy's
  overlapped reductions do (the default on CUDA); each rank's last takes
  ``Cluster.last_reduce_slowdown`` times as long, every rank ending its step with one beside its host work;
- activations and gradients travel point-to-point when produced, one message at a time per direction of
  each link;
- every action costs the runtime's host time (``Cluster.action_overhead_s``, and under data parallelism
  ``Cluster.data_parallel_action_overhead_s`` on top: FSDP2's hooks and copies);
- the step's own host work (``Cluster.step_overhead_s``) precedes the first compute, with the first stage's
  gather running beside it (the runtime issues it before the step's preparation);
- the step ends when every rank's work and the optimizer update are done.

``tensor_parallel_size=t`` makes each group of ``t`` consecutive devices one device of the layout: a split
layer (``LayerCost.tensor_parallel_all_reduces``) costs each of its ranks ``1/t`` of its compute and weights
plus the all-reduces of its output inside the node, in the forward and in the backward
(:meth:`~lightning_bfpp.plan.costs.LayerCost.split_over_tensor_group`); a layer that is not split costs each
rank as much as before.

``sharding="hybrid_shard"`` runs ``full_shard``'s action lists with the collectives of
:mod:`~lightning_bfpp.plan.cluster`'s hybrid model (gathers and reduce-scatters inside a node, an all-reduce
of each shard across nodes) and holds ``1/n_s`` of a stage's state instead of ``1/dp``.
``schedule="weight_passing"`` has no activation pipeline; its planner model
(:mod:`lightning_bfpp.plan.schedules.weight_passing`) simulates it.

It returns the step time, the timeline (the same spans as measured traces, so both draw alike), the time
each rank waited for its neighbours, peak memory per device (and each rank's peak of activations alone) and the
bytes each device moved.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_bfpp.plan.actions import REDUCE_GRAD, RESHARD, UNSHARD, WAIT_REDUCE_GRAD, Action, B, F, I, W
from lightning_bfpp.plan.cluster import Cluster, Links, links, tensor_all_reduce_s, tensor_groups_as_devices
from lightning_bfpp.plan.costs import LayerCost, ModelProfile, balanced_counts, stage_costs
from lightning_bfpp.plan.schedules import ByName
from lightning_bfpp.plan.timeline import Span

if TYPE_CHECKING:
    from lightning_bfpp.plan.plan import Plan
    from lightning_bfpp.plan.schedules.base import ScheduleKind
    from lightning_bfpp.plan.space import SearchSpace

HYBRID_SHARD = "hybrid_shard"


@dataclass
class Prediction:
    config: Plan
    step_time: float
    bubble_fraction: float
    peak_memory: int
    comm_bytes: int
    spans: list[Span] = field(default_factory=list, repr=False)
    # bytes per step by kind (e.g. weight passing's cross-node total); empty where not broken down
    traffic: dict[str, float] = field(default_factory=dict, repr=False)
    # per pipeline rank, the (time, ± bytes) changes behind its peak beyond the static state: activations kept
    # and freed, weights gathered and gradient buffers; empty where not simulated action by action
    memory_events: list[list[tuple[float, int]]] = field(default_factory=list, repr=False)
    # per pipeline rank, the most activation memory it holds at once (what autograd keeps for backward, and what
    # a split backward's input-gradient pass keeps for its weight pass); empty where not simulated
    activation_peaks: list[int] = field(default_factory=list, repr=False)

    @property
    def plan(self) -> Plan:
        return self.config

    @property
    def throughput(self) -> float:
        """Samples per second over the whole machine."""
        return self.config.global_batch / self.step_time


def simulate(plan: Plan, profile: ModelProfile, cluster: Cluster) -> Prediction:
    """Predict one training step of ``plan`` with its schedule's cost model (raises ``ValueError`` if the
    schedule rejects it)."""
    return planner_model(plan.schedule).simulate(plan, profile, cluster)


class PlannerModel:
    """What the planner needs of a schedule: its cost model, the plan fields a search varies for it, and what it
    refuses. The defaults here are those of the activation pipelines; a schedule overrides what differs and
    registers an instance (:func:`register_planner_model`)."""

    #: whether a search varies sharding and mesh order for it (weight passing fixes both)
    sharded: bool = True

    def simulate(self, plan: Plan, profile: ModelProfile, cluster: Cluster) -> Prediction:
        """Predict one training step of ``plan`` (raises ``ValueError`` if the schedule rejects it)."""
        return simulate_pipeline(plan, profile, cluster)

    def search_fields(
        self, kind: ScheduleKind, p: int, dp: int, m: int, space: SearchSpace
    ) -> Iterator[dict[str, Any]]:
        """The plan fields a search varies for ``kind`` at one (p, dp, m): stages per rank and options."""
        for v in space.stages_per_rank:
            if kind.stages_per_rank_choices is None or v in kind.stages_per_rank_choices:
                yield {"stages_per_rank": v}

    def infeasible(self, plan: Plan, profile: ModelProfile, cluster: Cluster, space: SearchSpace) -> str | None:
        """Why the planner cannot run ``plan`` (or None)."""
        if plan.num_stages > profile.num_layers:
            return f"{plan.num_stages} stages > {profile.num_layers} layers"
        if 2 * plan.stages_per_rank * plan.num_microbatches > space.max_actions_per_rank:
            return "too many actions to simulate"
        return None


#: ``planner_model(name)``: the planner's model of the schedule called ``name``, its own or the activation pipelines'
planner_model: ByName[PlannerModel] = ByName("planner model", PlannerModel())
#: ``register_planner_model(name, model)``: make ``model`` that of the schedule called ``name`` (once per name)
register_planner_model = planner_model.register


class _Rank:
    def __init__(self) -> None:
        self.host = 0.0
        self.dp_free = 0.0
        self.cursor = 0
        self.gathered: dict[int, float] = {}
        self.reduced: dict[int, float] = {}  # when each stage's reduction ends
        self.memory: list[tuple[float, int]] = []  # (time, +/- bytes)
        self.activations: list[tuple[float, int]] = []  # the activation part of `memory`
        self.comm_bytes = 0
        self.pipeline_wait = 0.0

    def hold(self, at: float, nbytes: int) -> None:
        """Activations kept (positive) or freed (negative) at ``at``."""
        self.memory.append((at, nbytes))
        self.activations.append((at, nbytes))


def simulate_pipeline(plan: Plan, profile: ModelProfile, cluster: Cluster) -> Prediction:
    """Predict one training step of an activation pipeline (see the module docstring)."""
    p, v = plan.pipeline_parallel_size, plan.stages_per_rank
    layers = profile.at_microbatch_size(plan.microbatch_size)
    t = plan.tensor_parallel_size
    # each tensor group acts as one device of the layout; each of its ranks pays its share (at t=1 this only
    # refuses layers measured split)
    layers = [layer.split_over_tensor_group(t, lambda n: tensor_all_reduce_s(cluster, t, n)) for layer in layers]
    cluster = tensor_groups_as_devices(cluster, t)
    counts = plan.stage_layer_counts or balanced_counts([layer.param_bytes for layer in layers], p * v)
    stages = stage_costs(layers, counts)
    net = links(cluster, p, plan.data_parallel_size, plan.mesh_order)
    # the computing layer's transient (its forward's temporaries, its backward's activation gradients): at most one
    # layer's activations for one micro-batch, the rank's largest
    starts = [sum(counts[:s]) for s in range(p * v + 1)]
    workspace = [
        max(layer.full_activation_bytes for s in plan.stages_of(rank) for layer in layers[starts[s] : starts[s + 1]])
        for rank in range(p)
    ]
    return _run(plan, plan.lowered(), stages, profile, cluster, net, workspace)


def _run(
    config: Plan,
    schedule: dict[int, list[Action]],
    stages: list[LayerCost],
    profile: ModelProfile,
    cluster: Cluster,
    net: Links,
    workspace: list[int],
) -> Prediction:
    simulation = _Simulation(config, schedule, stages, cluster, net)
    simulation.run()
    return simulation.prediction(profile, workspace)


class _Simulation:
    """One step of ``schedule`` (every rank's lowered actions) on the cluster's clock: each rank runs its actions
    in order, each action kind by its own handler, until one waits for another rank (an activation, a gradient)."""

    def __init__(
        self, config: Plan, schedule: dict[int, list[Action]], stages: list[LayerCost], cluster: Cluster, net: Links
    ) -> None:
        self.config, self.schedule, self.stages, self.cluster, self.net = config, schedule, stages, cluster, net
        p, dp, m = config.pipeline_parallel_size, config.data_parallel_size, config.num_microbatches
        self.p, self.dp = p, dp
        self.num_stages = len(stages)
        self.sharded = config.sharding != "no_shard"
        self.hybrid = config.sharding == HYBRID_SHARD
        if self.hybrid:
            self.gather_s, self.reduce_s = net.hybrid_all_gather_s, net.hybrid_reduce_s
            self.shard = net.shard_size
        else:
            self.gather_s = net.all_gather_s
            self.reduce_s = net.reduce_scatter_s if self.sharded else net.all_reduce_s
            self.shard = (dp,) * p
        self.ranks = [_Rank() for _ in range(p)]
        self.spans: list[Span] = []
        self.fwd_ready: dict[tuple[int, int], float] = {(0, mb): 0.0 for mb in range(m)}
        self.bwd_ready: dict[tuple[int, int], float] = {}
        self.fwd_done: dict[tuple[int, int], float] = {}
        self.input_grad_done: set[tuple[int, int | None]] = set()  # (stage, micro-batch) whose I ran: its W may run
        self.link_free: dict[tuple[int, int], float] = defaultdict(float)
        self.first_backward: dict[int, float] = {}
        self.overhead = cluster.action_overhead_s + (cluster.data_parallel_action_overhead_s if dp > 1 else 0.0)
        # the step's host work (Lightning's loop, splitting the batch, capturing the input: ``step_overhead_s``)
        # comes before the first compute; the first stage's gather is issued before it and runs beside it, as the
        # runtime prefetches it (Pipeline._prefetch_first_stage)
        self.prefetched = self.sharded and dp > 1 and config.prefetch_stages > 0
        for r in self.ranks:
            r.host = cluster.step_overhead_s
        # each rank's last reduction, which runs as every rank ends its step (Cluster.last_reduce_slowdown)
        self.last_reduce = {
            rank: max((i for i, a in enumerate(actions) if a.kind is REDUCE_GRAD), default=-1)
            for rank, actions in schedule.items()
        }
        # each handler returns False where the action waits for another rank (the rank stops there for now)
        self.handlers: dict[Any, Callable[[int, _Rank, Action, LayerCost], bool]] = {
            UNSHARD: self._unshard,
            RESHARD: self._reshard,
            F: self._forward,
            B: self._backward,
            I: self._backward,
            W: self._weight_grad,
            REDUCE_GRAD: self._reduce,
            WAIT_REDUCE_GRAD: self._wait_reduce,
        }

    def run(self) -> None:
        remaining = sum(len(actions) for actions in self.schedule.values())
        while remaining:
            progressed = False
            for rank in range(self.p):
                r = self.ranks[rank]
                actions = self.schedule[rank]
                while r.cursor < len(actions):
                    a = actions[r.cursor]
                    handler = self.handlers.get(a.kind)
                    if handler is not None and not handler(rank, r, a, self.stages[a.stage]):
                        break
                    r.cursor += 1
                    remaining -= 1
                    progressed = True
            if not progressed:
                raise ValueError(f"{self.config.describe()}: the schedule cannot make progress (a deadlock)")

    # -- transfers and waits ----------------------------------------------------------------------------------

    def _send(self, src: int, dst_stage: int, mb: int, at: float, nbytes: int, forward: bool) -> None:
        dst = self.config.placement.rank_of(dst_stage, self.p)
        ready = self.fwd_ready if forward else self.bwd_ready
        if dst == src:
            ready[(dst_stage, mb)] = at
            return
        link = (src, dst)
        start = max(at, self.link_free[link])
        arrival = start + self.net.p2p_s(src, dst, nbytes)
        self.link_free[link] = arrival
        ready[(dst_stage, mb)] = arrival
        self.ranks[src].comm_bytes += nbytes

    def _wait_compute(self, rank: int, r: _Rank, stage: int, ready: float) -> float:
        start = max(r.host, ready, r.gathered.get(stage, 0.0) if self.sharded else 0.0)
        if ready > r.host:
            self.spans.append(Span(rank, "p2p_wait", r.host, min(ready, start)))
            r.pipeline_wait += min(ready, start) - r.host
        gather_end = r.gathered.get(stage, 0.0)
        if self.sharded and gather_end > max(r.host, ready):
            self.spans.append(Span(rank, "gather_wait", max(r.host, ready), gather_end, stage))
        return start

    # -- one handler per action kind ----------------------------------------------------------------------------

    def _unshard(self, rank: int, r: _Rank, a: Action, cost: LayerCost) -> bool:
        if self.sharded:
            first = not r.gathered
            start = r.dp_free if self.prefetched and first else max(r.host, r.dp_free)
            slowdown = self.cluster.first_gather_slowdown if first else 1.0
            end = start + slowdown * self.gather_s(rank, cost.param_bytes)
            r.dp_free = r.gathered[a.stage] = end
            self.spans.append(Span(rank, "gather", start, end, a.stage))
            r.comm_bytes += int(cost.param_bytes * (self.shard[rank] - 1) / self.shard[rank])
            r.memory.append((start, cost.param_bytes))
        r.host += self.overhead
        return True

    def _reshard(self, rank: int, r: _Rank, a: Action, cost: LayerCost) -> bool:
        if self.sharded:
            r.memory.append((r.host, -cost.param_bytes))
        r.host += self.overhead
        return True

    def _forward(self, rank: int, r: _Rank, a: Action, cost: LayerCost) -> bool:
        key = (a.stage, a.microbatch)
        if key not in self.fwd_ready:
            return False
        start = self._wait_compute(rank, r, a.stage, self.fwd_ready[key])
        end = start + cost.forward_s + self.overhead
        self.spans.append(Span(rank, "forward", start, end, a.stage, a.microbatch))
        r.host = self.fwd_done[key] = end
        # what autograd saves, and (but on the last stage) the output torch's stage keeps until the backward
        last = a.stage + 1 == self.num_stages
        r.hold(end, cost.saved_bytes + (0 if last else cost.output_bytes))
        if not last:
            self._send(rank, a.stage + 1, a.microbatch, end, cost.output_bytes, forward=True)
        else:
            self.bwd_ready[key] = end
        return True

    def _backward(self, rank: int, r: _Rank, a: Action, cost: LayerCost) -> bool:
        """A whole backward (``B``) or its input-gradient half (``I``)."""
        key = (a.stage, a.microbatch)
        if key not in self.bwd_ready or key not in self.fwd_done:
            return False
        start = self._wait_compute(rank, r, a.stage, self.bwd_ready[key])
        if self.sharded and a.stage not in self.first_backward:
            self.first_backward[a.stage] = start
            r.memory.append((start, cost.param_bytes))  # unsharded gradient buffer
        # stage 0 has no input gradient: torch's runtime runs its whole backward in the W
        split = 0.0 if a.stage == 0 else cost.input_grad_s
        end = start + (cost.backward_s if a.kind is B else split) + self.overhead
        self.spans.append(Span(rank, "backward", start, end, a.stage, a.microbatch))
        r.host = end
        kept_output = cost.output_bytes if a.stage + 1 < self.num_stages else 0  # released by B and I
        if a.kind is B:
            r.hold(end, -cost.saved_bytes - kept_output)
        else:
            self.input_grad_done.add(key)  # the activations stay for the W, and what the I keeps for it
            kept = cost.intermediate_grad_bytes if a.stage > 0 else 0  # stage 0's W is its whole backward
            r.hold(end, kept - kept_output)
        if a.stage > 0:
            self._send(rank, a.stage - 1, a.microbatch, end, self.stages[a.stage - 1].output_bytes, forward=False)
        return True

    def _weight_grad(self, rank: int, r: _Rank, a: Action, cost: LayerCost) -> bool:
        if (a.stage, a.microbatch) not in self.input_grad_done:
            return False
        start = self._wait_compute(rank, r, a.stage, r.host)  # waits for nothing but the stage's gather
        end = start + (cost.backward_s if a.stage == 0 else cost.weight_grad_s) + self.overhead
        self.spans.append(Span(rank, "backward", start, end, a.stage, a.microbatch))
        r.host = end
        r.hold(end, -cost.saved_bytes - (cost.intermediate_grad_bytes if a.stage > 0 else 0))
        return True

    def _reduce(self, rank: int, r: _Rank, a: Action, cost: LayerCost) -> bool:
        start = max(r.host, r.dp_free)
        dp = self.dp
        if dp > 1:
            slowdown = self.cluster.last_reduce_slowdown if r.cursor == self.last_reduce[rank] else 1.0
            end = start + slowdown * self.reduce_s(rank, cost.param_bytes)
            if self.hybrid:
                n_s, n_r = self.shard[rank], self.net.replicate_size[rank]
                moved = (n_s - 1) / n_s + 2 * (n_r - 1) / n_r / n_s
            else:
                moved = (dp - 1) / dp * (1 if self.sharded else 2)
            r.comm_bytes += int(cost.param_bytes * moved)
        else:
            end = start
        self.spans.append(Span(rank, "reduce", start, end, a.stage))
        r.dp_free = r.reduced[a.stage] = end
        r.host = r.host + self.overhead if self.cluster.overlap_reductions else end + self.overhead
        if self.sharded:
            r.memory.append((end, -cost.param_bytes))
        return True

    def _wait_reduce(self, rank: int, r: _Rank, a: Action, cost: LayerCost) -> bool:
        # the host goes on once the stage's reduction is done (a blocking one already is); no action cost: the
        # wait's own host time is within the calibrated cost of its REDUCE_GRAD
        done = r.reduced.get(a.stage, 0.0)
        if done > r.host:
            self.spans.append(Span(rank, "reduce_wait", r.host, done, a.stage))
            r.host = done
        return True

    # -- the step's end -------------------------------------------------------------------------------------

    def prediction(self, profile: ModelProfile, workspace: list[int]) -> Prediction:
        """The step time (the pipeline's end, then the optimizer on the largest shard), memory peaks, traffic."""
        config, stages, ranks, spans, p = self.config, self.stages, self.ranks, self.spans, self.p
        pipeline_end = max(max(r.host, r.dp_free) for r in ranks)
        local_bytes = [sum(stages[s].param_bytes for s in config.stages_of(rank)) for rank in range(p)]
        held = [b / self.shard[rank] if self.sharded else b for rank, b in enumerate(local_bytes)]
        optimizer_s = max(profile.optimizer_s_per_byte * h for h in held)
        step_time = pipeline_end + optimizer_s
        for rank, r in enumerate(ranks):
            end = max(r.host, r.dp_free)
            if end < pipeline_end:
                spans.append(Span(rank, "step_sync", end, pipeline_end))
                r.pipeline_wait += pipeline_end - end
            spans.append(Span(rank, "optimizer", pipeline_end, pipeline_end + optimizer_s))
        peaks = []
        for rank, r in enumerate(ranks):
            static = held[rank] * (2 + profile.optimizer_state_ratio)  # weights, gradients, optimizer state
            peaks.append(int(static + _peak(r.memory) + workspace[rank]))
        bubble = sum(r.pipeline_wait for r in ranks) / (p * step_time)
        return Prediction(
            config, step_time, bubble, max(peaks), max(r.comm_bytes for r in ranks), spans,
            memory_events=[sorted(r.memory) for r in ranks],
            activation_peaks=[_peak(r.activations) + workspace[rank] for rank, r in enumerate(ranks)],
        )  # fmt: skip


def _peak(events: list[tuple[float, int]]) -> int:
    """The most held at once: ``events`` in time order, what is taken at an instant before what is freed."""
    current = peak = 0
    for _, delta in sorted(events, key=lambda event: (event[0], -event[1])):
        current += delta
        peak = max(peak, current)
    return peak
