"""The forked generator states a step's code runs under (lightning_bfpp.engine.random_state)."""

from __future__ import annotations

import random

import numpy as np
import torch

from lightning_bfpp.engine.random_state import derive_seed, forked_random_state, forked_random_states

CPU = torch.device("cpu")


def draws() -> tuple[torch.Tensor, float, float]:
    return torch.randn(3), float(np.random.standard_normal()), random.random()


def test_the_same_seed_gives_the_same_draws_from_every_generator():
    with forked_random_state(123, CPU):
        first = draws()
    torch.randn(10)  # the process's own streams move on in between
    np.random.standard_normal(10)
    with forked_random_state(123, CPU):
        second = draws()
    assert torch.equal(first[0], second[0]) and first[1:] == second[1:]
    with forked_random_state(124, CPU):
        other = draws()
    assert not torch.equal(first[0], other[0]) and first[1] != other[1] and first[2] != other[2]


def test_the_process_streams_are_left_where_they_were():
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    expected = draws()
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    with forked_random_state(7, CPU):
        draws()
    got = draws()
    assert torch.equal(expected[0], got[0]) and expected[1:] == got[1:]


def test_one_fork_for_several_runs_draws_what_a_fork_per_run_draws():
    """The first stage captures every micro-batch's input under one fork, reseeded per micro-batch: the same
    draws as one fork per micro-batch, and the process's streams left where they were (a NumPy normal drawn
    before is cached in pairs: the cached half must survive too)."""
    seeds = [11, 12, 11]
    per_run = []
    for seed in seeds:
        with forked_random_state(seed, CPU):
            per_run.append(draws())
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    np.random.standard_normal()  # leaves the pair's second half cached
    expected = draws()
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    np.random.standard_normal()
    grouped = []
    with forked_random_states(CPU) as reseed:
        for seed in seeds:
            reseed(seed)
            grouped.append(draws())
    got = draws()
    for a, b in zip(per_run, grouped, strict=True):
        assert torch.equal(a[0], b[0]) and a[1:] == b[1:]
    assert torch.equal(per_run[0][0], per_run[2][0]) and not torch.equal(per_run[0][0], per_run[1][0])
    assert torch.equal(expected[0], got[0]) and expected[1:] == got[1:]


def test_seeds_are_stable_and_distinct_per_key():
    assert derive_seed(42, (0, 1, 2)) == derive_seed(42, (0, 1, 2))
    keys = [(epoch, batch, replica, mb) for epoch in range(3) for batch in range(5) for replica in range(2)
            for mb in range(4)]  # fmt: skip
    assert len({derive_seed(42, k) for k in keys}) == len(keys)
    assert derive_seed(42, (0,)) != derive_seed(43, (0,))
    assert 0 <= derive_seed(2**62, (2**40,)) < 2**63


def test_a_snapshot_replays_the_same_draws_and_leaves_the_stream_alone():
    """Weight passing recomputes a chunk's forward from the snapshot taken before it: the same dropout masks."""
    from lightning_bfpp.engine.random_state import RandomStateSnapshot

    torch.manual_seed(5)
    snapshot = RandomStateSnapshot(torch.device("cpu"))
    first = torch.rand(4)
    after = torch.get_rng_state()
    with snapshot.restored():
        again = torch.rand(4)
    assert torch.equal(first, again)
    assert torch.equal(torch.get_rng_state(), after)  # the process's stream goes on from where it was


def test_the_shared_base_seed_is_rank_zeros_torch_seed():
    from lightning_bfpp.engine.random_state import shared_base_seed

    torch.manual_seed(1234)
    sent = []
    assert shared_base_seed(lambda seed: sent.append(seed) or 99) == 99  # what rank 0 broadcast
    assert sent == [1234]
