"""Fine-tuning data trains as on one device: token means over the global batch, batches padded to their own length.

Sequences of 1 to 20 tokens, a third of them without a label token, each batch padded to its own longest
(``tests.sft_models``), at (p, dp, v, m) = (2, 2, 2, 2) on 4 CPU processes with micro-batches of 2 samples: the
micro-batches and the two replicas hold very different numbers of label tokens (some none), and the two
replicas of a step run different sequence lengths, which change from step to step. Each step returns
``mean_over_items``; one device takes one token mean over the global batch. Every step's logged loss and the
final weights must agree within 1e-5 (fp32, SGD so that a gradient-scale error shows), with a plain torch model
and with a Hugging Face Llama, right and left padded, and with ``accumulate_grad_batches=2`` against one device
with the same argument. A run whose processes draw the data without a common seed is refused on every rank,
naming the cause. All runs share one launch.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from torch.utils.data import DistributedSampler

from tests.distributed.harness import assert_steps_match, launch
from tests.models import RunSpec
from tests.sft_models import VariableLengthTokens, sft_reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

TOL = 1e-5
ATOL = 1e-6


def sft_run(name: str, *, model=None, data=None, trainer=None, strategy=None, **kwargs) -> RunSpec:
    return RunSpec(
        name=name,
        strategy={"pipeline_parallel_size": 2, "stages_per_rank": 2, "num_microbatches": 2, **(strategy or {})},
        model={"family": "token", "optimizer": "sgd", **(model or {})},
        data=data or {},
        trainer={"max_steps": 5, **(trainer or {})},
        local_batch_size=4,
        data_parallel_size=2,
        model_factory="tests.sft_models:sft_module",
        loader_factory="tests.sft_models:sft_loader",
        **kwargs,
    )


EQUIVALENCE = [
    sft_run("token_lm"),
    sft_run("token_lm_no_shard", strategy={"sharding": "no_shard"}),
    sft_run("token_lm_accumulate", trainer={"accumulate_grad_batches": 2, "max_steps": 3}),
    sft_run("llama_right", model={"family": "llama", "layers": 3}),
    sft_run("llama_left", model={"family": "llama", "layers": 3}, data={"padding": "left"}),
]
# every sequence of the same length, tokens drawn in each process: same shapes, other contents
UNSEEDED = sft_run("token_lm_unseeded_data", data={"seed": "unseeded", "fixed_length": True}, expect_error=True)
RUNS = [*EQUIVALENCE, UNSEEDED]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(RUNS, 4, tmp_path_factory.mktemp("fine_tuning_data"), timeout=540)


@pytest.mark.parametrize("run", EQUIVALENCE, ids=lambda r: r.name)
def test_matches_single_device(run, results):
    ref = sft_reference_run(run)
    result = results[run.name]
    assert len(ref.steps) == run.trainer["max_steps"] * run.trainer.get("accumulate_grad_batches", 1)  # batches
    assert_steps_match(result, ref, tol=TOL)
    assert set(result.params) == set(ref.params)
    for name, want in ref.params.items():
        error = (result.params[name].double() - want.double()).norm().item()
        assert error <= TOL * want.double().norm().item() + ATOL, f"{name}: {error:.2e}"
    # the replicas saw different sequence lengths in the same step (batches padded to their own longest)
    lengths = [[s["batch_shape"] for s in rank["steps"]] for rank in result.ranks]
    assert lengths[0] == lengths[1] and lengths[2] == lengths[3]  # a pipeline's two ranks: the same batches
    assert lengths[0] != lengths[2]


def test_data_drawn_without_a_common_seed_is_refused(results):
    errors = [rank["error"] for rank in results[UNSEEDED.name].ranks]
    assert all(e is not None and "loaded different batches" in e for e in errors), errors
    assert all("seed_everything" in e for e in errors)


def test_the_data_holds_micro_batches_without_label_tokens():
    """What the runs above must cover: micro-batches with no label token at all (a replica's whole batch once),
    beside micro-batches with many, as Lightning's sampler deals the data to the two replicas."""
    data = VariableLengthTokens(seed=1)
    counts = []
    for replica in range(2):
        order = list(DistributedSampler(data, num_replicas=2, rank=replica, shuffle=True, seed=0))
        for step in range(5):
            local = order[step * 4 : (step + 1) * 4]
            counts += [sum(max(len(data[i]) - 1, 0) for i in local[mb * 2 : (mb + 1) * 2]) for mb in range(2)]
    assert counts.count(0) >= 2 and max(counts) >= 20, counts
