"""Tensor parallelism's configuration and refusals, checked without processes."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_bfpp.engine.build import check_tensor_parallel
from lightning_bfpp.plan.config import MeshShape, PipelineConfig


def test_the_tensor_group_is_innermost_and_the_sizes_count_groups():
    shape = PipelineConfig(pipeline_parallel_size=2, tensor_parallel_size=2).resolve_mesh(8, 8)
    assert (shape.pipeline_parallel_size, shape.data_parallel_size, shape.tensor_parallel_size) == (2, 2, 2)
    # a tensor group's ranks are consecutive: global rank = ((d * p) + q) * t + k
    assert [shape.global_rank(q, d, k) for d in range(2) for q in range(2) for k in range(2)] == list(range(8))
    assert shape.data_parallel_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # the default pipeline: a node's tensor groups
    assert PipelineConfig(tensor_parallel_size=2).resolve_mesh(8, 4) == MeshShape(2, 2, tensor_parallel_size=2)
    assert PipelineConfig(tensor_parallel_size=1).resolve_mesh(4, 4) == MeshShape(4, 1)


@pytest.mark.parametrize(
    ("kwargs", "world", "per_node", "match"),
    [
        ({"tensor_parallel_size": 0}, 4, 4, "`tensor_parallel_size` must be a positive int"),
        ({"tensor_parallel_size": 3}, 6, 2, "must divide the processes of a node"),
        ({"tensor_parallel_size": 2, "pipeline_parallel_size": 4}, 4, 4, "must divide the world size"),
        ({"tensor_parallel_size": 2, "schedule": "weight_passing"}, 4, 4, "weight_passing' with tensor_parallel"),
        ({"tensor_parallel_size": 2, "pipeline_parallel_size": "auto"}, 4, 4, "cannot see what the split costs"),
        ({"tensor_parallel_size": 2, "sharding": "hybrid_shard"}, 8, 4, "hybrid_shard' with tensor_parallel"),
    ],
)
def test_what_tensor_parallelism_does_not_combine_with_is_refused(kwargs, world, per_node, match):
    with pytest.raises(ValueError, match=match):
        PipelineConfig(**kwargs).resolve_mesh(world, per_node)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)


def test_tensor_parallelism_with_nothing_that_parallelises_or_with_ties_is_refused():
    net = _Net()
    named = [("a", net.a), ("b", net.b)]
    mesh = SimpleNamespace(size=lambda: 2)
    with pytest.raises(ValueError, match="but no layer is tensor-parallel"):
        check_tensor_parallel(net, named, [], mesh, None)
    tie = SimpleNamespace(canonical="a.weight")
    with pytest.raises(ValueError, match=r"shared by several layers \(`a.weight`\) are not supported with tensor"):
        check_tensor_parallel(net, named, [tie], mesh, lambda layer, mesh: layer)
    check_tensor_parallel(net, named, [], mesh, lambda layer, mesh: layer)  # a parallelize_fn: taken
    check_tensor_parallel(net, named, [tie], None, None)  # no tensor parallelism: ties are fine


def test_the_hugging_face_plan_is_the_models_own_and_refusals_name_the_entry():
    transformers = pytest.importorskip("transformers")
    from lightning_bfpp.integrations.huggingface import HFCausalLM, tensor_parallel_plan
    from tests.hf_models import tiny_config

    torch.manual_seed(0)
    llama = HFCausalLM(tiny_config("llama", layers=2))
    block = tensor_parallel_plan(llama, llama.blocks[0], 2)
    assert {k: type(v).__name__ for k, v in block.items()} == {
        **{f"layer.self_attn.{n}_proj": "ColwiseParallel" for n in "qkv"},
        "layer.self_attn.o_proj": "RowwiseParallel",
        "layer.mlp.gate_proj": "ColwiseParallel",
        "layer.mlp.up_proj": "ColwiseParallel",
        "layer.mlp.down_proj": "RowwiseParallel",
    }
    head = tensor_parallel_plan(llama, llama.head, 2)
    assert list(head) == ["lm_head"] and head["lm_head"].output_layouts[0].is_replicate()  # logits gathered
    assert tensor_parallel_plan(llama, llama.embed, 2) == {}  # Llama's plan leaves the embedding replicated
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide the model's `num_key_value_heads`"):
        tensor_parallel_plan(llama, llama.blocks[0], 4)
    qwen3 = HFCausalLM(tiny_config("qwen3", layers=2))
    with pytest.raises(
        ValueError, match=re.escape("asks `replicated_with_grad_allreduce` for `model.layers.*.self_attn.q_norm`")
    ):
        tensor_parallel_plan(qwen3, qwen3.blocks[0], 2)
    gpt2 = HFCausalLM(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=16))
    with pytest.raises(ValueError, match="declares no tensor-parallel plan"):
        tensor_parallel_plan(gpt2, gpt2.blocks[0], 2)
