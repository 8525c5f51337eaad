"""Parameters tied across pipeline stages: detection, refusals, re-tying after meta-device materialization,
copies per stage, and the single-process halves of keeping them equal (local gradient sum, norm, checkpoints)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from lightning_bfpp.engine import checkpoint as ckpt
from lightning_bfpp.engine.clipping import clip_grad_norm, total_norm
from lightning_bfpp.engine.layers import keep_local_layers, pipeline_layers
from lightning_bfpp.engine.tied import check_shared_modules, find_ties, record_identities, retie


class Twin(nn.Module):
    """One layer whose two submodules share a weight (a tie inside one layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


class TiedNet(L.LightningModule):
    """embed -> blocks -> head, ``head.weight is embed.weight``."""

    def __init__(self, n: int = 2, head_first: bool = False) -> None:
        super().__init__()
        if head_first:  # registered before the embedding: its name is the one `named_parameters` reports
            self.head = nn.Linear(4, 4)
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(Twin() for _ in range(n))
        if not head_first:
            self.head = nn.Linear(4, 4)
        self.head.weight = self.embed.weight

    def pipeline_layers(self):
        return [self.embed, *self.blocks, self.head]

    def forward(self, x):
        for layer in self.pipeline_layers():
            x = layer(x)
        return x


def test_ties_between_layers_are_grouped_and_a_layers_own_tie_is_not():
    net = TiedNet()
    named = pipeline_layers(net)  # no longer refused
    (group,) = find_ties(net, named)
    assert group.canonical == "embed.weight" and group.aliases == ("head.weight",)
    assert [u.layer for u in group.users] == [0, 3]


def test_the_canonical_name_is_the_one_named_parameters_reports():
    net = TiedNet(head_first=True)
    (group,) = find_ties(net, pipeline_layers(net))
    assert group.canonical == "head.weight" == next(n for n, p in net.named_parameters() if p is net.embed.weight)
    assert group.aliases == ("embed.weight",)


def test_sharing_with_a_module_outside_the_pipeline_layers_is_refused():
    net = TiedNet()
    net.extra = nn.Linear(4, 4, bias=False)
    net.extra.weight = net.embed.weight
    with pytest.raises(ValueError, match=r"`extra\.weight` is the parameter `embed\.weight` of pipeline layer `embed`"):
        pipeline_layers(net)


def test_an_alias_of_a_layer_holding_a_tied_parameter_is_still_an_alias():
    net = TiedNet()
    net.last = net.head
    with pytest.raises(ValueError, match="`last` is another name for `head` of pipeline layer `head`"):
        pipeline_layers(net)


def test_a_module_with_buffers_shared_across_stages_is_refused():
    net = TiedNet()
    norm = nn.BatchNorm1d(4)
    net.embed = nn.Sequential(nn.Linear(4, 4), norm)
    net.head = nn.Sequential(norm, nn.Linear(4, 4))
    named = pipeline_layers(net)
    check_shared_modules(named, [0, 0, 0, 0])  # one stage: one module, as on one device
    with pytest.raises(ValueError, match=r"the module `head.0` \(stage 1\) is the module `embed.1` \(stage 0\)"):
        check_shared_modules(named, [0, 0, 1, 1])
    # a constant table shared by distinct modules stays allowed
    table = torch.arange(4.0)
    plain = TiedNet()
    for block in plain.blocks:
        block.register_buffer("table", table)
    check_shared_modules(pipeline_layers(plain), [0, 0, 1, 1])


def _split(net, layer_stage, stage_rank, rank, meta_device=False):
    named = pipeline_layers(net)
    ties = find_ties(net, named)
    owner = [stage_rank[s] for s in layer_stage]
    identities = record_identities(named, [i for i, r in enumerate(owner) if r == rank])
    keep_local_layers(net, named, owner, rank, torch.device("cpu"))
    return retie(identities, ties, layer_stage, stage_rank)


def test_meta_device_materialization_keeps_ties_inside_a_layer_and_a_stage():
    with torch.device("meta"):
        net = TiedNet()
    tied = _split(net, [0, 0, 0, 0], [0], rank=0)  # one stage: everything tied stays one Parameter
    assert not tied.groups
    assert all(not p.is_meta for p in net.parameters())
    for block in net.blocks:
        assert block.b.weight is block.a.weight  # to_empty per submodule had given each its own
    assert net.head.weight is net.embed.weight
    assert len(list(net.parameters())) == 2 + 2 * 3 + 1  # embed (2), per block a.w, a.b, b.b; head.bias


def test_stages_on_one_rank_get_their_own_equal_copies():
    net = TiedNet()
    original = net.embed.weight
    tied = _split(net, [0, 0, 1, 1], [0, 0], rank=0)  # (p=1, v=2): owner and copy on one rank
    assert net.embed.weight is original and net.head.weight is not original
    assert torch.equal(net.head.weight, net.embed.weight)
    (group,) = tied.groups
    assert group.owner_stage == 0 and group.stages == (0, 1) and group.ranks == (0,)
    assert tied.excluded_from_norm == {id(net.head.weight)}
    assert tied.aliases == {"head.weight": "embed.weight"}


def test_a_rank_holding_only_the_copy_keeps_it_and_not_the_owner():
    net = TiedNet()
    tied = _split(net, [0, 0, 1, 1], [0, 1], rank=1)
    assert [n for n, _ in net.named_parameters()] == ["blocks.1.a.weight", "blocks.1.a.bias", "blocks.1.b.bias",
                                                      "head.weight", "head.bias"]  # fmt: skip
    (group,) = tied.groups
    assert set(group.local) == {1} and group.ranks == (0, 1) and group.owner_rank == 0


def test_local_copies_get_the_owners_values_and_the_summed_gradient():
    net = TiedNet()
    tied = _split(net, [0, 0, 1, 1], [0, 0], rank=0)
    with torch.no_grad():
        net.head.weight.add_(1.0)  # as if materialized differently
    tied.broadcast_from_owner()  # no process group: a local copy
    assert torch.equal(net.head.weight, net.embed.weight)
    net.embed.weight.grad = torch.ones(4, 4)
    net.head.weight.grad = 2 * torch.ones(4, 4)
    tied.sum_gradients()
    assert torch.equal(net.embed.weight.grad, 3 * torch.ones(4, 4))
    assert torch.equal(net.head.weight.grad, 3 * torch.ones(4, 4))
    assert net.embed.weight.grad is not net.head.weight.grad


def test_the_norm_counts_a_copy_once_and_clips_every_copy():
    a, b, c = (nn.Parameter(torch.zeros(3)) for _ in range(3))
    a.grad, b.grad, c.grad = torch.full((3,), 2.0), torch.full((3,), 2.0), torch.full((3,), 1.0)
    norm = total_norm([a, b, c], 2.0, None, exclude={id(b)})
    assert norm.item() == pytest.approx((12 + 3) ** 0.5)
    clip_grad_norm([a, b, c], 1.0, 2.0, None, exclude={id(b)})
    assert torch.equal(a.grad, b.grad)
    assert (a.grad.norm() ** 2 + c.grad.norm() ** 2).item() == pytest.approx(1.0, rel=1e-5)


def test_checkpoint_names_are_canonical():
    aliases = {"head.weight": "embed.weight"}
    model = {"embed.weight": torch.ones(2), "head.weight": torch.ones(2), "head.bias": torch.zeros(2)}
    request, keys = ckpt.to_canonical(model, aliases)
    assert set(request) == {"embed.weight", "head.bias"} and keys["head.weight"] == "embed.weight"
    restored = ckpt.from_canonical({"embed.weight": torch.full((2,), 5.0), "head.bias": torch.zeros(2)}, keys)
    assert torch.equal(restored["head.weight"], restored["embed.weight"])
    assert restored["head.weight"] is not restored["embed.weight"]  # never one tensor for two parameters
    optimizer = {"state.head.weight.exp_avg": 1, "param_groups.head.weight.lr": 2, "state.head.bias.step": 3}
    request, keys = ckpt.to_canonical(optimizer, aliases, optimizer=True)
    assert set(request) == {"state.embed.weight.exp_avg", "param_groups.embed.weight.lr", "state.head.bias.step"}
    single = ckpt.with_tied_names({"embed.weight": torch.ones(2)}, aliases)
    assert single["head.weight"] is single["embed.weight"]


def test_a_one_device_file_loads_into_a_rank_holding_only_the_copy():
    one_device = TiedNet()
    with torch.no_grad():
        one_device.embed.weight.fill_(3.0)
    state = {k: v for k, v in one_device.state_dict().items() if k != "head.weight"}  # as consolidated
    net = TiedNet()
    tied = _split(net, [0, 0, 1, 1], [0, 1], rank=1)
    ckpt.check_full(Path("x"), one_device.state_dict(), ckpt.local_shapes(net, tied.aliases), strict=False,
                    aliases=tied.aliases)  # fmt: skip
    ckpt.load_full_weights(net, state, strict=True, aliases=tied.aliases)
    assert torch.equal(net.head.weight, torch.full((4, 4), 3.0))


def test_copies_optimized_differently_are_refused():
    net = TiedNet()
    tied = _split(net, [0, 0, 1, 1], [0, 0], rank=0)
    tied.check_optimizers([torch.optim.AdamW(net.parameters(), lr=1e-3)])  # one group: fine
    by_name = [
        {"params": [p for n, p in net.named_parameters() if not n.startswith("head")]},
        {"params": [p for n, p in net.named_parameters() if n.startswith("head")], "weight_decay": 0.0},
    ]
    with pytest.raises(ValueError, match=r"copies of the tied parameter `embed.weight` are optimized differently"):
        tied.check_optimizers([torch.optim.AdamW(by_name, lr=1e-3)])
    left_out = [p for n, p in net.named_parameters() if n != "head.weight"]
    with pytest.raises(ValueError, match="not optimized"):
        tied.check_optimizers([torch.optim.AdamW(left_out, lr=1e-3)])


def test_a_tied_copys_gradient_is_placed_as_its_weight_before_the_copies_are_summed():
    """torch's ``RowwiseParallel`` on an embedding returns the weight's gradient replicated while the weight is
    split by rows; summing copies' local gradients then adds tensors of different shapes. The tie re-places it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lightning_bfpp.engine.tied import _grad_placed_as_param

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tensor_parallel",))
        weight = nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
        weight.grad = distribute_tensor(torch.full((4, 2), 3.0), mesh, [Replicate()])
        grad = _grad_placed_as_param(weight)
        assert grad.placements == (Shard(0),) and weight.grad.placements == (Shard(0),)
        assert torch.equal(grad.full_tensor(), torch.full((4, 2), 3.0))
    finally:
        if created:
            dist.destroy_process_group()
