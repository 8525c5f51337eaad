"""The private torch and Lightning API lightning_bfpp relies on still exists and behaves as used.

If one of these fails after an upgrade, lightning_bfpp/_compat.py names the symbol; fix it there.
"""

import inspect

import lightning as L
import pytest

from lightning_bfpp import _compat
from lightning_bfpp.runtime import PlannedSchedule, to_torch_action
from lightning_bfpp.schedule import Kind, breadth_first, lower


def test_supported_torch_version():
    _compat.check_torch_version()
    assert _compat.torch_version() in _compat.SUPPORTED_TORCH


def test_action_kinds_map_onto_torch_ir():
    for kind in Kind:
        assert str(to_torch_action(_action(kind))) == str(_action(kind))


def _action(kind):
    from lightning_bfpp.schedule import Action

    return Action(3, kind, 1 if kind in (Kind.FORWARD, Kind.BACKWARD) else None)


def test_torch_adds_matched_sends_and_receives_to_our_plan():
    p, v, m = 2, 2, 3
    lowered = lower(breadth_first(p, v, m), "full_shard", m)
    torch_plan = {r: [to_torch_action(a) for a in acts] for r, acts in lowered.items()}
    with_comms = _compat.add_send_recv(torch_plan, stage_to_rank=lambda s: s % p, num_stages=p * v)
    text = {r: [str(a) for a in acts] for r, acts in with_comms.items()}
    # every forward of a non-last stage sends to the next stage, which receives it on the other rank
    assert "0SEND_F0" in text[0] and "1RECV_F0" in text[1]
    assert "3SEND_B2" in text[1] and "2RECV_B2" in text[0]
    # our data-parallel actions are kept in place
    assert [a for a in text[0] if a.endswith(("UNSHARD", "RESHARD", "REDUCE_GRAD"))] == [
        str(a) for a in lowered[0] if a.kind in (Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD)
    ]
    # a receive is posted before the compute that consumes it
    assert text[1].index("1RECV_F0") < text[1].index("1F0")


def test_runtime_internals_used_by_planned_schedule():
    runtime = _compat.PipelineScheduleRuntime
    source = inspect.getsource(runtime._step_microbatches)
    for name in ("pipeline_order_with_comms", "_assert_unsharded", "perform_reduce_grad", "_maybe_compute_loss"):
        assert name in source, name
    assert "_initialize_stages" in inspect.getsource(runtime._step_microbatches)
    assert callable(runtime._initialize_stages)
    from torch.distributed.pipelining import PipelineStage

    assert hasattr(PipelineStage, "clear_runtime_states") and isinstance(PipelineStage.has_backward, property)
    assert "_post_metadata_inference_cleanup" in inspect.getsource(runtime._initialize_pp_stages)
    assert issubclass(PlannedSchedule, runtime)


def test_lightning_internals():
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    _compat.set_skip_backward(trainer, True)
    assert _compat.get_skip_backward(trainer) is True
    assert trainer.fit_loop.epoch_loop.automatic_optimization._skip_backward is True
    _compat.set_skip_backward(trainer, False)
    for name in ("_call_lightning_module_hook", "_call_callback_hooks"):
        assert callable(getattr(_compat.lightning_call, name))
    assert _compat._METADATA_FILENAME == "meta.pt"


@pytest.mark.parametrize("name", ["tree_flatten", "tree_unflatten", "replicate", "_materialize"])
def test_helpers_importable(name):
    assert callable(getattr(_compat, name))


def test_torchmetrics_and_prediction_loop_internals():
    import torch
    from torchmetrics.regression import MeanAbsoluteError

    metric = MeanAbsoluteError()
    metric(torch.ones(4), torch.zeros(4))
    assert float(_compat.metric_step_value(metric)) == 1.0
    count = metric._update_count
    _compat.set_metric_step_value(metric, torch.tensor(2.0), mark_updated=True)
    assert float(_compat.metric_step_value(metric)) == 2.0 and metric._update_count == count + 1
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert _compat.prediction_lists(trainer) == []
    from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    wrapped = _IndexBatchSamplerWrapper(BatchSampler(SequentialSampler(range(4)), 2, False))
    loader = DataLoader(list(range(4)), batch_sampler=wrapped)
    list(loader)
    assert _compat.seen_batch_indices(loader) == [[0, 1], [2, 3]]
