"""The configurations of the suite, the four ratios the package is judged on, and their targets.

(a) p=4 v=2 m=4 without data parallelism, emulated: bfpp's fraction of the analytic bound, beside torch's
    schedules on the same stages and Lightning's FSDP without a pipeline.
(b) p=2 v=4 m=2, 16 layers of 2M fp32 parameters, emulated: ``full_shard`` over dp=2 against the same
    pipeline without data parallelism, and bfpp against ``ScheduleLoopedBFS`` with FSDP2 (and the others), FSDP2
    set up as torchtitan does under pipelining and, for LoopedBFS, also with FSDP2's default resharding.
(c) real compute, the small GPT: bfpp (p=2 v=2 m=8, 2 processes × 1 thread) against one process and against
    the machine's two-process capacity (two independent one-thread processes at micro-batch size), both
    measured in the same run, before and after the pipelined runs.
(d) Lightning's overhead: bfpp through Lightning against the same lowered schedule driven by hand, on (a)'s
    layout and on (c)'s.

(z), run only when asked (``--only z``): bfpp's zero-bubble ``breadth_first_zb`` against its ``breadth_first``
    and torch's zero-bubble schedules, on emulated layers whose backward is split into input and weight
    gradients of the forward's time (p=4 v=2 m=4, without and with ``full_shard`` over dp=2), and on (c)'s GPT.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace

from benchmarks.suite.report import Row, Spread
from benchmarks.suite.spec import Emulated, GPTSpec, Job

TITLES = {
    "a": "(a) emulated, p=4 v=2 m=4, no data parallelism",
    "b": "(b) emulated, p=2 v=4 m=2, 16 × 2M fp32 params, dp=2",
    "c": "(c) real compute: small GPT, 1 thread per process",
    "z": "(z) zero-bubble: emulated, p=4 v=2 m=4, forward = input-gradient = weight-gradient time (and dp=2, GPT)",
}
OPTIONAL_GROUPS = ("z",)  # not in a plain --quick / --full: selected by name (--only z)

# (a): 16 layers of 5 ms forward, 10 ms backward per micro-batch; small weights and activations
EMULATED_A = Emulated(layers=16, forward_ms=5.0, backward_ms=10.0, param_numel=16_384, activation_numel=4096)
# (b): the same times, 2M fp32 parameters (8 MiB) per layer: sharded communication matters
EMULATED_B = replace(EMULATED_A, param_numel=2_000_000)
# (z): 16 layers of 5 ms forward, 5 ms input gradient, 5 ms weight gradient, split in two autograd nodes
EMULATED_Z = replace(EMULATED_A, backward_ms=5.0, weight_grad_ms=5.0)
GPT = GPTSpec(layers=8, dim=128, heads=4, block_size=16)
GPT_MICROBATCH = 32
GPT_PIPE = dict(p=2, v=2, m=8)  # (c)'s pipeline layout
LATE_RECEIVES = "bfpp schedule by hand, each receive posted just before its consumer (torch's placement)"
STAGE_COMPUTE = "bfpp's two ranks' own stages, each rank alone (no communication, no bubble)"
STAGE_COMPUTE_ONE = f"{STAGE_COMPUTE}, one micro-batch's activations alive at a time"


def jobs(full: bool, optional: bool = False) -> list[Job]:
    """Every job of a mode, in the order they run (full mode: the same list, three rounds, plus variants);
    ``optional`` adds the groups of :data:`OPTIONAL_GROUPS`, which run only when selected by name."""
    a = dict(group="a", processes=4, p=4, v=2, m=4, emulated=EMULATED_A)
    a_flat = dict(a, v=1)  # non-looped schedules: 4 layers per stage
    b = dict(group="b", processes=4, p=2, v=4, m=2, dp=2, emulated=EMULATED_B)
    b_flat = dict(b, v=1)
    c = dict(group="c", model="gpt", gpt=GPT, microbatch_size=GPT_MICROBATCH)
    c_pipe = dict(c, processes=2, **GPT_PIPE)
    capacity = dict(c, kind="independent", warmup=3, steps=60 if full else 30)
    # fmt: off
    group_a = [
        Job("a/bfpp", kind="bfpp", label="bfpp (Lightning)", reference=True, **a),
        Job("a/bfpp_hand", kind="bfpp_hand", label="bfpp schedule by hand", **a),
        Job("a/LoopedBFS", kind="torch", label="torch LoopedBFS", schedule="LoopedBFS", **a),
        Job("a/Interleaved1F1B", kind="torch", label="torch Interleaved1F1B", schedule="Interleaved1F1B", **a),
        Job("a/GPipe", kind="torch", label="torch GPipe", schedule="GPipe", **a_flat),
        Job("a/1F1B", kind="torch", label="torch 1F1B", schedule="1F1B", **a_flat),
        Job("a/fsdp", group="a", kind="fsdp", label="Lightning ModelParallel (FSDP2)", processes=4, m=1,
            emulated=EMULATED_A),
    ]
    group_b = [
        Job("b/bfpp", kind="bfpp", label="bfpp (Lightning)", reference=True, **b),
        Job("b/bfpp_overlap", kind="bfpp", label="bfpp (Lightning), reductions on a communication thread",
            overlap_reductions="thread", **b),
        Job("b/bfpp_prefetch2", kind="bfpp", label="bfpp (Lightning), two stages gathered ahead", prefetch_stages=2,
            **b),
        Job("b/bfpp_nodp", kind="bfpp", label="bfpp (Lightning), no data parallelism", **dict(b, processes=2, dp=1)),
        Job("b/bfpp_hand", kind="bfpp_hand", label="bfpp schedule by hand", **b),
        Job("b/LoopedBFS", kind="torch", label="torch LoopedBFS + FSDP2", schedule="LoopedBFS", **b),
        Job("b/LoopedBFS_reshard", kind="torch", label="torch LoopedBFS + FSDP2 (FSDP2's default resharding)",
            schedule="LoopedBFS", reshard_after_forward=True, **b),
        Job("b/Interleaved1F1B", kind="torch", label="torch Interleaved1F1B + FSDP2", schedule="Interleaved1F1B",
            **b),
        Job("b/GPipe", kind="torch", label="torch GPipe + FSDP2", schedule="GPipe", **b_flat),
        Job("b/1F1B", kind="torch", label="torch 1F1B + FSDP2", schedule="1F1B", **b_flat),
        Job("b/fsdp", group="b", kind="fsdp", label="Lightning ModelParallel (FSDP2)", processes=4, m=1,
            emulated=EMULATED_B),
    ]
    group_c = [  # the machine's capacity before and after the pipelined runs, as it drifts
        Job("c/one_before", label="one process (before)", processes=1, **capacity),
        Job("c/two_before", label="two independent processes (before)", processes=2, **capacity),
        Job("c/stage_compute", kind="stage_compute", label=STAGE_COMPUTE, **c_pipe),
        Job("c/bfpp", kind="bfpp", label="bfpp (Lightning)", reference=True, **c_pipe),
        Job("c/bfpp_hand", kind="bfpp_hand", label="bfpp schedule by hand", **c_pipe),
        Job("c/two_after", label="two independent processes (after)", processes=2, **capacity),
        Job("c/one_after", label="one process (after)", processes=1, **capacity),
    ]
    if full:  # schedule, sharding and receive-placement variants of bfpp itself
        group_a.insert(2, Job("a/bfpp_depth_first", kind="bfpp", label="bfpp depth_first (Lightning)",
                              schedule="depth_first", **a))
        group_a.insert(3, Job("a/bfpp_hand_late", kind="bfpp_hand", label=LATE_RECEIVES, early_receives=False,
                              **a))
        group_c.insert(3, Job("c/stage_compute_one", kind="stage_compute", label=STAGE_COMPUTE_ONE,
                              **dict(c_pipe, schedule="one_at_a_time")))
        group_c.insert(6, Job("c/bfpp_hand_late", kind="bfpp_hand", label=LATE_RECEIVES, early_receives=False,
                              **c_pipe))
        group_b.insert(3, Job("b/bfpp_shard_grad_op", kind="bfpp", label="bfpp shard_grad_op (Lightning)",
                              **dict(b, sharding="shard_grad_op")))
    listed = group_a + group_b + group_c + (_group_z() if optional else [])
    # fmt: on
    warmup, steps = (4, 10) if full else (2, 5)  # full: three warm-up steps read peak memory (instrument.PeakMemory)
    return [j if j.kind == "independent" else j.with_steps(warmup, steps) for j in listed]


def _group_z() -> list[Job]:
    """(z): bfpp's ``breadth_first_zb`` against ``breadth_first`` (each setting's reference) and torch's schedules."""
    z = dict(group="z", processes=4, p=4, v=2, m=4, emulated=EMULATED_Z)
    z_dp = dict(z, processes=8, dp=2, sharding="full_shard", timeout_s=300.0)  # 8 processes on the cores: slow start
    z_gpt = dict(group="z", model="gpt", gpt=GPT, microbatch_size=GPT_MICROBATCH, processes=2, **GPT_PIPE)
    zb = dict(kind="bfpp", schedule="breadth_first_zb")
    # fmt: off
    return [
        Job("z/bfpp", kind="bfpp", label="bfpp breadth_first (Lightning)", reference=True, **z),
        Job("z/bfpp_zb", label="bfpp breadth_first_zb (Lightning)", **zb, **z),
        Job("z/InterleavedZeroBubble", kind="torch", label="torch InterleavedZeroBubble",
            schedule="InterleavedZeroBubble", **z),
        Job("z/ZBVZeroBubble", kind="torch", label="torch ZBVZeroBubble (stages in a V)", schedule="ZBVZeroBubble",
            **z),
        Job("z/Interleaved1F1B", kind="torch", label="torch Interleaved1F1B", schedule="Interleaved1F1B", **z),
        Job("z/bfpp_dp2", kind="bfpp", label="bfpp breadth_first (Lightning)", reference=True, **z_dp),
        Job("z/bfpp_zb_dp2", label="bfpp breadth_first_zb (Lightning)", **zb, **z_dp),
        Job("z/gpt_bfpp", kind="bfpp", label="bfpp breadth_first (Lightning)", reference=True, **z_gpt),
        Job("z/gpt_bfpp_zb", label="bfpp breadth_first_zb (Lightning)", **zb, **z_gpt),
    ]
    # fmt: on


