"""``schedule="auto"`` / ``pipeline_parallel_size="auto"``: every sharding valid for the data-parallel size is
accepted, and when no layout fits the message names the arguments given and, per schedule kind, why."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lightning_bfpp.adapter import auto
from lightning_bfpp.plan import Cluster, uniform
from lightning_bfpp.plan.config import PipelineConfig

# measured on one training batch of 8 samples per replica, as the strategy profiles
PROFILE = replace(uniform(8, 1e-3, 2e-3, 2**20, 2**14, 2**14), microbatch_size=8)


def choose(config: PipelineConfig, cluster: Cluster, pipeline_sizes=None):
    return auto._choose_here(config, None, None, cluster, PROFILE, torch.device("cpu"), None, pipeline_sizes)


@pytest.mark.parametrize("sharding", ["full_shard", "shard_grad_op", "no_shard"])
def test_any_sharding_is_accepted_with_one_replica(sharding):
    """At p=4 on 4 processes (one replica) every sharding runs alike: the planner plans with the one asked for
    (no_shard used to leave it no candidate at all, and an empty table)."""
    config = PipelineConfig(pipeline_parallel_size=4, num_microbatches=4, schedule="auto", sharding=sharding)
    chosen = choose(config, auto.default_cluster(4, 4, torch.device("cpu")), pipeline_sizes=(4,))
    assert not isinstance(chosen, Exception), chosen
    candidate, _ = chosen
    assert candidate.plan.pipeline_parallel_size == 4 and candidate.plan.sharding == sharding


def test_no_layout_fitting_the_memory_budget_is_explained_per_schedule():
    config = PipelineConfig(pipeline_parallel_size="auto", schedule="auto", sharding="no_shard")
    cluster = replace(auto.default_cluster(4, 4, torch.device("cpu")), memory_bytes=2**20)  # 1 MiB: nothing fits
    error = choose(config, cluster)
    assert isinstance(error, RuntimeError)
    message = str(error)
    # the arguments given, not ones the user did not set
    assert message.startswith("BFPPStrategy(pipeline_parallel_size='auto', schedule='auto', sharding='no_shard')")
    assert "within 1.0 MiB per device on 4 processes" in message
    for name in ("breadth_first", "depth_first", "gpipe", "zbv"):
        line = next(line for line in message.splitlines() if line.startswith(f"- {name}:"))
        assert " excluded: memory: " in line and "> 1.0 MiB" in line, line
    depth_first = next(line for line in message.splitlines() if line.startswith("- depth_first:"))
    assert "depth_first needs m ≥ p" in depth_first  # the kind's own limit, beside the memory
    assert "memory_budget=" in message


def test_a_kind_with_no_layout_for_the_sizes_says_so():
    # 3 micro-batches cannot split a replica's 8 samples
    config = PipelineConfig(pipeline_parallel_size=4, num_microbatches=3, schedule="breadth_first")
    error = choose(config, auto.default_cluster(4, 4, torch.device("cpu")), pipeline_sizes=(4,))
    assert isinstance(error, RuntimeError)
    assert str(error).startswith("BFPPStrategy(pipeline_parallel_size=4, num_microbatches=3)")
    assert "- breadth_first: no layout of 4 processes matches the other arguments" in str(error)
