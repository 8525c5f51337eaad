"""The private torch and Lightning API lightning_bfpp relies on still exists and behaves as used.

If one of these fails after an upgrade, lightning_bfpp/_compat.py (torch) or _lightning_compat.py (Lightning,
torchmetrics) names the symbol; fix it there. torch's runtime is run for real, in a one-process gloo world,
so that what the package writes into it is shown to be what torch reads.
"""

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_bfpp import _compat, _lightning_compat
from lightning_bfpp.layers import StageModule
from lightning_bfpp.runtime import (
    PlannedSchedule,
    build_stages,
    post_receives_first,
    to_torch_action,
    transfers_independent,
)
from lightning_bfpp.schedule import Action, Kind, breadth_first, forward_only, lower
from lightning_bfpp.trace import StepTracer


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


def test_receives_posted_first_keep_their_order():
    """gloo matches a pair's messages in the order each side posted them: moving the receives to the front
    must keep their relative order and every other action's."""
    p, v, m = 2, 2, 3
    lowered = lower(breadth_first(p, v, m), "full_shard", m)
    torch_plan = {r: [to_torch_action(a) for a in acts] for r, acts in lowered.items()}
    with_comms = _compat.add_send_recv(torch_plan, stage_to_rank=lambda s: s % p, num_stages=p * v)
    for actions in with_comms.values():
        early = post_receives_first(actions)
        receives = [str(a) for a in actions if "RECV" in str(a)]
        others = [str(a) for a in actions if "RECV" not in str(a)]
        assert receives and [str(a) for a in early] == receives + others


def test_receives_are_posted_early_only_where_transfers_are_independent(one_process):
    """gloo on CPU tensors: yes. CUDA tensors go through NCCL, where a receive posted early holds the
    communicator's stream and could deadlock against a later send: torch's placement must be kept."""
    assert transfers_independent(dist.group.WORLD, torch.device("cpu"))
    assert not transfers_independent(dist.group.WORLD, torch.device("cuda"))


@pytest.fixture(scope="module")
def one_process():
    """A one-process gloo world, so that torch's runtime runs for real (two stages on the one rank)."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert dist.get_world_size() == 1, "another test left a process group of several processes"
    yield init_device_mesh("cpu", (1,))
    if created:
        dist.destroy_process_group()


class _Recorded:
    """Two FSDP2-sharded stages on one rank whose forwards, backwards and loss calls are recorded."""

    def __init__(self, mesh):
        torch.manual_seed(0)
        # FSDP2 itself on a one-rank mesh (shard_stage leaves stages plain without data parallelism): the
        # private FSDP2 names the runtime drives are what these tests check
        self.modules = [
            fully_shard(StageModule([nn.Linear(4, 4)], s), mesh=mesh, reshard_after_forward=False) for s in range(2)
        ]
        self.executed: list[str] = []
        self.loss_calls: list[bool] = []  # whether torch was inferring shapes at each loss call
        self.schedule: PlannedSchedule | None = None

    def build(self, plan, backward: bool) -> PlannedSchedule:
        stages = build_stages(self.modules, [0, 1], 2, torch.device("cpu"), dist.group.WORLD)
        for stage in stages:
            for kind, method in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
                original = getattr(stage, method)

                def recorded(mb, *args, _original=original, _kind=kind, _stage=stage.stage_index, **kwargs):
                    self.executed.append(f"{_stage}{_kind}{mb}")
                    return _original(mb, *args, **kwargs)

                setattr(stage, method, recorded)
        self.schedule = PlannedSchedule(
            stages, lower(plan, "full_shard", 2), 2, self.loss_fn, pipeline_parallel_size=1, backward=backward
        )
        return self.schedule

    def loss_fn(self, output, microbatch):
        assert self.schedule is not None
        self.loss_calls.append(self.schedule.inferring_metadata)
        return output.sum() * 0.0  # zero gradients: what the parameters' .grad hold afterwards is what was kept

    def run(self) -> None:
        assert self.schedule is not None
        inputs = [(torch.randn(3, 4),), (torch.randn(3, 4),)]
        self.schedule.run(inputs, [{}, {}], [torch.tensor(0), torch.tensor(1)])


def _plan(text: str) -> dict[int, list[Action]]:
    kinds = {"F": Kind.FORWARD, "B": Kind.BACKWARD}
    return {0: [Action(int(a[0]), kinds[a[1]], int(a[2])) for a in text.split()]}


def test_torch_runtime_reads_what_planned_schedule_writes(one_process):
    """A real torch runtime executes our plan, in our order, keeps accumulated gradients through its shape
    inference, and runs no backward for a forward-only plan: each of the private names in _compat.PipelineRuntime
    is read by torch's own step code (a renamed one would be a dead attribute and one of these would fail)."""
    rec = _Recorded(one_process)
    # stages interleaved per micro-batch, backwards from the last micro-batch: an order only this plan gives
    order = "0F0 1F0 0F1 1F1 1B1 0B1 1B0 0B0"
    schedule = rec.build(_plan(order), backward=True)
    assert isinstance(schedule, _compat.PipelineScheduleRuntime) and schedule.runs_backward
    assert schedule.stage_index_to_group_rank == {0: 0, 1: 0}
    for module in rec.modules:
        for param in module.parameters():
            param.grad = torch.ones_like(param)  # as if an earlier step of an accumulation window had run
    rec.run()
    assert rec.executed == order.split()  # pipeline_order_with_comms is what torch executes
    assert rec.loss_calls[0] is True and rec.loss_calls[1:] == [False, False]  # our hook saw torch's inference
    for module in rec.modules:
        for param in module.parameters():  # _initialize_stages override: torch's cleanup would have dropped them
            torch.testing.assert_close(param.grad.full_tensor(), torch.ones(param.shape))
    rec.executed.clear()
    rec.run()
    assert rec.executed == order.split()

    # a forward-only plan: torch's validator would refuse it; no backward runs, and none is prepared
    rec.executed.clear()
    rec.loss_calls.clear()
    schedule = rec.build(forward_only(1, 2, 2), backward=False)
    assert schedule.stage_index_to_group_rank == {0: 0, 1: 0}
    rec.run()
    assert rec.executed == ["0F0", "0F1", "1F0", "1F1"]
    # with _has_backward left True, torch would run the loss on placeholder data to prepare a backward
    assert rec.loss_calls == [False, False]
    assert all(not stage.has_backward for stage in schedule.stages) and not schedule.runs_backward


