"""Each CPU process's share of the cores (lightning_bfpp.engine.cpu_threads); the strategy's use of it is tested in
tests/distributed/test_sharding_and_data.py."""

import pytest
import torch

from lightning_bfpp.engine.cpu_threads import share_cores, threads_per_process


def test_threads_per_process_divides_the_cores_and_keeps_one():
    assert threads_per_process(16, 4) == 4
    assert threads_per_process(8, 3) == 2
    assert threads_per_process(2, 4) == 1
    assert threads_per_process(1, 1) == 1


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_share_cores_caps_the_threads_unless_the_user_chose(restore_threads, monkeypatch):
    monkeypatch.setattr("lightning_bfpp.engine.cpu_threads.available_cores", lambda: 8)
    torch.set_num_threads(8)
    assert share_cores(4, environ={"OMP_NUM_THREADS": "8"}) is None  # the user's choice stands
    assert torch.get_num_threads() == 8
    assert share_cores(1, environ={}) is None  # one process: all cores are its share
    assert share_cores(4, environ={}) == 2
    assert torch.get_num_threads() == 2
    assert share_cores(2, environ={}) is None  # never raised above what it is
    assert torch.get_num_threads() == 2
