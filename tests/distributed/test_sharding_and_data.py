"""What each rank holds, gathers, reduces and reads: the breadth-first + FSDP claims, measured.

Instrumented runs on 4 CPU processes, (p, dp, v) = (2, 2, 3): torch's FSDP2 all-gather and gradient
reduction entry points and the pipeline stages' forward/backward calls are logged per rank, in order.
"""

from __future__ import annotations

import csv
from collections import Counter

import pytest

from tests.distributed.harness import assert_params_match, assert_started_as_one_process, assert_steps_match, launch
from tests.models import RunSpec, make_model_as_the_run_does, reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


V = 3  # local stages per rank: a first, a middle and a last one, so every kind of sweep is visible


def run(name: str, sharding: str, m: int = 4, checks: tuple[str, ...] = ()) -> RunSpec:
    return RunSpec(
        name=name,
        strategy={"pipeline_parallel_size": 2, "stages_per_rank": V, "num_microbatches": m, "sharding": sharding},
        data={"batch_format": "dict"},
        model={"optimizer": "sgd"},
        local_batch_size=2 * m,
        data_parallel_size=2,
        trainer={"max_steps": 3},
        checks=list(checks),
    )


RUNS = [
    run("full_m4", "full_shard", checks=("csv_logger",)),
    run("full_m8", "full_shard", m=8),
    run("zero2", "shard_grad_op"),
    run("replicated", "no_shard"),
    # materialized on each rank by the layers' own `reset_parameters()`: the run saves what it started from
    run("meta_init", "full_shard", checks=("empty_init", "save_initial_params")),
    # layers that sleep 20 ms per micro-batch and hold 2 MB of weights each, two per stage: compute long enough
    # to time gathers
    RunSpec(
        name="prefetch_timing",
        model_factory="tests.probe_models:sleeping_net",
        model={"num_layers": 4 * V},
        strategy={"pipeline_parallel_size": 2, "stages_per_rank": V, "num_microbatches": 4, "sharding": "full_shard"},
        local_batch_size=4,
        data_parallel_size=2,
        trainer={"max_steps": 3},
    ),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sharding")
    # without OMP_NUM_THREADS: the strategy gives each process its share of the cores (see test below)
    return workdir, launch(RUNS, 4, workdir, timeout=480, unset=("OMP_NUM_THREADS",))


def step_events(rank_result, step):
    return [(kind, stage, mb) for s, kind, stage, mb in rank_result["events"] if s == step]


def local_stages(rank_result) -> list[int]:
    """The rank's stages in visit order of the forward sweep: first, middle, last."""
    return [rank_result["holdings"]["pipeline_rank"] + 2 * k for k in range(V)]


# per local stage (first, middle, last): full_shard releases the first stage after its forwards, because holding
# it would raise the peak to three gathered stages; the middle and last stay gathered from forward to backward
EXPECTED_GATHERS = {"full_m4": (2, 1, 1), "full_m8": (2, 1, 1), "zero2": (1, 1, 1), "replicated": (0, 0, 0)}


@pytest.mark.parametrize("name", list(EXPECTED_GATHERS))
def test_gathers_once_per_sweep_and_reduces_once_per_step(name, results):
    _, res = results
    m = 8 if name == "full_m8" else 4
    for rank_result in res[name].ranks:
        local = local_stages(rank_result)
        for step in (2, 3):  # step 1 also infers the stages' shapes
            events = step_events(rank_result, step)
            gathers = Counter(stage for kind, stage, _ in events if kind == "gather")
            reduces = Counter(stage for kind, stage, _ in events if kind == "reduce")
            forwards = Counter(stage for kind, stage, _ in events if kind == "forward")
            # independent of the number of micro-batches: once per sweep, not once per micro-batch
            expected = zip(local, EXPECTED_GATHERS[name], strict=True)
            assert gathers == Counter({stage: n for stage, n in expected if n})
            assert reduces == Counter(dict.fromkeys(local, 1))
            assert forwards == Counter(dict.fromkeys(local, m))


@pytest.mark.parametrize("name", ["full_m4", "full_m8"])
def test_next_stage_is_prefetched_and_reductions_are_issued_before_remaining_backward(name, results):
    _, res = results
    for rank_result in res[name].ranks:
        first, middle, last = local_stages(rank_result)
        events = step_events(rank_result, 3)

        def index(kind, stage, nth=0, events=events):
            return [i for i, e in enumerate(events) if e[0] == kind and e[1] == stage][nth]

        # the next local stage's gather is issued before the current one computes its first micro-batch
        assert index("gather", middle) < index("forward", first)
        assert index("gather", last) < index("forward", middle)
        # the first stage's weights for the backward sweep are gathered before the middle stage's backward starts
        assert index("gather", first, 1) < index("backward", middle)
        # the last stage's gradients are reduced as soon as its sweep ends, before the first stage's backward
        assert index("backward", last, -1) < index("reduce", last) < index("backward", first)


def test_prefetched_gathers_complete_while_the_previous_stage_computes(results):
    """Prefetch measured by completion time, not issue order: the weights of the next visit's stage arrive while
    the current visit computes, so that stage never waits for them.

    The forward sweep's next stage is gathered during the current stage's forwards, and the first stage, released
    after its forwards, is gathered again during the middle stage's backwards; each gather is issued before and
    completes before the end of that compute (the worker times the issue, the completion of torch's asynchronous
    all-gather work, and each stage's compute). Without prefetch a gather is issued when its stage's visit starts,
    after that end.
    """
    _, res = results
    for rank_result in res["prefetch_timing"].ranks:
        first, middle, last = local_stages(rank_result)
        for step in (2, 3):  # step 1 also infers the stages' shapes
            timed = [e for e in rank_result["timed"] if e[0] == step]

            def times(what, stage, timed=timed):
                return [t for _, w, s, _, t in timed if w == what and s == stage]

            sweeps = [
                # (stage gathered, the stage computing meanwhile, which compute, which gather of the stage)
                (middle, first, "forward", 0),
                (last, middle, "forward", 0),
                (first, middle, "backward", 1),
            ]
            for gathered, computing, kind, nth in sweeps:
                issued, done = times("gather_issued", gathered)[nth], times("gather_done", gathered)[nth]
                start, end = min(times(f"{kind}_start", computing)), max(times(f"{kind}_end", computing))
                assert end - start > 0.1  # 4 micro-batches x 2 layers x 20 ms: long against a gather
                where = f"rank {rank_result['holdings']['pipeline_rank']} step {step}: stage {gathered}"
                assert issued < start, f"{where} gathered after stage {computing}'s {kind} sweep started"
                assert done < end, f"{where} gather completed {1e3 * (done - end):.1f} ms after the {kind} sweep"


def test_the_first_gather_of_a_step_is_issued_before_its_host_side_preparation(results):
    """Each step's first gather starts before the batch is split and the input captured, not after: by the time
    the step has its schedule in hand it is already in flight (steady state: steps 2 and 3)."""
    _, res = results
    for rank_result in res["prefetch_timing"].ranks:
        first = rank_result["holdings"]["pipeline_rank"]
        for step in (2, 3):
            timed = [e for e in rank_result["timed"] if e[0] == step]
            issued = min(t for _, w, s, _, t in timed if w == "gather_issued" and s == first)
            prepared = min(t for _, w, _, _, t in timed if w == "prepared")
            forward = min(t for _, w, s, _, t in timed if w == "forward_start" and s == first)
            assert issued < prepared < forward, (step, issued, prepared, forward)


def test_each_rank_holds_only_its_shard_of_its_stages(results):
    _, res = results
    for name in ("full_m4", "meta_init"):
        for rank_result in res[name].ranks:
            holdings = rank_result["holdings"]
            local = set(holdings["local_layers"])
            assert holdings["remote_layers"] and not local & set(holdings["remote_layers"])
            for param, info in holdings["params"].items():
                layer = param.rsplit(".", 2)[0] if param.startswith("blocks.") else param.split(".")[0]
                assert layer in local, f"{param} is held but its layer lives elsewhere"
                assert info["dtensor"] and not info["meta"]
                assert info["local_numel"] <= -(-info["numel"] // 2) + 16  # a dim-0 shard over 2 replicas


@pytest.mark.parametrize(("name", "sharded"), [("full_m4", True), ("zero2", True), ("replicated", False)])
def test_optimizer_state_follows_the_parameters(name, sharded, results):
    _, res = results
    for rank_result in res[name].ranks:
        holdings = rank_result["holdings"]
        state = holdings["optimizer_state"]
        assert set(state) == set(holdings["params"])  # exactly this rank's parameters, nothing else
        for param, buffers in state.items():
            momentum = buffers["momentum_buffer"]
            assert momentum["dtensor"] and momentum["numel"] == holdings["params"][param]["numel"]
            if sharded and momentum["numel"] >= 4:
                assert momentum["local_numel"] < momentum["numel"], param
            elif not sharded:
                assert momentum["local_numel"] == momentum["numel"], param


def test_meta_device_model_trains_as_on_one_device(results):
    """A model created on the meta device starts from the weights one process materializes from the same seed
    (each module from the seed and its name, whichever rank holds it; nothing copied from the run), and trains as
    one device trains it: every rank's logged losses and the final parameters."""
    workdir, res = results
    meta = next(r for r in RUNS if r.name == "meta_init")
    assert_started_as_one_process(workdir / "out" / "meta_init", make_model_as_the_run_does(meta))
    ref = reference_run(meta)
    assert len(ref.steps) == 3
    assert_steps_match(res["meta_init"], ref, tol=1e-5, keys=("train_loss", "samples", "max_err"))
    assert_params_match(res["meta_init"], ref, tol=1e-5)


def test_pipeline_ranks_share_a_batch_and_replicas_split_the_data(results):
    _, res = results
    ranks = res["full_m4"].ranks
    ref = reference_run(next(r for r in RUNS if r.name == "full_m4"))
    ref_steps, _ = ref.steps, ref.params
    for step in range(3):
        by_replica = {}
        for r in ranks:
            dp = r["holdings"]["data_parallel_rank"]
            indices = r["steps"][step]["indices"]
            assert by_replica.setdefault(dp, indices) == indices  # same batch along the pipeline
        assert not set(by_replica[0]) & set(by_replica[1])
        assert sorted(by_replica[0] + by_replica[1]) == sorted(ref_steps[step]["indices"])


def test_logger_on_rank_zero_writes_the_last_stage_loss(results):
    workdir, res = results
    # global rank 0 holds stage 0 and never computes a loss; its logger must still write the global-batch value
    assert res["full_m4"].ranks[0]["holdings"]["pipeline_rank"] == 0
    rows = list(csv.DictReader((workdir / "out" / "full_m4" / "logs" / "version_0" / "metrics.csv").open()))
    ref = reference_run(next(r for r in RUNS if r.name == "full_m4"))
    ref_steps, _ = ref.steps, ref.params
    logged = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    assert logged == pytest.approx([s["callback_metrics"]["train_loss"] for s in ref_steps], rel=1e-5)


@pytest.mark.parametrize("name", ["full_m4", "replicated"])
def test_a_steady_step_meets_the_other_ranks_in_one_small_collective(name, results):
    """Outside the pipeline's transfers and FSDP2's gathers and reductions, a step whose schedule is built costs
    one collective: the all-to-all that shares failures, batch shapes and logged values (step 1 builds the
    schedule, with its check before; step 2 is steady, and the end of the run follows step 3)."""
    _, res = results
    for rank_result in res[name].ranks:
        per_step = Counter((s, stage) for s, kind, stage, _ in rank_result["events"] if kind == "collective")
        calls = {what: n for (s, what), n in per_step.items() if s == 2}
        assert calls == {"all_to_all_single": 1}, calls
        assert per_step[(1, "all_gather")] >= 1, "the first step checks the ranks before building its schedule"


def test_cpu_processes_share_the_cores(results):
    """Launched without OMP_NUM_THREADS, each of the 4 CPU processes runs its share of the cores, as under
    torchrun. Lightning's launcher caps only itself (rank 0): without the strategy's cap ranks 1–3 kept torch's
    default of one thread per core."""
    from lightning_bfpp.engine.cpu_threads import available_cores, threads_per_process

    _, res = results
    cores = available_cores()
    share = threads_per_process(cores, 4)
    if share >= cores:
        pytest.skip("one core: torch's default is already the share")
    for run in res.values():
        assert [r["holdings"]["intra_op_threads"] for r in run.ranks] == [share] * 4


def test_gloo_pipelines_post_every_receive_when_the_step_starts(results):
    """On gloo a point-to-point message travels only once its receive is posted, so every schedule a rank
    builds posts all its receives before its first compute (torch's lowering posts each just before its
    consumer). Every training run in this file's launches exercises it against the single-process reference."""
    _, res = results
    for run in res.values():
        for rank in run.ranks:
            placements = rank["holdings"]["receive_placement"]
            assert placements, "no pipeline schedule was built"
            for placement in placements:
                assert placement["early"] and placement["receives"] > 0
                assert placement["leading"] == placement["receives"]