def test_plan_placement_must_match_torchs(one_process):
    rec = _Recorded(one_process)
    stages = build_stages(rec.modules, [0, 1], 2, torch.device("cpu"), dist.group.WORLD)
    runtime = _compat.PipelineRuntime(stages, 2, loss_fn=rec.loss_fn)
    plan = {0: [to_torch_action(a) for a in lower(_plan("0F0 0F1 1F0 1F1 1B0 1B1 0B0 0B1"), "full_shard", 2)[0]]}
    with pytest.raises(RuntimeError, match="places stages on ranks"):
        runtime.install_plan(plan, {0: 0, 1: 1}, backward=True)


def test_tracer_hooks_torchs_runtime_for_one_step_only(one_process):
    rec = _Recorded(one_process)
    rec.build(_plan("0F0 0F1 1F0 1F1 1B0 1B1 0B0 0B1"), backward=True)
    rec.run()  # shapes inferred
    tracer = StepTracer(0, torch.device("cpu"))
    tracer.start_step()
    assert not _compat.runtime_is_hooked()
    with tracer.recording(rec.schedule):
        assert _compat.runtime_is_hooked()
        rec.run()
    assert not _compat.runtime_is_hooked() and "_assert_unsharded" not in vars(rec.schedule)
    labels = [s.label for s in tracer.spans if s.kind in ("forward", "backward")]
    assert labels == ["0F0", "0F1", "1F0", "1F1", "1B0", "1B1", "0B0", "0B1"]  # from torch's PP:<action> ranges
    assert {s.stage for s in tracer.spans if s.kind == "gather"} == {0, 1}
    assert any(s.kind == "gather_wait" for s in tracer.spans)  # through _assert_unsharded
    assert {s.stage for s in tracer.spans if s.kind == "reduce"} == {0, 1}


def test_lightning_internals():
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    _lightning_compat.set_skip_backward(trainer, True)
    assert _lightning_compat.get_skip_backward(trainer) is True
    assert trainer.fit_loop.epoch_loop.automatic_optimization._skip_backward is True
    _lightning_compat.set_skip_backward(trainer, False)
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    assert _compat._METADATA_FILENAME == _METADATA_FILENAME  # a literal in _compat, so checkpoint.py needs no Lightning
    assert not hasattr(_compat, "set_skip_backward")  # Lightning's names live in _lightning_compat only


def test_lightning_hooks_and_strategy_state():
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import ModelParallelStrategy

    calls = []

    class Module(L.LightningModule):
        def on_after_backward(self):
            calls.append("module")

    class Callback(L.Callback):
        def on_before_zero_grad(self, trainer, pl_module, optimizer):
            calls.append(("callback", optimizer))

    module = Module()
    assert _lightning_compat.attached_trainer(module) is None
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[Callback()])
    trainer.strategy.connect(module)
    module.trainer = trainer
    assert _lightning_compat.attached_trainer(module) is trainer
    _lightning_compat.call_module_hook(trainer, "on_after_backward")
    _lightning_compat.call_callback_hooks(trainer, "on_before_zero_grad", "opt")
    assert calls == ["module", ("callback", "opt")]

    plugin = Precision()
    _lightning_compat.store_precision_plugin(trainer.strategy, plugin)
    assert _lightning_compat.stored_precision_plugin(trainer.strategy) is plugin is trainer.strategy.precision_plugin
    clipped = []
    _lightning_compat.replace_clip_grad_by_norm(plugin, lambda optimizer, value: clipped.append(value))
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    plugin.clip_gradients(optimizer, 0.5, "norm")  # Lightning's clipping entry point reaches the replacement
    assert clipped == [0.5]
    _lightning_compat.optimizers_to_device([optimizer], torch.device("cpu"))
    assert _lightning_compat.unwrap_optimizer(LightningOptimizer(optimizer)) is optimizer
    assert _lightning_compat.unwrap_optimizer(optimizer) is optimizer

    strategy = ModelParallelStrategy()
    assert callable(strategy._setup_distributed)  # what setup_distributed calls
    mesh = object()
    _lightning_compat.set_device_mesh(strategy, module, mesh)
    assert strategy.device_mesh is mesh and module.device_mesh is mesh


