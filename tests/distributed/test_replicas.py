"""Every data-parallel replica starts from the same parameters and buffers, and weight passing's buffers follow
their chunk.

One launch of 4 CPU processes. Each process builds its model with its own seed (``tests.replica_models``: a
PipeNet with a buffer in every block and one outside the pipeline layers), as a script without
``seed_everything`` does, under ``no_shard`` and ``full_shard`` at (p, dp) = (2, 2), ``hybrid_shard`` over two
emulated nodes of two (p = 1, dp = 4) and weight passing over the same nodes. Checked, exactly, after setup:
every layer holds the values data-parallel rank 0 of its pipeline rank built (under weight passing: the
chunk's owner), on every rank, buffers included, and the buffers outside the layers are global rank 0's;
after training: the replicas are still equal and the run equals one device on that assembled model.

A last run trains a model with ``nn.BatchNorm1d`` under weight passing: the weights equal one device running
the same micro-batches with gradient accumulation, and each chunk's running statistics are its owner's, updated
once per micro-batch of the owner's in order, on every rank, and used by every rank's evaluation; setup warns
about the batch norms once, on rank 0.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset

from lightning_bfpp.engine.layers import pipeline_layers
from tests.distributed.harness import assert_steps_match, load_results, relative_error, run_worker
from tests.models import RunSpec, eval_loader, make_dataset, make_model, reference_run
from tests.replica_models import SEED_BASE, BufferedNet

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

TOL = 1e-5
STEPS = 3
SEEDED = {"model_factory": "tests.replica_models:rank_seeded_net", "checks": ["rank_state"]}
P2_DP2 = {"pipeline_parallel_size": 2, "stages_per_rank": 2, "num_microbatches": 4}
TWO_NODES = {"processes_per_node": 2, "num_microbatches": 2}
HYBRID = {**TWO_NODES, "pipeline_parallel_size": 1, "stages_per_rank": 2, "sharding": "hybrid_shard"}


def seeded(name: str, strategy: dict[str, Any], data_parallel_size: int, local_batch_size: int) -> RunSpec:
    return RunSpec(
        name=name,
        strategy=strategy,
        model={"optimizer": "sgd"},
        trainer={"max_steps": STEPS},
        data_parallel_size=data_parallel_size,
        local_batch_size=local_batch_size,
        **SEEDED,
    )


SEEDED_RUNS = [
    seeded("no_shard", {**P2_DP2, "sharding": "no_shard"}, 2, 8),
    seeded("full_shard", {**P2_DP2, "sharding": "full_shard"}, 2, 8),
    seeded("hybrid_shard", HYBRID, 4, 4),
    seeded("weight_passing", {**TWO_NODES, "schedule": "weight_passing"}, 4, 4),
]
WORLD, M, B = 4, 2, 8  # weight passing's batch-norm run: ranks, micro-batches per rank, samples per micro-batch
BATCH_NORM = RunSpec(
    name="batch_norm_weight_passing",
    model_factory="tests.replica_models:batch_norm_net",
    strategy={**TWO_NODES, "schedule": "weight_passing", "num_microbatches": M},
    model={"optimizer": "sgd"},
    data={"num_samples": WORLD * M * B * STEPS},  # one epoch of STEPS steps, then validation
    trainer={"max_steps": -1, "max_epochs": 1},
    data_parallel_size=WORLD,
    local_batch_size=M * B,
    checks=["rank_state", "validate"],
)
RUNS = [*SEEDED_RUNS, BATCH_NORM]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """(folder, results, the processes' stderr)."""
    workdir = tmp_path_factory.mktemp("replicas")
    proc = run_worker(RUNS, WORLD, workdir, timeout=540)
    assert proc.returncode == 0, f"pipelined run failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
    return workdir, load_results(RUNS, WORLD, workdir), proc.stderr


def states(launched, name: str, when: str) -> list[dict[str, Any]]:
    workdir = launched[0]
    return [torch.load(workdir / "out" / name / f"state_{when}_rank{r}.pt") for r in range(WORLD)]


def built_by(run: RunSpec, rank: int) -> dict[str, torch.Tensor]:
    """The state process ``rank`` built (see tests.replica_models.rank_seeded_net)."""
    return BufferedNet(**{**run.model, "seed": SEED_BASE + rank}).state_dict()


def layer_sources(run: RunSpec, results, setup_states) -> dict[str, int]:
    """The process whose initial values each pipeline layer should hold: data-parallel rank 0 of the pipeline
    rank holding it; under weight passing the chunk's owner (the one rank whose module keeps the layer)."""
    sources = {}
    for name, _ in pipeline_layers(make_model(run)):
        holders = [r for r, state in enumerate(setup_states) if name in state["owned_layers"]]
        if run.strategy.get("schedule") != "weight_passing":
            holders = [r for r in holders if results[run.name].ranks[r]["holdings"]["data_parallel_rank"] == 0]
        assert len(holders) == 1, (name, holders)
        sources[name] = holders[0]
    return sources


def source_of(tensor_name: str, sources: dict[str, int]) -> int:
    """The process a tensor's value comes from: its layer's source, global rank 0 outside the layers."""
    layer = next((name for name in sources if tensor_name.startswith(name + ".")), None)
    return 0 if layer is None else sources[layer]


def held(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {**state["params"], **state["buffers"], **state["chunk_buffers"]}


@pytest.mark.parametrize("run", SEEDED_RUNS, ids=lambda run: run.name)
def test_every_replica_starts_from_data_parallel_rank_0s_values(run, launched):
    results = launched[1]
    setup = states(launched, run.name, "setup")
    sources = layer_sources(run, results, setup)
    built = {r: built_by(run, r) for r in range(WORLD)}
    checked = 0
    for rank, state in enumerate(setup):
        for name, value in held(state).items():
            want = built[source_of(name, sources)][name]
            assert torch.equal(value, want), f"rank {rank} `{name}` is not process {source_of(name, sources)}'s"
            checked += 1
        assert "target_shift" in state["buffers"]
    # the layers' buffers are among the values checked on every rank (under weight passing every chunk's)
    assert checked >= WORLD * len(sources)


@pytest.mark.parametrize("run", SEEDED_RUNS, ids=lambda run: run.name)
def test_replicas_stay_equal_and_train_as_one_device_on_the_assembled_model(run, launched):
    results = launched[1]
    sources = layer_sources(run, results, states(launched, run.name, "setup"))
    end = states(launched, run.name, "end")
    by_name: dict[str, list[torch.Tensor]] = {}
    for state in end:
        for name, value in held(state).items():
            by_name.setdefault(name, []).append(value)
    worst = max((v - values[0]).abs().max().item() for values in by_name.values() for v in values)
    assert worst == 0.0, f"replicas differ after training by {worst:.3e}"
    assert any(len(values) > 1 for values in by_name.values())
    layer_seeds = {name: SEED_BASE + rank for name, rank in sources.items()}
    reference = RunSpec(
        **{
            **run.to_json(),
            "model_factory": "tests.replica_models:assembled_net",
            "model": {**run.model, "layer_seeds": layer_seeds, "module_seed": SEED_BASE},
        }
    )
    ref = reference_run(reference)
    result = results[run.name]
    assert_steps_match(result, ref, tol=TOL)
    # the worker saves the parameters; every rank's state above holds the buffers too
    assert set(result.params) == {n for n in ref.params if not n.endswith(".gain") and n != "target_shift"}
    errors = {name: relative_error(values[0], ref.params[name]) for name, values in by_name.items()}
    errors.update({name: relative_error(value, ref.params[name]) for name, value in result.params.items()})
    assert max(errors.values()) <= TOL, max(errors.items(), key=lambda item: item[1])


# -- weight passing and running statistics ------------------------------------------------------------------


def _one_device_microbatches(run: RunSpec) -> tuple[dict[str, torch.Tensor], dict[str, list[torch.Tensor]]]:
    """One device training on weight passing's micro-batches, in the order (step, rank, micro-batch), with
    gradient accumulation over a step's ``WORLD * M``: its final state, and every batch-norm layer's training
    inputs in that order."""
    model = make_model(BATCH_NORM)
    inputs: dict[str, list[torch.Tensor]] = {}

    def record(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            if module.training:
                inputs.setdefault(name, []).append(args[0].detach().clone())

        return hook

    for name, module in model.named_modules():
        if isinstance(module, nn.BatchNorm1d):
            module.register_forward_pre_hook(record(name))
    data = make_dataset(BATCH_NORM)
    # Lightning's sampler of each replica: shuffled with seed 0, every WORLD-th sample
    shares = [list(DistributedSampler(data, num_replicas=WORLD, rank=r, shuffle=True, seed=0)) for r in range(WORLD)]
    order = [
        index
        for step in range(STEPS)
        for rank in range(WORLD)
        for mb in range(M)
        for index in shares[rank][step * M * B + mb * B : step * M * B + (mb + 1) * B]
    ]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        accumulate_grad_batches=WORLD * M,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, DataLoader(Subset(data, order), batch_size=B))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, inputs


def _fold(initial: dict[str, torch.Tensor], inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch-norm layer's running statistics after training forwards on ``inputs``, one after the other."""
    mean, var = initial["running_mean"].clone(), initial["running_var"].clone()
    for x in inputs:
        F.batch_norm(x, mean, var, training=True, momentum=0.1)
    return {"running_mean": mean, "running_var": var, "num_batches_tracked": torch.tensor(len(inputs))}


def test_running_statistics_follow_their_chunk_under_weight_passing(launched):
    """The semantics documented in lightning_bfpp.engine.runners.weight_passing: a chunk's buffers are its owner's,
    updated by the owner's forwards (once per micro-batch, in order; not again by the backward's recomputation),
    and every rank computes and evaluates with them. One device would count every rank's micro-batches."""
    results = launched[1]
    setup, end = states(launched, BATCH_NORM.name, "setup"), states(launched, BATCH_NORM.name, "end")
    final, inputs = _one_device_microbatches(BATCH_NORM)
    result = results[BATCH_NORM.name]
    # the weights: batch statistics in training mode do not read the running ones
    worst = max(relative_error(result.params[k], final[k]) for k in result.params)
    assert worst <= TOL, f"largest relative parameter error {worst:.2e}"
    initial = make_model(BATCH_NORM).state_dict()
    owners = {layer: r for r, state in enumerate(setup) for layer in state["owned_layers"]}
    expected, one_device_gap = {}, 0.0
    for norm, seen in inputs.items():
        layer = norm.rpartition(".")[0]
        assert len(seen) == STEPS * WORLD * M
        owner = owners[layer]
        own = [seen[s * WORLD * M + owner * M + mb] for s in range(STEPS) for mb in range(M)]
        stats = _fold({k: initial[f"{norm}.{k}"] for k in ("running_mean", "running_var")}, own)
        for key, value in stats.items():
            expected[f"{norm}.{key}"] = value
        one_device_gap = max(one_device_gap, relative_error(stats["running_var"], final[f"{norm}.running_var"]))
    assert one_device_gap > 1e-3  # what one device counts differs: the other ranks' micro-batches are not
    for rank, state in enumerate(end):
        for name, value in state["chunk_buffers"].items():
            if name in expected:
                err = relative_error(value.double(), expected[name].double())
                assert err <= TOL, f"rank {rank} `{name}`: {err:.2e} from its owner's running statistics"
    # evaluation on every rank reads the owners' statistics: the one-device model with them scores the same
    model = make_model(BATCH_NORM)
    model.load_state_dict({**final, **expected})
    model.eval()
    with torch.no_grad():
        x, y = next(iter(eval_loader(BATCH_NORM, 32, seed=2)))
        want = F.mse_loss(model(x), y + model.target_shift).item()
    got = result.ranks[0]["validations"][-1]["val_loss"]
    assert abs(got - want) <= TOL * abs(want), (got, want)


def test_batch_norm_is_warned_about_once_on_rank_zero_at_setup(launched):
    stderr = launched[2]
    assert stderr.count("compute statistics over the samples of each forward call") == 1, stderr[-3000:]
    assert "`blocks.0.norm` (BatchNorm1d)" in stderr and "chunk owner's" in stderr
