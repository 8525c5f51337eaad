"""Weight averaging's pieces without processes: the local average against torch's ``AveragedModel``, the private
names of Lightning's callback the strategy reads, the deferred copy and the refusals at setup."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging, WeightAveraging
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn

from lightning_bfpp.adapter import _lightning_compat as lc
from lightning_bfpp.adapter import guards, weight_averaging
from lightning_bfpp.engine.averaging import LocalAveragedModel, mirror


def net() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
    model[2].weight = model[0].weight  # tied
    return model


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"use_buffers": True},
        {"avg_fn": get_ema_avg_fn(0.9), "use_buffers": True},
        {"multi_avg_fn": get_ema_multi_avg_fn(0.7)},
    ],
    ids=["equal", "equal_buffers", "ema", "ema_multi"],
)
def test_local_average_equals_torchs_averaged_model(kwargs):
    """Plain tensors (one process, weight passing's owned chunks): bit for bit torch's, tied weights and buffers
    included, under the module's own state_dict names."""
    mine, theirs = net(), net()
    ours, torchs = LocalAveragedModel(mine, **kwargs), AveragedModel(theirs, **kwargs)
    for _ in range(3):
        with torch.no_grad():
            for a, b in zip(mine.parameters(), theirs.parameters(), strict=True):
                step = torch.randn(a.shape)
                a.add_(step)
                b.add_(step)
        mine(torch.randn(5, 4))
        theirs.load_state_dict(mine.state_dict())  # the same running statistics
        ours.update_parameters(mine)
        torchs.update_parameters(theirs)
    got, want = ours.state_dict(), torchs.state_dict()
    assert list(got) == list(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_mirror_keeps_names_order_and_shared_tensors_without_copying():
    model = net()
    view = mirror(model)
    assert list(view.state_dict()) == list(model.state_dict())
    assert [id(p) for p in view.parameters()] == [id(p) for p in model.parameters()]
    assert [id(b) for b in view.buffers()] == [id(b) for b in model.buffers()]


def test_an_average_refuses_a_module_whose_parameters_changed():
    model = net()
    average = LocalAveragedModel(model)
    model.add_module("extra", nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="held"):
        average.update_parameters(model)


def test_lightning_callbacks_keep_the_attributes_the_strategy_reads():
    """lightning.pytorch.callbacks.weight_averaging's private attributes (`_device`, `_use_buffers`, `_kwargs`,
    `_average_model`) as the adapter reads them: if this fails after a Lightning upgrade, see _lightning_compat."""
    callback = EMAWeightAveraging(device="cpu", use_buffers=False, decay=0.5)
    device, use_buffers, kwargs = lc.averaging_arguments(callback)
    assert device == torch.device("cpu") and use_buffers is False and set(kwargs) == {"avg_fn"}
    assert lc.average_model(callback) is None
    lc.set_average_model(callback, "average")
    assert callback._average_model == "average"


def test_the_callbacks_copy_is_deferred_and_given_back():
    """Before the callbacks' `setup`, the whole-module copy of Lightning's `setup` is skipped (a subclass's own
    `setup` is left alone); teardown gives the class's method back."""

    class OwnSetup(WeightAveraging):
        def setup(self, trainer, pl_module, stage):
            self.ran = True

    plain, own = EMAWeightAveraging(), OwnSetup()
    weight_averaging.defer_average_copies([plain, own])
    plain.setup(None, nn.Linear(2, 2), "fit")
    assert lc.average_model(plain) is None
    assert "setup" not in vars(own)
    weight_averaging.restore_setup([plain, own])
    assert "setup" not in vars(plain) and type(plain).setup is WeightAveraging.setup

    module = net()
    weight_averaging.attach_averages([plain, own], module, torch.device("cpu"))
    assert isinstance(weight_averaging.average([plain, own]), LocalAveragedModel)
    assert isinstance(lc.average_model(own), LocalAveragedModel)


def test_two_averaging_callbacks_are_refused_by_name():
    with pytest.raises(
        RuntimeError, match=r"one weight-averaging callback, got 2 \(EMAWeightAveraging, WeightAveraging\)"
    ):
        guards.check_callbacks([EMAWeightAveraging(), WeightAveraging()])
    guards.check_callbacks([EMAWeightAveraging()])


def test_stochastic_weight_averaging_is_refused_pointing_to_weight_averaging():
    with pytest.raises(RuntimeError, match="cannot run StochasticWeightAveraging") as refused:
        guards.check_callbacks([StochasticWeightAveraging(swa_lrs=1e-2)])
    assert "`EMAWeightAveraging`" in str(refused.value)


def test_the_averaged_copy_is_separate_storage():
    model = net()
    average = LocalAveragedModel(model)
    for a, b in zip(average.module.parameters(), model.parameters(), strict=True):
        assert a.data_ptr() != b.data_ptr() and torch.equal(a, b)
    assert int(average.n_averaged) == 0
