"""The forked generator states a step's code runs under (lightning_bfpp.random_state)."""

from __future__ import annotations

import random

import numpy as np
import torch

from lightning_bfpp.random_state import derive_seed, forked_random_state

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


def test_seeds_are_stable_and_distinct_per_key():
    assert derive_seed(42, (0, 1, 2)) == derive_seed(42, (0, 1, 2))
    keys = [(epoch, batch, replica, mb) for epoch in range(3) for batch in range(5) for replica in range(2)
            for mb in range(4)]  # fmt: skip
    assert len({derive_seed(42, k) for k in keys}) == len(keys)
    assert derive_seed(42, (0,)) != derive_seed(43, (0,))
    assert 0 <= derive_seed(2**62, (2**40,)) < 2**63
