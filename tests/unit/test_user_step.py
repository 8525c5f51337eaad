"""Running unchanged step methods: capturing the model input, substituting the output, recording logs."""

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import BinaryAccuracy

from lightning_bfpp.adapter.logged_values import combine_microbatches, reduce_op
from lightning_bfpp.adapter.user_step import LogRecorder, capture_model_input, model_returns, step_loss


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.acc = BinaryAccuracy()

    def training_step(self, batch, batch_idx):
        x, y = batch["x"] * 2, batch["y"]
        out = self(x, scale=3)
        loss = F.mse_loss(out.squeeze(-1), y)
        self.log("loss", loss)
        self.log_dict({"n": float(len(y))}, reduce_fx="sum")
        return {"loss": loss, "extra": 1}

    def forward(self, x, scale=1):
        return self.layer(x) * scale


def batch():
    return {"x": torch.ones(4, 2), "y": torch.zeros(4)}


def test_capture_stops_at_the_model_call_with_its_arguments():
    net = Net()
    args, kwargs = capture_model_input(net, net.training_step, "training_step", batch(), 0)
    assert torch.equal(args[0], 2 * torch.ones(4, 2)) and kwargs == {"scale": 3}
    assert "forward" not in net.__dict__ and "log" not in net.__dict__  # restored


def test_capture_explains_a_step_that_never_calls_the_model():
    net = Net()
    with pytest.raises(RuntimeError, match="returned without calling `self"):
        capture_model_input(net, lambda b, i: None, "training_step", batch(), 0)


def test_model_returns_and_recorder():
    net = Net()
    recorder = LogRecorder()
    out = torch.full((4, 1), 0.5, requires_grad=True)
    with model_returns(net, out) as called, recorder.recording(net):
        result = net.training_step(batch(), 0)
    assert called()
    assert step_loss(result, "training_step").item() == pytest.approx(0.25)
    assert [r.name for r in recorder.records] == ["loss", "n"]
    assert recorder.records[1].options["reduce_fx"] == "sum" and recorder.records[1].value.item() == 4
    specs, values = combine_microbatches(recorder.records * 2, net)
    assert [s.name for s in specs] == ["loss", "n"] and values.tolist() == [0.25, 8.0]


def test_step_loss_rules():
    with pytest.raises(RuntimeError, match="returned None"):
        step_loss(None, "training_step")
    with pytest.raises(RuntimeError, match="must return the loss"):
        step_loss({"out": 1}, "training_step")


def test_unsupported_reduce_fx_is_explained():
    assert reduce_op(torch.max, "x") == "max"
    with pytest.raises(ValueError, match="needs reduce_fx"):
        reduce_op(torch.median, "x")
