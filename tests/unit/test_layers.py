"""The module side of the contract: layer discovery, its errors, and keeping only local layers."""

import lightning as L
import pytest
import torch
from torch import nn

from lightning_bfpp.engine.layers import (
    RemoteLayer,
    StageModule,
    keep_local_layers,
    layer_weights,
    materialize_remaining,
    pipeline_layers,
)


class Net(L.LightningModule):
    def __init__(self, n=4):
        super().__init__()
        self.embed = nn.Linear(3, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(n)])
        self.head = nn.Linear(8, 2)

    def pipeline_layers(self):
        return [self.embed, *self.blocks, self.head]


def test_layers_keep_the_module_names():
    named = pipeline_layers(Net())
    assert [n for n, _ in named] == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    assert layer_weights(named) == [32, 72, 72, 72, 72, 18]


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda net: setattr(net, "pipeline_layers", None), TypeError, "has no `pipeline_layers"),
        (lambda net: setattr(net, "pipeline_layers", lambda: [net.embed, torch.relu]), TypeError, "not an nn.Module"),
        (lambda net: setattr(net, "pipeline_layers", lambda: [net.embed, net.embed]), ValueError, "twice"),
        (lambda net: setattr(net, "pipeline_layers", lambda: [nn.Linear(2, 2)]), ValueError, "not a submodule"),
        (lambda net: setattr(net, "pipeline_layers", lambda: [net.blocks, net.blocks[0]]), ValueError, "inside"),
        (lambda net: setattr(net, "pipeline_layers", lambda: []), ValueError, "no layers"),
        (lambda net: setattr(net, "temperature", nn.Parameter(torch.ones(()))), ValueError, "belong to no pipeline"),
    ],
)
def test_contract_violations_are_explained(mutate, error, match):
    net = Net()
    mutate(net)
    with pytest.raises(error, match=match):
        pipeline_layers(net)


def test_meta_model_materializes_only_local_layers():
    with torch.device("meta"):
        net = Net()
    named = pipeline_layers(net)
    owner = [0, 0, 1, 1, 0, 1]
    local = keep_local_layers(net, named, owner, pipeline_rank=1, device=torch.device("cpu"))
    materialize_remaining(net, torch.device("cpu"))
    assert sorted(local) == ["blocks.1", "blocks.2", "head"]
    assert isinstance(net.embed, RemoteLayer) and isinstance(net.blocks[3], RemoteLayer)
    assert all(not p.is_meta for p in net.parameters())
    names = {n for n, _ in net.named_parameters()}
    assert names == {f"{layer}.{p}" for layer in ("blocks.1.0", "blocks.2.0", "head") for p in ("weight", "bias")}
    with pytest.raises(RuntimeError, match="lives on pipeline rank 0"):
        net.embed(torch.zeros(1, 3))


@pytest.mark.parametrize(
    ("alias", "message"),
    [
        (lambda net: setattr(net, "last", net.blocks[3]), "`last` is another name for `blocks.3` of pipeline layer"),
        (lambda net: setattr(net, "inner", net.blocks[1][0]), "`inner` is another name for `blocks.1.0` of pipeline"),
        (
            lambda net: setattr(net, "w", net.head.weight),
            "`w` is another name for `head.weight` of pipeline layer `head`",
        ),
    ],
)
def test_alias_of_a_layer_is_refused_before_partitioning(alias, message):
    """Raised by pipeline_layers() from the module alone, so every rank raises the same (see
    tests/distributed/test_aliased_layer.py); keep_local_layers would see it only on ranks not holding the layer."""
    messages = set()
    for _ in range(2):  # two ranks build their own copy of the module
        net = Net()
        alias(net)
        with pytest.raises(ValueError, match="another name") as raised:
            pipeline_layers(net)
        messages.add(str(raised.value))
    (only,) = messages
    assert message in only


def test_shared_buffers_and_parameter_free_modules_are_not_aliases():
    net = Net()
    table = torch.arange(4.0)
    for block in net.blocks:
        block.register_buffer("table", table)  # e.g. one rotary-embedding table used by every block
    net.register_buffer("table", table)
    net.act = net.blocks[0][1]  # a parameter-free module reachable twice keeps nothing on any rank
    assert len(pipeline_layers(net)) == 6


def test_keep_local_layers_still_refuses_a_leak():
    net = Net()
    named = pipeline_layers(net)
    net.last = net.blocks[3]  # added after the check: the backstop in keep_local_layers sees it
    with pytest.raises(ValueError, match="still reachable"):
        keep_local_layers(net, named, [0, 0, 0, 1, 1, 1], pipeline_rank=0, device=torch.device("cpu"))


class Pair(nn.Module):
    def forward(self, x):
        return x, 2 * x


class Add(nn.Module):
    def forward(self, pair):
        a, b = pair
        return a + b


def test_stage_module_passes_tuples_like_one_device():
    first = StageModule([nn.Identity(), Pair()], stage_index=0)
    second = StageModule([Add()], stage_index=1)
    x = torch.ones(2)
    # torch's pipeline unpacks a tuple output into several positional inputs of the next stage
    assert torch.equal(second(*first(x)), 3 * x)


def test_a_meta_layer_starts_from_the_seed_and_its_name_whichever_rank_and_layout_materializes_it():
    """Each module made on the meta device is initialized from (seed, its name in the module): the same values
    whether the whole model is materialized in one process or each rank keeps its own layers under any split, and
    whichever layers a rank drew before; another seed gives other values; the process's generators are untouched."""
    seed = 1234

    def meta_net() -> Net:
        with torch.device("meta"):
            return Net()

    whole = meta_net()
    from lightning_bfpp.engine.layers import materialize_meta

    materialize_meta(whole, torch.device("cpu"), seed=seed)
    want = whole.state_dict()
    before = torch.get_rng_state()
    for owners in ([0, 0, 0, 1, 1, 1], [0, 1, 0, 1, 0, 1], [1, 1, 1, 1, 1, 0]):
        for rank in (0, 1):
            net = meta_net()
            named = pipeline_layers(net)
            keep_local_layers(net, named, owners, pipeline_rank=rank, device=torch.device("cpu"), seed=seed)
            for name, value in net.state_dict().items():
                assert torch.equal(value, want[name]), (owners, rank, name)
    assert torch.equal(torch.get_rng_state(), before)
    other = meta_net()
    materialize_meta(other, torch.device("cpu"), seed=seed + 1)
    assert not torch.equal(other.state_dict()["head.weight"], want["head.weight"])
    # the default seed is the process's torch seed, as `seed_everything` sets it
    torch.manual_seed(seed)
    default = meta_net()
    materialize_meta(default, torch.device("cpu"))
    assert all(torch.equal(v, want[k]) for k, v in default.state_dict().items())
