"""The calibration's arithmetic: this machine's costs fitted on what the measuring processes timed.

No processes, no torch: the links' terms fitted on their sweeps (each ``time = fixed + bytes / bandwidth``,
:func:`link_terms`, and their range over the sweeps, :func:`link_spread`), and the runtime's own costs fitted on
emulated steps against the simulator's (:func:`fit_runtime_costs`, weighted as the simulation charges them,
:func:`cost_weights`; :func:`data_parallel_action_cost`, :func:`runtime_spread`). The measuring itself is
:mod:`lightning_bfpp.measure.links` (the links, in processes of their own) and
:mod:`lightning_bfpp.measure.emulated_jobs` (the emulated training jobs); :mod:`lightning_bfpp.measure.calibrate`
runs them and fits with these.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from lightning_bfpp.plan.cluster import Cluster
from lightning_bfpp.plan.costs import ModelProfile
from lightning_bfpp.plan.plan import Plan
from lightning_bfpp.plan.simulate import simulate


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``t = a + b·x``; returns (a, 1/b)."""
    xs, ts = zip(*points, strict=True)
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    slope = sum((x - mx) * (t - mt) for x, t in points) / sum((x - mx) ** 2 for x in xs)
    return max(mt - slope * mx, 0.0), 1.0 / slope


def link_terms(timings: dict[str, Any], group_size: int) -> dict[str, float]:
    """The cluster's link terms fitted on ``timings`` (``(bytes, seconds)`` per link and size): each link
    ``time = fixed + bytes / bandwidth``, the reductions' bandwidths as ratios to the all-gathers'."""
    latency, p2p_bandwidth = _fit([(b, t) for b, t in timings["p2p"]])
    # ring collectives of B bytes over n ranks: fixed + (n−1)/n · B / bandwidth (all-gather, reduce-scatter),
    # fixed + 2·(n−1)/n · B / bandwidth (all-reduce); each fitted on its own (gloo sums on the host: its
    # reduce-scatters take about twice an all-gather's time), the per-call cost from the all-gathers
    n = group_size
    fixed, bandwidth = _fit([((n - 1) / n * b, t) for b, t in timings["all_gather"]])
    _, reduce_bandwidth = _fit([((n - 1) / n * b, t) for b, t in timings["reduce_scatter"]])
    _, all_reduce_bandwidth = _fit([(2 * (n - 1) / n * b, t) for b, t in timings["all_reduce"]])
    return {
        "intra_node_bandwidth": bandwidth,
        "latency_s": latency,
        "p2p_bandwidth_ratio": p2p_bandwidth / bandwidth,
        "collective_overhead_s": max(fixed - (n - 1) * latency, 0.0),
        "reduce_bandwidth_ratio": reduce_bandwidth / bandwidth,
        "all_reduce_bandwidth_ratio": all_reduce_bandwidth / bandwidth,
    }


def link_timings(rounds_by_link: dict[str, Any], pick: Callable[[list[float]], float]) -> dict[str, Any]:
    """``(bytes, seconds)`` per link and size from each size's seconds over the sweeps (``link_rounds``), one
    value picked from them: their median, for the fit, or one sweep's, for its spread."""
    return {name: [(b, pick(seconds)) for b, seconds in by_size] for name, by_size in rounds_by_link.items()}


def link_spread(rounds_by_link: dict[str, Any], group_size: int) -> dict[str, tuple[float, float]]:
    """Each link term's lowest and highest value fitted on one sweep of the links alone (``link_rounds``): how far
    the calibration's own repetitions disagree, beside the terms fitted on their medians."""
    rounds = len(rounds_by_link["p2p"][0][1])
    fits = [
        link_terms(link_timings(rounds_by_link, lambda seconds, r=r: seconds[r]), group_size) for r in range(rounds)
    ]
    return {term: (min(f[term] for f in fits), max(f[term] for f in fits)) for term in fits[0]}


