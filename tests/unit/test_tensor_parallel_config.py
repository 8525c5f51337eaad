"""Tensor parallelism's configuration and refusals, checked without processes."""

from __future__ import annotations

import os
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_bfpp.engine.build import check_tensor_parallel
from lightning_bfpp.plan.config import PipelineConfig
from lightning_bfpp.plan.mesh import MeshShape


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
        ({"tensor_parallel_size": 2, "sharding": "hybrid_shard"}, 8, 4, "hybrid_shard' with tensor_parallel"),
    ],
)
def test_what_tensor_parallelism_does_not_combine_with_is_refused(kwargs, world, per_node, match):
    with pytest.raises(ValueError, match=match):
        PipelineConfig(**kwargs).resolve_mesh(world, per_node)


def test_auto_with_tensor_parallelism_needs_the_split_per_layer():
    """ "auto" measures layers split as training splits them; ``configure_model`` runs before there is a mesh."""
    import torch

    from lightning_bfpp.adapter.auto import planned_config
    from lightning_bfpp.engine.agreement import AgreedError

    config = PipelineConfig(pipeline_parallel_size="auto", tensor_parallel_size=2)
    with pytest.raises(AgreedError, match="define `parallelize_layer\\(layer, tp_mesh\\)` on the module or pass"):
        planned_config(
            config, None, None, cluster=None, profile=None, overlap_reductions=False, world_size=4,  # type: ignore[arg-type]
            processes_per_node=4, device=torch.device("cpu"), is_global_zero=True, info=print, parallelize=None,
        )  # fmt: skip


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)


def test_tensor_parallelism_with_nothing_that_parallelises_is_refused():
    net = _Net()
    named = [("a", net.a), ("b", net.b)]
    mesh = SimpleNamespace(size=lambda: 2)
    with pytest.raises(ValueError, match="but no layer is tensor-parallel"):
        check_tensor_parallel(named, mesh, None)
    check_tensor_parallel(named, mesh, lambda layer, mesh: layer)  # a parallelize_fn: taken
    check_tensor_parallel(named, None, None)  # no tensor parallelism


def test_the_hugging_face_plan_is_the_models_own_and_refusals_name_the_entry():
    transformers = pytest.importorskip("transformers")
    from lightning_bfpp.integrations.huggingface import HFCausalLM, _tp_style, tensor_parallel_plan
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
    # the model's resolved plan (`model.tp_plan`) splits the token embedding by vocabulary rows: each rank's
    # partial lookups summed
    embed = tensor_parallel_plan(llama, llama.embed, 2)
    assert list(embed) == ["embed_tokens"] and type(embed["embed_tokens"]).__name__ == "VocabParallelEmbedding"
    # Phi-3's style for a row-wise layer after a gathered one: its whole input split here
    assert _tp_style("rowwise_split_input").input_layouts[0].is_replicate()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide the model's `num_key_value_heads`"):
        tensor_parallel_plan(llama, llama.blocks[0], 4)
    # Qwen 3's per-head norms: whole, with their gradients summed over the tensor group
    qwen3 = HFCausalLM(tiny_config("qwen3", layers=2))
    norms = tensor_parallel_plan(qwen3, qwen3.blocks[0], 2)
    assert type(norms["layer.self_attn.q_norm"]).__name__ == "GradientsSummedOverTensorGroup"
    qwen3._tensor_plan["model.layers.*.mlp.up_proj"] = "packed_colwise"
    with pytest.raises(ValueError, match=re.escape("asks `packed_colwise` for `model.layers.*.mlp.up_proj`")):
        tensor_parallel_plan(qwen3, qwen3.blocks[0], 2)
    gpt2 = HFCausalLM(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=16))
    with pytest.raises(ValueError, match="declares no tensor-parallel plan"):
        tensor_parallel_plan(gpt2, gpt2.blocks[0], 2)


