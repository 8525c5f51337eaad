"""Token-mean losses over the global batch, batch digests and shape inference, without processes."""

from __future__ import annotations

import torch
from torch import nn

from lightning_bfpp import mean_over_items
from lightning_bfpp.adapter.logged_values import LoggedValueSync, LogSpec, combine_microbatches
from lightning_bfpp.adapter.user_step import LogRecorder
from lightning_bfpp.engine.loss import BatchGradients, item_sum
from lightning_bfpp.engine.microbatch import batch_digest
from lightning_bfpp.engine.runtime import ShapeInference


def test_mean_over_items_is_the_mean_and_keeps_its_sum_and_count():
    total = torch.tensor(6.0, requires_grad=True)
    loss = mean_over_items(total, torch.tensor(4))
    assert float(loss.detach()) == 1.5
    items = item_sum(loss)
    assert items is not None and items.total is not None and float(items.count) == 4.0
    loss.backward()
    assert float(total.grad) == 0.25  # one device: the gradient of the mean
    assert item_sum(loss * 1) is None and item_sum(torch.tensor(1.0)) is None


def test_a_batch_without_items_has_loss_zero():
    total = torch.zeros((), requires_grad=True)
    assert float(mean_over_items(total, 0)) == 0.0


def test_logged_item_means_combine_as_one_sum_over_one_count():
    """Micro-batches with 1 and 3 items: one device logs (2 + 3) / 4, not the mean of 2 and 1."""
    recorder = LogRecorder()
    recorder.log("train_loss", mean_over_items(torch.tensor(2.0), 1))
    recorder.log("train_loss", mean_over_items(torch.tensor(3.0), 3))
    recorder.log("plain", torch.tensor(4.0))
    recorder.log("plain", torch.tensor(6.0))
    specs, values = combine_microbatches(recorder.records, nn.Module())  # type: ignore[arg-type]
    assert [s.op for s in specs] == ["items", "mean"]
    assert values.tolist() == [5.0, 4.0, 5.0]  # (sum, count) travel for the item mean
    # two replicas: (5 over 4) and (1 over 0), plain means 5 and 7
    per_replica = torch.tensor([[5.0, 4.0, 5.0], [1.0, 0.0, 7.0]], dtype=torch.float64)
    reduced = LoggedValueSync._reduce(specs, per_replica)
    assert reduced.tolist() == [6.0 / 4.0, 6.0]


def test_the_step_loss_is_shared_with_the_global_item_count():
    sync = LoggedValueSync(torch.device("cpu"))
    from lightning_bfpp.engine.agreement import StepFailure

    shared = sync.share(
        [LogSpec("a", "mean", ())],
        torch.tensor([1.0], dtype=torch.float64),
        torch.tensor(9.0),
        StepFailure(),
        "training_step",
        loss_items=torch.tensor(6.0),
    )
    assert float(shared.loss) == 1.5 and shared.loss_items == 6.0 and shared.replicas == 1


def test_batch_gradients_scale_only_the_batch_and_keep_what_was_accumulated():
    w = nn.Parameter(torch.ones(2))
    w.grad = torch.tensor([1.0, 2.0])  # an earlier batch of the window, already normalised
    grads = BatchGradients([w])
    grads.set_aside()
    assert w.grad is None
    (w * torch.tensor([4.0, 8.0])).sum().backward()  # this batch's summed loss
    grads.finish(0.25)
    assert w.grad.tolist() == [2.0, 4.0]
    grads.set_aside()
    grads.finish(0.5)  # a batch that touched no parameter: what was accumulated stays
    assert w.grad.tolist() == [2.0, 4.0]


def test_batch_digest_tells_batches_apart_and_not_copies():
    batch = {"input_ids": torch.arange(12).reshape(3, 4), "mask": torch.ones(3, 4, dtype=torch.bool)}
    same = {"input_ids": torch.arange(12).reshape(3, 4).clone(), "mask": torch.ones(3, 4, dtype=torch.bool)}
    assert int(batch_digest(batch)) == int(batch_digest(same))
    other = {**same, "input_ids": same["input_ids"].clone()}
    other["input_ids"][2, 3] += 1
    assert int(batch_digest(other)) != int(batch_digest(batch))
    swapped = {**same, "input_ids": same["input_ids"].flip(0)}  # the same values in another order
    assert int(batch_digest(swapped)) != int(batch_digest(batch))
    floats = torch.randn(5, 3)
    assert int(batch_digest((floats, floats.bfloat16()))) == int(batch_digest((floats.clone(), floats.bfloat16())))
    assert 0 <= int(batch_digest(batch)) < 2**52
    assert batch_digest(["text"]) is None


def test_shape_inference_runs_the_stage_on_standins_and_gives_its_weights_back():
    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 5)
            self.b = nn.Linear(5, 2)
            self.b.weight.requires_grad_(False)
            self.calls = 0
            self.register_forward_pre_hook(lambda *_: setattr(self, "calls", self.calls + 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    stage = Stage()
    weights = {name: p for name, p in stage.named_parameters()}
    shadow = ShapeInference(stage, torch.device("cpu"))
    out = shadow(torch.randn(4, 3, requires_grad=True))
    assert out.shape == (4, 2) and out.requires_grad
    assert stage.calls == 0  # the stage's hooks (FSDP2's gather and reduction) do not run
    assert all(float(p.abs().sum()) == 0 for p in stage.parameters())  # zero stand-ins meanwhile
    assert not stage.b.weight.requires_grad
    shadow.restore()
    assert {name: p for name, p in stage.named_parameters()} == weights
    assert list(shadow.children()) == []  # torch's clean-up after inference does not reach the stage
