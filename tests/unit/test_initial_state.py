"""The broadcast that gives every replica data-parallel rank 0's initial values (engine.initial_state)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_bfpp.engine.initial_state import (
    ALONE_BYTES,
    broadcast_tensors,
    buffers_outside,
    collective_plan,
    local_state,
    pack,
    unpack,
)


def mixed() -> list[torch.Tensor]:
    """Every dtype a module holds, 0-d and misaligned ones (an int64 after 3 float32s) included."""
    return [
        torch.randn(3),
        torch.tensor(7),
        torch.tensor([True, False, True]),
        torch.randn(2, 3, dtype=torch.bfloat16),
        torch.randn(4, dtype=torch.float64),
        torch.randn(4, 4).t(),  # not contiguous
    ]


def test_pack_and_unpack_round_trip_every_dtype():
    tensors = mixed()
    received = [torch.zeros_like(t) for t in tensors]
    unpack(pack(tensors), received)
    assert all(torch.equal(a, b) for a, b in zip(tensors, received, strict=True))


def test_large_contiguous_tensors_go_alone_and_the_rest_in_buckets():
    large, strided = torch.zeros(ALONE_BYTES // 4), torch.zeros(ALONE_BYTES // 2).view(-1, 2).t()
    small = [torch.zeros(10) for _ in range(5)]
    plan = collective_plan([small[0], large, small[1], strided, *small[2:], torch.zeros(0)], bucket_bytes=100)
    assert [[id(t) for t in members] for members in plan] == [
        [id(large)],
        [id(small[0]), id(small[1])],  # 80 bytes: the strided tensor does not fit
        [id(strided)],
        [id(small[2]), id(small[3])],
        [id(small[4])],
    ]


def test_local_state_and_buffers_outside_list_each_tensor_once_by_name():
    shared = torch.zeros(2)
    net = nn.Module()
    net.a, net.b = nn.BatchNorm1d(2), nn.Linear(2, 2)
    net.register_buffer("table", shared)
    net.a.register_buffer("table", shared)
    assert [id(t) for t in local_state([net.a, net.b, net.a])] == [
        id(t) for t in (*net.a.parameters(), *net.a.buffers(), *net.b.parameters())
    ]
    assert local_state([net.a], parameters=False) == list(net.a.buffers())
    a = net.a
    outside_b = [shared, a.running_mean, a.running_var, a.num_batches_tracked]  # `a.table` is `table`: once
    assert [id(t) for t in buffers_outside(net, ["b"])] == [id(t) for t in outside_b]
    assert [id(t) for t in buffers_outside(net, ["a", "b"])] == [id(shared)]


def test_a_receiving_rank_takes_the_source_ranks_values(monkeypatch):
    """Every collective of the plan, received: tensors of 1 MiB in place, the others unpacked from buckets."""

    def tensors(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        return [*mixed(), torch.randn(ALONE_BYTES // 4 + 1), torch.randn(ALONE_BYTES // 8, 2).t()]

    source, here = tensors(1), tensors(0)
    arriving = [pack(members) for members in collective_plan(source, bucket_bytes=64)]
    assert len(arriving) >= 4 and not all(torch.equal(a, b) for a, b in zip(source, here, strict=True))

    def receive(flat: torch.Tensor, group_src: int, group: object) -> None:
        assert group_src == 1 and group == "replicas"
        flat.copy_(arriving.pop(0))

    monkeypatch.setattr(dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group: 0)
    monkeypatch.setattr(dist, "broadcast", receive)
    sent = broadcast_tensors(here, 1, "replicas", bucket_bytes=64)  # type: ignore[arg-type]
    assert not arriving and sent == sum(t.numel() * t.element_size() for t in source)
    assert all(torch.equal(a, b) for a, b in zip(here, source, strict=True))