@pytest.mark.parametrize("name", ["tree_flatten", "tree_unflatten", "replicate", "unflatten_mesh"])
def test_helpers_importable(name):
    assert callable(getattr(_compat, name))


def test_instance_attributes_shadow_methods_for_one_block():
    module = nn.Linear(2, 2)
    with _compat.instance_attributes(module, forward=lambda x: "patched"):
        assert module(torch.zeros(2)) == "patched" and "forward" not in dict(module.named_modules())
    assert isinstance(module(torch.zeros(2)), torch.Tensor)


def test_torchmetrics_and_prediction_loop_internals():
    from torchmetrics.regression import MeanAbsoluteError

    metric = MeanAbsoluteError()
    metric(torch.ones(4), torch.zeros(4))
    assert float(_lightning_compat.metric_step_value(metric)) == 1.0
    count = metric._update_count
    _lightning_compat.set_metric_step_value(metric, torch.tensor(2.0), mark_updated=True)
    assert float(_lightning_compat.metric_step_value(metric)) == 2.0 and metric._update_count == count + 1
    snapshot = _lightning_compat.metric_state_snapshot(metric)
    metric(torch.full((4,), 5.0), torch.zeros(4))
    assert float(metric.compute()) == 3.0
    _lightning_compat.restore_metric_state(metric, snapshot)
    assert float(metric.compute()) == 1.0 and metric._update_count == count + 1
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert _lightning_compat.prediction_lists(trainer) == []
    from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    wrapped = _IndexBatchSamplerWrapper(BatchSampler(SequentialSampler(range(4)), 2, False))
    loader = DataLoader(list(range(4)), batch_sampler=wrapped)
    list(loader)
    assert _lightning_compat.seen_batch_indices(loader) == [[0, 1], [2, 3]]


class _RecordingStream:
    """Stands in for the compute stream: records when something makes it wait for another stream."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def wait_event(self, event=None) -> None:
        self.log.append("compute waits")

    def wait_stream(self, stream=None) -> None:
        self.log.append("compute waits")

    def record_event(self, event=None):
        return torch.cpu.Event() if hasattr(torch.cpu, "Event") else None

    def synchronize(self) -> None:
        pass


def test_stream_mode_reductions_make_the_compute_stream_wait_only_after_the_last_action(one_process, monkeypatch):
    """The CUDA path, on CPU: REDUCE_GRAD issues each stage's reduction (FSDP2 post-backward) without its final
    callback, so the compute stream waits for no reduction before the schedule's last action; the waits come
    once, in ``finish`` (before clipping and the optimizer). torch's own REDUCE_GRAD waits at each stage."""
    from lightning_bfpp.reductions import GradientReductions

    def run(mode):
        log: list[str] = []
        stream = _RecordingStream(log)
        monkeypatch.setattr(torch.cpu, "current_stream", lambda *args, **kwargs: stream)
        rec = _Recorded(one_process)
        reductions = GradientReductions(dict(enumerate(rec.modules)), mode) if mode else None
        if reductions is not None:
            issue = reductions.reduce
            monkeypatch.setattr(reductions, "reduce", lambda s: log.append(f"reduce {s}") or issue(s))
        stages = build_stages(rec.modules, [0, 1], 2, torch.device("cpu"), dist.group.WORLD)
        plan = lower(breadth_first(1, 2, 2), "full_shard", 2)
        rec.schedule = PlannedSchedule(
            stages, plan, 2, lambda out, mb: out.pow(2).sum(), pipeline_parallel_size=1, backward=True,
            reductions=reductions,
        )  # fmt: skip
        for _ in range(2):  # the second step runs on the inferred shapes
            log.clear()
            rec.run()
            log.append("schedule done")
            if reductions is not None:
                reductions.finish()
        grads = [p.grad.full_tensor().clone() for m in rec.modules for p in m.parameters()]
        return log, grads

    log, grads = run("stream")
    done = log.index("schedule done")
    assert log[:done].count("reduce 1") == 1 and log[:done].count("reduce 0") == 1
    assert "compute waits" not in log[:done], log
    assert "compute waits" in log[done:], log  # the final callbacks, in finish()
    blocking_log, blocking_grads = run(None)
    assert "compute waits" in blocking_log[: blocking_log.index("schedule done")]  # torch's: per stage
    for got, want in zip(grads, blocking_grads, strict=True):
        torch.testing.assert_close(got, want)