def capacity_row(rows: list[Row], processes: int = 2) -> Row | None:
    """What ``processes`` independent processes delivered: the mean of the medians measured before and after the
    pipelined runs, with the lowest and highest step rates of either."""
    prefix = {1: "c/one", 2: "c/two"}[processes]
    parts = [r for r in rows if r.name in (f"{prefix}_before", f"{prefix}_after") and r.samples_per_s]
    spreads = [r.samples_per_s for r in parts if r.samples_per_s is not None]
    if not spreads:
        return None
    mean = Spread(
        min(s.min for s in spreads), sum(s.median for s in spreads) / len(spreads), max(s.max for s in spreads)
    )
    label = "two-process capacity" if processes == 2 else "one process"
    return replace(parts[0], name=prefix, label=label, samples_per_s=mean)


def _num(x: float | None) -> str:
    return "?" if x is None else f"{x:.0f}"


def _round_ratios(row: Row, reference: Row) -> str:
    """``; per round lo–hi, median m``: the rounds' median steps over the reference's, when both ran every round."""
    pairs = list(zip(row.launch_step_ms, reference.launch_step_ms, strict=False))
    if len(pairs) < 2 or len(row.launch_step_ms) != len(reference.launch_step_ms):
        return ""
    ratios = sorted(a / b for a, b in pairs)
    return f"; per round {ratios[0]:.3f}–{ratios[-1]:.3f}, median {statistics.median(ratios):.3f}"