def runtime_spread(rows: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """The runtime's costs fitted on each round alone (round ``r`` of every layout, which ran one after another)
    instead of on the layouts' medians over the rounds: each cost's lowest and highest value, how far the
    calibration's own repetitions disagree. From :func:`measure_runtime`'s rows: the two unreplicated layouts
    first, the two replicated ones (with ``data_parallel_action_overhead_s``) where measured."""
    rounds = min(len(row["rounds_s"]) for row in rows)
    fits: dict[str, list[float]] = {"action_overhead_s": [], "step_overhead_s": []}
    for r in range(rounds):
        this_round = [{**row, "measured_s": row["rounds_s"][r]} for row in rows]
        per_action, per_step = fit_runtime_costs(this_round[:2])
        fits["action_overhead_s"].append(per_action)
        fits["step_overhead_s"].append(per_step)
        replicated = [row for row in this_round if "data_parallel_action_overhead_s" in row]
        if replicated:
            cost = data_parallel_action_cost(replicated, per_action)
            fits.setdefault("data_parallel_action_overhead_s", []).append(cost)
    return {term: (min(values), max(values)) for term, values in fits.items()}


def _runtime_row(config: Plan, rounds_s: list[float], profile: ModelProfile, links: Cluster) -> dict[str, Any]:
    """One layout's calibration row: its actions per rank, its median step over the rounds, and its simulated step
    with the weights of each runtime cost (:func:`cost_weights`)."""
    return {
        "actions": 2 * config.stages_per_rank * config.num_microbatches,
        "measured_s": statistics.median(rounds_s),
        "rounds_s": rounds_s,
        **cost_weights(config, profile, links),
    }


def _tensor_cost(
    config: Plan, profile: ModelProfile, cluster: Cluster, measured: float, probe_s: float = 1e-3
) -> dict[str, float]:
    """The fixed cost per tensor all-reduce that makes the simulated step of ``config`` the measured one."""
    free_cluster = replace(cluster, tensor_collective_overhead_s=0.0)
    # the step with free tensor all-reduces, and the all-reduces on its critical path
    free, weight = sensitivity(config, profile, free_cluster, "tensor_collective_overhead_s", probe_s)
    return {
        "tensor_all_reduces": weight,
        "measured_s": measured,
        "simulated_s": free,
        "tensor_collective_overhead_s": max((measured - free) / weight, 0.0),
    }


def data_parallel_action_cost(rows: list[dict[str, Any]], per_action: float) -> float:
    """The cost per action on a replicated stage beyond ``per_action`` (the unreplicated layouts'), from the two
    replicated layouts' rows (:func:`cost_weights`): how much more the second step has beyond its simulated one
    than the first, per action more on its critical path, less ``per_action``; not below 0.

    A constant per step cancels in the difference, which is why the fit is not :func:`fit_runtime_costs`': the
    simulator hides the step's host work behind the first stage's gather, so both steps' ``step_weight`` is 0
    at these weights, while the optimizer's and FSDP2's own per-step work still reaches the measured steps.
    """
    few, many = rows
    actions = many["action_weight"] - few["action_weight"]
    if actions <= 0:
        raise ValueError("the second replicated layout must have more actions on its critical path than the first")
    extra = (many["measured_s"] - many["simulated_s"]) - (few["measured_s"] - few["simulated_s"])
    return max(extra / actions - per_action, 0.0)


def cost_weights(config: Plan, profile: ModelProfile, links: Cluster, probe_s: float = 1e-3) -> dict[str, float]:
    """The simulated step of ``config`` without runtime costs, and how much it grows per second of runtime cost
    per action (``action_weight``: about the actions on the critical path) and per step (``step_weight``).

    The fit must charge the costs as the simulation will: every action on the critical path pays the cost per
    action, and with ``p`` ranks that path holds about ``2(m·v + p − 1)`` actions, not a rank's ``2·m·v``.
    Fitting against a rank's own count put the cost per action about 12% high (3.44 against 3.06 ms on the
    same 8-process measurements).
    """
    base, action_weight = sensitivity(config, profile, links, "action_overhead_s", probe_s)
    _, step_weight = sensitivity(config, profile, links, "step_overhead_s", probe_s)
    return {"simulated_s": base, "action_weight": action_weight, "step_weight": step_weight}


def sensitivity(
    config: Plan, profile: ModelProfile, cluster: Cluster, field: str, probe_s: float = 1e-3
) -> tuple[float, float]:
    """The simulated step of ``config`` on ``cluster``, and how much it grows per second added to the cluster's
    cost ``field`` (the step is linear in each such cost while the critical path stays the same)."""
    base = simulate(config, profile, cluster).step_time
    probed = simulate(config, profile, replace(cluster, **{field: getattr(cluster, field) + probe_s})).step_time
    return base, (probed - base) / probe_s


def fit_runtime_costs(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """``(per action, per step)`` seconds, neither below 0, from two runs' measured and simulated steps: the
    measured excess is ``step_weight × per_step + action_weight × per_action`` (see :func:`cost_weights`;
    without weights, one per step and ``actions`` per rank). Where the exact solution has a negative cost,
    that cost is 0 and the other is the least-squares fit over both runs."""
    extra = [r["measured_s"] - r["simulated_s"] for r in rows]
    a = [r.get("action_weight", r["actions"]) for r in rows]
    b = [r.get("step_weight", 1.0) for r in rows]
    det = a[0] * b[1] - a[1] * b[0]
    if abs(det) < 1e-12:
        raise ValueError("the two runs must differ in how their steps grow with the cost per action and per step")
    per_action = (extra[0] * b[1] - extra[1] * b[0]) / det
    per_step = (a[0] * extra[1] - a[1] * extra[0]) / det
    if per_step < 0:
        per_action, per_step = _least_squares(a, extra), 0.0
    elif per_action < 0:
        per_action, per_step = 0.0, _least_squares(b, extra)
    return max(per_action, 0.0), max(per_step, 0.0)


def _least_squares(weights: list[float], extra: list[float]) -> float:
    """The ``x`` minimising ``Σ (weight·x − extra)²``."""
    return sum(w * e for w, e in zip(weights, extra, strict=True)) / sum(w * w for w in weights)