def _vocab_parallel_worker(rank: int, store_path: str, out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_bfpp.integrations.huggingface import VocabParallelEmbedding

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
        torch.manual_seed(0)
        whole = nn.Embedding(16, 8, padding_idx=3)
        split = nn.Embedding(16, 8, padding_idx=3)
        split.load_state_dict(whole.state_dict())
        parallelize_module(split, mesh, VocabParallelEmbedding())
        ids = torch.tensor([[1, 3, 9, 15], [3, 3, 8, 0]])
        weights = torch.arange(8.0)
        (split(ids) * weights).sum().backward()
        (whole(ids) * weights).sum().backward()
        grad = split.weight.grad
        result = {
            "output": (split(ids) - whole(ids)).abs().max().item(),
            "local_grad_rows": grad.to_local().shape[0],
            "grad": (grad.full_tensor() - whole.weight.grad).abs().max().item(),
        }
        if rank == 0:
            torch.save(result, out_path)
    finally:
        dist.destroy_process_group()
    # done: leave without the interpreter's finalization, where a native thread still joinable at exit aborted
    # one run in four with "terminate called without an active exception" after every check had passed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.distributed  # two processes with a gloo group
@pytest.mark.timeout(120)
def test_the_vocabulary_parallel_embedding_keeps_only_its_rows_gradient(tmp_path):
    """Each of 2 tensor ranks looks up its 8 of 16 rows, and its weight gradient is those 8 rows (torch's
    ``RowwiseParallel`` on an embedding returns all 16 on each rank); output and gradient equal one embedding,
    padding row included."""
    from lightning_bfpp.measure import launcher

    out = tmp_path / "result.pt"
    launched = launcher.launch(f"{__name__}:_vocab_parallel_worker", 2, tmp_path / "ranks", start="spawn",
                               args=(str(tmp_path / "store"), str(out)), timeout_s=100)  # fmt: skip
    assert launched.ok, launched.report()
    result = torch.load(out)
    assert result["local_grad_rows"] == 8
    assert result["output"] == 0.0 and result["grad"] == 0.0


def test_the_vocabulary_parallel_embedding_refuses_a_vocabulary_its_ranks_do_not_divide():
    """torch's row split would give 9 and 8 rows to 2 ranks while each looked up 8: ids found at wrong rows."""
    from lightning_bfpp.integrations.huggingface import VocabParallelEmbedding

    class TwoRanks:  # the refusal comes before any collective or placement
        def size(self) -> int:
            return 2

        def get_local_rank(self) -> int:
            return 0

    with pytest.raises(ValueError, match="needs a vocabulary that 2 divides; the embedding has 17 rows"):
        VocabParallelEmbedding()._apply(nn.Embedding(17, 4), TwoRanks())


def test_lora_adapters_split_with_their_base_layer():
    """A LoRA-wrapped projection: its base layer takes the plan's style, a column-wise base's B is column-wise (A
    whole), a row-wise base's A is row-wise (B whole), each adapter of the layer alike; DoRA and LoRA on the
    split embedding are refused by name."""
    pytest.importorskip("peft")
    from lightning_bfpp.integrations.huggingface import HFCausalLM, tensor_parallel_plan
    from tests.hf_models import tiny_config

    torch.manual_seed(0)
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "lora_dropout": 0.0}
    llama = HFCausalLM(tiny_config("llama", layers=2), lora=lora)
    block = tensor_parallel_plan(llama, llama.blocks[0], 2)
    assert {k: type(v).__name__ for k, v in block.items()} == {
        "layer.self_attn.q_proj.base_layer": "ColwiseParallel",
        "layer.self_attn.q_proj.lora_B.default": "ColwiseParallel",
        "layer.self_attn.k_proj": "ColwiseParallel",
        "layer.self_attn.v_proj.base_layer": "ColwiseParallel",
        "layer.self_attn.v_proj.lora_B.default": "ColwiseParallel",
        "layer.self_attn.o_proj": "RowwiseParallel",
        "layer.mlp.gate_proj": "ColwiseParallel",
        "layer.mlp.up_proj": "ColwiseParallel",
        "layer.mlp.down_proj.base_layer": "RowwiseParallel",
        "layer.mlp.down_proj.lora_A.default": "RowwiseParallel",
    }
    dora = HFCausalLM(tiny_config("llama", layers=2), lora={**lora, "use_dora": True})
    with pytest.raises(ValueError, match=r"LoRA variants \(DoRA\) on a tensor-parallel layer are not supported"):
        tensor_parallel_plan(dora, dora.blocks[0], 2)
    embedded = HFCausalLM(tiny_config("llama", layers=2), lora={**lora, "target_modules": ["embed_tokens"]})
    with pytest.raises(ValueError, match="LoRA on a tensor-parallel embedding is not supported: `embed_tokens`"):
        tensor_parallel_plan(embedded, embedded.embed, 2)