# The targets the package sets itself, and where `python -m benchmarks.limits` measures the machine's limit for
# each one this machine cannot reach at the suite's settings.
LIMITS = "[limits.md](limits.md)"
TARGET_EFFICIENCY_A = 0.95  # (a): bound / step
TARGET_DP_COST_B = 0.07  # (b): 1 − (no-dp step / full_shard step)
TARGET_OVER_LOOPED_BFS = 1.5  # (b): LoopedBFS (FSDP2's default resharding) step / bfpp step
TARGET_CAPACITY_C = 0.9  # (c): samples/s / the two-process capacity
TARGET_OVERHEAD_D = 1.03  # (d): step through Lightning / step by hand


def _verdict(shown: str, met: bool, target: str, limit: str = "") -> str:
    """`` Target: …, met.`` or `` Target: …, not met in this run (shown) …``, with where the limit is measured.
    The ratio is judged unrounded and ``shown`` with one digit more than the line's, so that a miss never reads
    as a hit."""
    if met:
        return f" Target: {target}, met."
    return f" Target: {target}, **not met** in this run ({shown}){'; ' + limit if limit else ''}."


def targets(rows: list[Row]) -> list[str]:
    """The judged ratios, as Markdown bullet lines, each with its target and whether this run meets it; a ratio
    whose rows did not run (or failed) says so."""
    by = {r.name: r for r in rows if r.ok}

    def step(name: str) -> float | None:
        row = by.get(name)
        return row.step_ms.median if row is not None and row.step_ms is not None else None

    def rate(row: Row | None) -> float | None:
        return row.samples_per_s.median if row is not None and row.samples_per_s is not None else None

    def bound(name: str) -> float | None:
        row = by.get(name)
        return row.bound_ms if row is not None else None

    lines: list[str] = []
    a, a_bound = step("a/bfpp"), bound("a/bfpp")
    if a and a_bound:
        lines.append(
            f"- **(a)** bfpp at p=4 v=2 m=4, dp=1: **{a_bound / a:.2f}** of the analytic bound ({a_bound:.0f} ms"
            f" against a median step of {a:.0f} ms)."
            + _verdict(
                f"{a_bound / a:.3f}",
                a_bound / a >= TARGET_EFFICIENCY_A,
                f"≥ {TARGET_EFFICIENCY_A}",
                f"{LIMITS} section 1 measures the host cost per step that holds every implementation, torch's"
                " included, below it at 5 ms layers, and the layer time from which it is met",
            )
        )
        torch_rows = [r for r in rows if r.ok and r.group == "a" and r.label.startswith("torch ")]
        peers = [(ms, r.label) for r in torch_rows if (ms := step(r.name))]
        if peers:
            fastest, label = min(peers)
            lines.append(
                f"- **(a)** the fastest of torch's schedules on the same job, {label}, takes **{fastest / a:.3f}×**"
                f" bfpp's step ({fastest:.0f} ms)."
                + _verdict(
                    f"{fastest / a:.4f}×",
                    fastest >= a,
                    "bfpp the fastest schedule",
                    f"at m = p without data parallelism the orders have the same critical path ({LIMITS} section 1"
                    " replays them), so only host time per action separates them: (d) bounds Lightning's share",
                )
            )
    else:
        lines.append("- **(a)**: not measured in this run.")
    b, nodp, b_bound = step("b/bfpp"), step("b/bfpp_nodp"), bound("b/bfpp")
    if b and nodp and b_bound:
        lines.append(
            f"- **(b)** `full_shard` over dp=2: **{b_bound / b:.2f}** of the bound, against **{b_bound / nodp:.2f}**"
            f" for the same pipeline without data parallelism (median step {b:.0f} ms against {nodp:.0f} ms for the"
            f" same work per rank: sharded data parallelism costs {1 - nodp / b:.0%} of the step)."
            + _verdict(
                f"{1 - nodp / b:.1%}",
                1 - nodp / b <= TARGET_DP_COST_B,
                f"≤ {TARGET_DP_COST_B:.0%}",
                f"{LIMITS} section 2 measures the collectives' own CPU time on these cores and the layer time from"
                " which it is met",
            )
        )
    else:
        lines.append("- **(b)** data parallelism against none: not measured in this run.")
    for name, setting in (
        ("b/LoopedBFS", "`reshard_after_forward=False`, torchtitan's setting under pipelining"),
        ("b/LoopedBFS_reshard", "FSDP2's default `reshard_after_forward=True`"),
    ):
        peer, peer_row, ours = step(name), by.get(name), by.get("b/bfpp")
        if b and peer and b_bound and peer_row and ours:
            lines.append(
                f"- **(b)** bfpp against torch `ScheduleLoopedBFS` + FSDP2 ({setting}) on the same job: LoopedBFS"
                f" takes **{peer / b:.2f}×** bfpp's step ({b_bound / peer:.2f} of the bound; weight gathers per rank"
                f" and step {_num(peer_row.gathers_per_step)} against bfpp's {_num(ours.gathers_per_step)}, peak"
                f" memory {_num(peer_row.peak_mib)} MiB against {_num(ours.peak_mib)} MiB)."
                + (
                    _verdict(
                        f"{peer / b:.3f}×",
                        peer / b >= TARGET_OVER_LOOPED_BFS,
                        f"≥ {TARGET_OVER_LOOPED_BFS}×",
                        f"{LIMITS} section 2 predicts the ratio from the gather volume and measures it over micro-batch"
                        " counts",
                    )
                    if name == "b/LoopedBFS_reshard"
                    else ""
                )
            )
        else:
            lines.append(f"- **(b)** bfpp against LoopedBFS ({setting}): not measured in this run.")
    c, one, capacity = rate(by.get("c/bfpp")), rate(capacity_row(rows, 1)), rate(capacity_row(rows))
    slots = GPT_PIPE["m"] * GPT_PIPE["v"]  # of work, in m·v + p − 1 of a breadth-first step
    alone, ceiling = rate(by.get("c/stage_compute")), None
    if alone and capacity:
        ceiling = alone / capacity * slots / (slots + GPT_PIPE["p"] - 1)
    if c and one and capacity:
        lines.append(
            f"- **(c)** bfpp small GPT (p=2 v=2 m=8, 2 processes × 1 thread): {c:.0f} samples/s, **{c / capacity:.2f}**"
            f" of the machine's two-process capacity measured in the same run ({capacity:.0f} samples/s, itself"
            f" {capacity / one:.2f}× one process) and {c / one:.2f}× one process ({one:.0f} samples/s)."
            + _verdict(
                f"{c / capacity:.3f}",
                c / capacity >= TARGET_CAPACITY_C,
                f"≥ {TARGET_CAPACITY_C}",
                f"the ceiling below is {ceiling:.2f}" if ceiling is not None else "",
            )
        )
        if capacity < 1.5 * one:
            lines.append(
                f"  Two independent processes delivered only {capacity / one:.2f}× one process: the cores were"
                " shared with other work during this run, and (c) is measured against what was left of them."
            )
    else:
        lines.append("- **(c)**: not measured in this run.")
    if alone and capacity and ceiling is not None:
        one_alive = rate(by.get("c/stage_compute_one"))
        footprint = (
            f"; holding one micro-batch's activations at a time instead, {one_alive / capacity:.2f}"
            if one_alive
            else ""
        )
        reached = f", and bfpp reached **{c / capacity / ceiling:.2f}** of that ceiling" if c else ""
        lines.append(
            f"- **(c)**'s ceiling on these cores: bfpp's two ranks computing their own stages in its order, each"
            f" alone (no communication; started together), deliver **{alone / capacity:.2f}** of the two-process"
            f" capacity{footprint}. With the schedule's own bubble, `m·v / (m·v + p − 1)` ="
            f" {slots}/{slots + GPT_PIPE['p'] - 1}, a pipeline can reach at most **{ceiling:.2f}** of the capacity"
            f" here{reached}."
        )
    for layout, group in (("(a)'s", "a"), ("(c)'s", "c")):
        early, late = step(f"{group}/bfpp_hand"), step(f"{group}/bfpp_hand_late")
        if early and late:
            lines.append(
                f"- On {layout} layout, the schedule by hand with each receive posted just before its consumer"
                f" (torch's placement) takes **{late / early:.2f}×** the step with every receive posted when the"
                f" step starts (bfpp's placement on gloo; {late:.1f} ms against {early:.1f} ms)."
            )
        through, by_hand = step(f"{group}/bfpp"), step(f"{group}/bfpp_hand")
        if through and by_hand:
            per_round = _round_ratios(by[f"{group}/bfpp"], by[f"{group}/bfpp_hand"])
            lines.append(
                f"- **(d)** on {layout} layout, bfpp through Lightning takes **{through / by_hand:.2f}×** the step of"
                f" the same lowered schedule driven by hand ({through:.1f} ms against {by_hand:.1f} ms{per_round})."
                + _verdict(
                    f"{through / by_hand:.3f}×", through / by_hand <= TARGET_OVERHEAD_D, f"≤ {TARGET_OVERHEAD_D:.2f}×"
                )
            )
        else:
            lines.append(f"- **(d)** on {layout} layout: not measured in this run.")
    return lines + _zero_bubble_lines(step, bound)


def _zero_bubble_lines(step: Callable[[str], float | None], bound: Callable[[str], float | None]) -> list[str]:
    """(z)'s ratio of interest, ``breadth_first_zb`` step over ``breadth_first`` step, per setting that ran both
    (no target: the group runs only when asked); nothing when (z) did not run."""
    lines: list[str] = []
    for suffix, setting in (("", "p=4 v=2 m=4, emulated"), ("_dp2", "p=4 v=2 m=4 `full_shard` dp=2, emulated")):
        bf, zb = step(f"z/bfpp{suffix}"), step(f"z/bfpp_zb{suffix}")
        if not (bf and zb):
            continue
        bf_bound, zb_bound = bound(f"z/bfpp{suffix}"), bound(f"z/bfpp_zb{suffix}")
        expected = f", the bounds' ratio {zb_bound / bf_bound:.3f}" if bf_bound and zb_bound else ""
        torch_zb = [(ms, name) for name in ("InterleavedZeroBubble", "ZBVZeroBubble") if (ms := step(f"z/{name}"))]
        peers = "".join(f"; torch {name} takes {ms / zb:.3f}× its step" for ms, name in torch_zb if not suffix)
        lines.append(
            f"- **(z)** {setting}: bfpp `breadth_first_zb` takes **{zb / bf:.3f}×** `breadth_first`'s step"
            f" ({zb:.0f} ms against {bf:.0f} ms{expected}){peers}."
        )
    bf, zb = step("z/gpt_bfpp"), step("z/gpt_bfpp_zb")
    if bf and zb:
        lines.append(
            f"- **(z)** small GPT at (c)'s layout: bfpp `breadth_first_zb` takes **{zb / bf:.3f}×** `breadth_first`'s"
            f" step ({zb:.1f} ms against {bf:.1f} ms)."
        )
    return lines
