"""The private torch, transformers and Lightning API lightning_bfpp relies on still exists and behaves as used.

If one of these fails after an upgrade, lightning_bfpp/engine/_compat.py (torch, transformers) or _lightning_compat.py
(Lightning, torchmetrics) names the symbol; fix it there. torch's runtime is run for real, in a one-process gloo
world, so that what the package writes into it is shown to be what torch reads. An AST check keeps every other
module of the package off those private names.
"""

import ast
import contextlib
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_bfpp.adapter import _lightning_compat
from lightning_bfpp.engine import _compat
from lightning_bfpp.engine.layers import StageModule
from lightning_bfpp.engine.reductions import GradientReductions
from lightning_bfpp.engine.runtime import PlannedSchedule, build_stages, post_receives_first, transfers_independent
from lightning_bfpp.engine.torch_ir import add_send_waits, runs_on_torch, to_torch_action, torch_action_lists
from lightning_bfpp.engine.trace import StepTracer
from lightning_bfpp.plan.actions import Action, Kind, add_sharding_actions
from lightning_bfpp.plan.schedules import get_schedule
from lightning_bfpp.plan.schedules.breadth_first import breadth_first


def lower(schedule, sharding, m):
    return {rank: add_sharding_actions(actions, sharding, m) for rank, actions in schedule.items()}


def forward_only(p, v, m):
    return get_schedule("breadth_first").evaluation(p, v, m)


def test_supported_torch_version():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a tested release: no warning
        _compat.check_torch_version()
    assert _compat.torch_version() in _compat.SUPPORTED_TORCH
    assert _compat.private_api_problems() == []  # every private name and attribute the package drives is there


def test_a_newer_torch_is_warned_about_when_it_has_everything(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.16.0.dev20261201+cpu")
    with pytest.warns(UserWarning, match=r"tested on torch 2\.13, 2\.14, 2\.15; this is torch 2\.16\.0\.dev"):
        _compat.check_torch_version()


def test_a_newer_torch_missing_a_private_name_is_refused_at_construction(monkeypatch):
    from lightning_bfpp import BFPPStrategy

    monkeypatch.setattr(torch, "__version__", "2.16.0")
    monkeypatch.delattr(_compat.PipelineScheduleRuntime, "_prepare_schedule_with_comms")
    expected = r"torch 2\.16\.0 has changed .*_prepare_schedule_with_comms is missing.*'torch>=2\.13,<2\.16'"
    with pytest.raises(ImportError, match=expected):
        BFPPStrategy(pipeline_parallel_size=2)


def test_a_private_name_torch_moved_or_removed(monkeypatch):
    monkeypatch.setattr(_compat, "_MISSING", [])
    found = _compat._private("torch.distributed.pipelining.not_here:_Action", f"{_compat._SCHEDULES}:_Action")
    assert found is _compat.TorchAction and _compat._MISSING == []  # the second place, as after a move
    absent = _compat._private("torch.distributed.pipelining.schedules:_renamed_pass")
    assert _compat._MISSING == ["torch.distributed.pipelining.schedules:_renamed_pass"]
    assert absent.anything is absent  # the package still imports (class bodies, module-level lookups)
    with pytest.raises(ImportError, match="has no _renamed_pass"):
        absent()
    monkeypatch.setattr(torch, "__version__", "2.16.0")
    with pytest.raises(ImportError, match="schedules:_renamed_pass is missing"):
        _compat.check_torch_version()


def test_an_older_torch_is_refused_with_the_supported_range(monkeypatch):
    from lightning_bfpp import BFPPStrategy

    monkeypatch.setattr(torch, "__version__", "2.12.1")
    with pytest.raises(
        ImportError, match=r"needs torch 2\.13 or newer .*this is torch 2\.12\.1.*'torch>=2\.13,<2\.16'"
    ):
        BFPPStrategy(pipeline_parallel_size=2)


def test_action_kinds_map_onto_torch_ir():
    for kind in Kind:
        if runs_on_torch(_action(kind)):
            assert str(to_torch_action(_action(kind))) == str(_action(kind))
    # the wait actions exist from 2.15 on, and only there does the package's IR reach torch with them
    assert (
        runs_on_torch(_action(Kind.WAIT_REDUCE_GRAD))
        == _compat.TORCH_WAIT_ACTIONS
        == (_compat.torch_version() >= (2, 15))
    )
    assert (_compat.torch_version() >= (2, 15)) == _compat.MANUAL_BACKWARD_FINALIZATION


def _action(kind):
    from lightning_bfpp.plan.actions import Action

    return Action(3, kind, 1 if kind in (Kind.FORWARD, Kind.BACKWARD) else None)


def test_torch_adds_matched_sends_and_receives_to_our_plan():
    p, v, m = 2, 2, 3
    lowered = lower(breadth_first(p, v, m), "full_shard", m)
    with_comms = torch_action_lists(lowered, lambda s: s % p, p * v)
    text = {r: [str(a) for a in acts] for r, acts in with_comms.items()}
    # every forward of a non-last stage sends to the next stage, which receives it on the other rank
    assert "0SEND_F0" in text[0] and "1RECV_F0" in text[1]
    assert "3SEND_B2" in text[1] and "2RECV_B2" in text[0]
    # our data-parallel actions are kept in place (the reduction waits where torch has them)
    data_parallel = (Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD, Kind.WAIT_REDUCE_GRAD)
    assert [a for a in text[0] if a.endswith(tuple(k.value for k in data_parallel))] == [
        str(a) for a in lowered[0] if a.kind in data_parallel and runs_on_torch(a)
    ]
    # a receive is posted before the compute that consumes it
    assert text[1].index("1RECV_F0") < text[1].index("1F0")
    if _compat.TORCH_WAIT_ACTIONS:
        # a forward send is retired right after the rank's own backward of it, which proves it was received (where
        # the planner's memory model frees the output); a backward send at the end
        assert text[0][text[0].index("0B0") + 1] == "0WAIT_SEND_F0"
        assert text[1].index("3WAIT_SEND_B2") > text[1].index("1B2")
    else:
        assert not any("WAIT" in a for acts in text.values() for a in acts)


@pytest.mark.parametrize("name", ["breadth_first", "breadth_first_zb", "interleaved_zb", "depth_first", "zbv"])
def test_a_forward_send_is_retired_where_the_memory_model_frees_its_output(name):
    """The planner's simulator frees a stage's sent output at the rank's B or I of it; torch ≥ 2.15 keeps it alive
    until its WAIT_SEND_F, which the lists put right there."""
    from lightning_bfpp.plan import Plan

    if not _compat.TORCH_WAIT_ACTIONS:
        pytest.skip("torch < 2.15 has no send waits: the output lives until its backward, as the model counts")
    plan = Plan(name, 2, 2, 2, 4)
    lists = torch_action_lists(plan.lowered(), plan.stage_to_rank().__getitem__, plan.num_stages)
    for actions in lists.values():
        text = [str(a) for a in actions]
        for i, action in enumerate(text):
            if "WAIT_SEND_F" in action:
                stage, mb = action.split("WAIT_SEND_F")
                assert text[i - 1] in (f"{stage}B{mb}", f"{stage}I{mb}"), (name, text)


def test_send_waits_follow_torchs_own_rule():
    """On a forward-only list every wait comes at the end, as torch's own pass puts it (2.15: ``_add_wait_send``)."""
    p, v, m = 2, 2, 2
    plain = _compat.add_send_recv(
        {r: [to_torch_action(a) for a in acts] for r, acts in forward_only(p, v, m).items()},
        stage_to_rank=lambda s: s % p, num_stages=p * v,
    )  # fmt: skip
    if not _compat.TORCH_WAIT_ACTIONS:
        assert torch_action_lists(forward_only(p, v, m), lambda s: s % p, p * v) == plain  # no waits before 2.15
        return
    waited = {r: [str(a) for a in add_send_waits(acts)] for r, acts in plain.items()}
    sends = [a for a in waited[0] if "SEND_F" in a and "WAIT" not in a]
    assert waited[0][-len(sends) :] == ["0WAIT_SEND_F0", "0WAIT_SEND_F1", "2WAIT_SEND_F0", "2WAIT_SEND_F1"]
    from torch.distributed.pipelining.schedules import _add_wait_send

    assert {r: [str(a) for a in acts] for r, acts in _add_wait_send(plain).items()} == waited


def test_receives_posted_first_keep_their_order():
    """gloo matches a pair's messages in the order each side posted them: moving the receives to the front
    must keep their relative order and every other action's."""
    p, v, m = 2, 2, 3
    lowered = lower(breadth_first(p, v, m), "full_shard", m)
    with_comms = torch_action_lists(lowered, lambda s: s % p, p * v)
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
            stages, lower(plan, "full_shard", 2), 2, self.loss_fn, stage_to_rank={0: 0, 1: 0}, backward=backward
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
    inferences = _count_inferences(schedule)
    assert schedule.needs_metadata_inference
    rec.run()
    assert inferences == [1] and not schedule.needs_metadata_inference
    assert rec.executed == order.split()  # pipeline_order_with_comms is what torch executes
    assert rec.loss_calls[0] is True and rec.loss_calls[1:] == [False, False]  # our hook saw torch's inference
    for module in rec.modules:
        for param in module.parameters():  # _initialize_stages override: torch's cleanup would have dropped them
            torch.testing.assert_close(param.grad.full_tensor(), torch.ones(param.shape))
    rec.executed.clear()
    rec.run()
    assert rec.executed == order.split()
    assert inferences == [1]  # a later step enters no shape inference (its stand-in weights cost every step)

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


def _count_inferences(schedule: PlannedSchedule) -> list[int]:
    """How often ``schedule`` enters its shape inference from now on (a one-element counter)."""
    count = [0]
    original = schedule.metadata_inference

    @contextlib.contextmanager
    def counted():
        count[0] += 1
        with original():
            yield

    schedule.metadata_inference = counted  # type: ignore[method-assign]
    return count


def test_plan_placement_must_match_torchs(one_process):
    rec = _Recorded(one_process)
    stages = build_stages(rec.modules, [0, 1], 2, torch.device("cpu"), dist.group.WORLD)
    runtime = _compat.PipelineRuntime(stages, 2, loss_fn=rec.loss_fn)
    plan = torch_action_lists(lower(_plan("0F0 0F1 1F0 1F1 1B0 1B1 0B0 0B1"), "full_shard", 2), {0: 0, 1: 0}.get, 2)
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

    assert _compat._METADATA_FILENAME == _METADATA_FILENAME  # a literal in _compat, so checkpoint/ needs no Lightning
    assert not hasattr(_compat, "set_skip_backward")  # Lightning's names live in _lightning_compat only
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    sampler = torch.utils.data.RandomSampler(range(4))
    assert _lightning_compat.wrapped_sampler(DistributedSamplerWrapper(sampler, num_replicas=2, rank=0)) is sampler
    # SLURM's requeue (share_sigterm_through) and its checkpoint among "last" (find_last_checkpoints_with)
    connector = trainer._signal_connector
    assert callable(connector._slurm_sigusr_handler_fn) and callable(connector._sigterm_notifier_fn)
    assert trainer._checkpoint_connector._hpc_resume_path is None
    assert trainer._checkpoint_connector.hpc_save_path("root").endswith("hpc_ckpt_1.ckpt")
    assert trainer._accelerator_connector.cluster_environment is not None


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


@pytest.mark.parametrize(
    "name", ["tree_flatten", "tree_unflatten", "replicate", "unflatten_mesh", "PipeliningMetadataError"]
)
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


def _run_reductions(one_process, monkeypatch, mode, steps=2):
    """Two FSDP2 stages through torch's runtime with their reductions under ``mode`` (None: torch's own), logging
    in order each compute, each reduction's start and end (:class:`GradientReductions`' log), each time the compute
    stream is made to wait for another stream (a reduction's completion, on CUDA) and the optimizer step."""
    log: list[str] = []
    stream = _RecordingStream(log)
    monkeypatch.setattr(torch.cpu, "current_stream", lambda *args, **kwargs: stream)
    rec = _Recorded(one_process)
    rec.executed = log
    reductions = GradientReductions(dict(enumerate(rec.modules)), mode, log=log) if mode else None
    rec.schedule = rec.build(breadth_first(1, 2, 2), backward=True)
    if reductions is not None:
        rec.schedule.replace_gradient_reduction(reductions.reduce, reductions.wait)
    for _ in range(steps):  # the second step runs on the inferred shapes
        log.clear()
        rec.run()
        log.append("schedule done")
        if reductions is not None:
            reductions.finish()  # what the step does before clipping and the optimizer
        log.append("optimizer step")
    grads = [p.grad.full_tensor().clone() for m in rec.modules for p in m.parameters()]
    if reductions is not None:
        reductions.close()
    return log, grads


def test_stream_mode_reductions_overlap_the_backward_and_complete_before_the_optimizer(one_process, monkeypatch):
    """The CUDA path, on CPU: REDUCE_GRAD only issues each stage's reduction, so the compute stream waits for no
    reduction while the rank still has backward to run; each reduction really completes (FSDP2 makes the compute
    stream wait for it) before the optimizer step. On torch 2.15, whose pipeline stage switches FSDP2 to manual
    finalization, the old end-of-step callback waited for nothing: this test fails on it."""
    log, grads = _run_reductions(one_process, monkeypatch, "stream")
    last_compute = max(i for i, entry in enumerate(log) if entry[1:2] in ("F", "B"))
    assert log.index("reduce 1") < last_compute  # stage 1's reduction starts before stage 0's backward
    assert "compute waits" not in log[: last_compute + 1], log  # and nothing waits for it meanwhile
    optimizer = log.index("optimizer step")
    for stage in (0, 1):
        done = log.index(f"reduced {stage}")
        assert "compute waits" in log[log.index(f"reduce {stage}") : done + 1], log  # the wait is a real one
        assert done < optimizer
    blocking_log, blocking_grads = _run_reductions(one_process, monkeypatch, None)
    # torch's own reductions: before 2.15 each blocks inside its REDUCE_GRAD; from 2.15 on, at the plan's wait
    assert "compute waits" in blocking_log[: blocking_log.index("schedule done")]
    for got, want in zip(grads, blocking_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_thread_mode_reductions_complete_before_the_optimizer(one_process, monkeypatch):
    """The gloo path: each reduction runs on the communication thread and is joined at its WAIT_REDUCE_GRAD (or,
    before torch 2.15, just before the next reduction starts and at the step's end): none is still pending when the
    optimizer steps, and at most one is pending at any time."""
    log, grads = _run_reductions(one_process, monkeypatch, "thread")
    optimizer = log.index("optimizer step")
    pending = 0
    for entry in log[:optimizer]:
        pending += entry.startswith("reduce ") - entry.startswith("reduced ")
        assert pending <= 1, log
    assert pending == 0 and {"reduced 0", "reduced 1"} <= set(log[:optimizer]), log
    _, blocking_grads = _run_reductions(one_process, monkeypatch, None)
    for got, want in zip(grads, blocking_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_module_slots_are_the_modules_own_registries():
    """tied.py re-ties parameters and buffers by assigning these slots: the module must compute with what is
    assigned there."""
    module = nn.BatchNorm1d(3)
    linear = nn.Linear(2, 2, bias=False)
    assert _compat.parameter_slots(linear) == {"weight": linear.weight, "bias": None}
    replacement = nn.Parameter(torch.eye(2))
    _compat.parameter_slots(linear)["weight"] = replacement
    assert linear.weight is replacement and list(linear.parameters()) == [replacement]
    assert torch.equal(linear(torch.ones(1, 2)), torch.ones(1, 2))
    assert set(_compat.buffer_slots(module)) == {"running_mean", "running_var", "num_batches_tracked"}
    mean = torch.full((3,), 5.0)
    _compat.buffer_slots(module)["running_mean"] = mean
    assert module.running_mean is mean and any(b is mean for b in module.buffers())


def test_transformers_internals():
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lightning_bfpp.integrations.huggingface import _compat as transformers_compat

    config = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, initializer_range=0.5)  # fmt: skip
    for implementation in ("eager", "sdpa"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation)
        assert transformers_compat.attn_implementation(model.config) == implementation
    # the model's own init, on modules taken out of it: a norm back to ones, a projection to its std
    norm, projection = model.model.norm, model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        norm.weight.zero_()
        projection.weight.zero_()
    transformers_compat.init_weights_as_model(type(model), model.config, [norm, projection])
    assert torch.all(norm.weight == 1)
    assert 0.4 < projection.weight.std().item() < 0.6  # initializer_range, not torch's default


def test_distributed_checkpoint_is_read_whole(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.arange(4.0)}}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    torch.save({"hyper_parameters": {"lr": 0.1}}, tmp_path / "ckpt" / _compat._METADATA_FILENAME)
    loaded = _lightning_compat.load_distributed_checkpoint(tmp_path / "ckpt")
    assert torch.equal(loaded["model"]["w"], torch.arange(4.0)) and loaded["hyper_parameters"] == {"lr": 0.1}
    consolidated = _lightning_compat.consolidated_checkpoint(tmp_path / "ckpt")
    assert torch.equal(consolidated["state_dict"]["w"], torch.arange(4.0))


# -- no private name of torch, Lightning or transformers outside the two compat modules ----------------------

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_bfpp"
COMPAT_MODULES = {"_compat.py", "_lightning_compat.py"}
# what a private name here could belong to; an attribute's object has no static type, so any underscore name
# that this package does not define itself counts as theirs
FOREIGN = ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "transformers", "torchmetrics")
# underscore names that are documented public API of Python itself: namedtuple's fields
PYTHON_PUBLIC = {"_fields", "_asdict", "_replace", "_make", "_field_defaults"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_private_names(modules: list[Path]) -> set[str]:
    """Underscore names this package defines: functions, classes, module names and module-level names anywhere,
    and ``self._x``/``cls._x`` attributes and methods outside the compat modules (which subclass torch's classes
    and so define its private methods and attributes too)."""
    own = {m.stem for m in modules if _is_private(m.stem)}
    for module in modules:
        tree = ast.parse(module.read_text())
        compat = module.name in COMPAT_MODULES
        nodes = tree.body if compat else ast.walk(tree)
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                own.update(t.id for t in targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                own.add(node.attr)
    return {name for name in own if _is_private(name)}


def _stdlib_module_names(tree: ast.Module) -> set[str]:
    """Local names bound to standard-library modules (``os._exit`` is Python's public API)."""
    import sys

    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name for a in node.names if a.name.split(".")[0] in sys.stdlib_module_names)
    return names


def private_name_uses(module: Path, own: set[str]) -> list[str]:
    tree = ast.parse(module.read_text())
    stdlib = _stdlib_module_names(tree)
    found = []
    for node in ast.walk(tree):
        where = f"{module.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FOREIGN:
            parts = node.module.split(".")
            found += [f"{where} from {node.module} import {a.name}" for a in node.names if _is_private(a.name)]
            if any(_is_private(p) for p in parts):
                found.append(f"{where} from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [
                f"{where} import {a.name}"
                for a in node.names
                if a.name.split(".")[0] in FOREIGN and any(_is_private(p) for p in a.name.split("."))
            ]
        elif isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in own | PYTHON_PUBLIC:
            if not (isinstance(node.value, ast.Name) and node.value.id in stdlib):
                found.append(f"{where} {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
            and node.args[1].value not in own | PYTHON_PUBLIC
        ):
            found.append(f"{where} {ast.unparse(node)}")
    return found


def test_private_names_of_torch_lightning_and_transformers_only_in_the_compat_modules():
    """Every private name of torch, Lightning or transformers is reached through a named function of _compat or
    _lightning_compat, so that an upgrade that renames one breaks those modules (and the tests above) only."""
    modules = sorted(PACKAGE.rglob("*.py"))
    own = _own_private_names(modules)
    found = [
        f"{m.parent.name}/{use}" for m in modules if m.name not in COMPAT_MODULES for use in private_name_uses(m, own)
    ]
    assert not found, "private names outside the compat modules:\n" + "\n".join(found)


def test_the_private_name_check_finds_each_kind_of_use(tmp_path):
    source = tmp_path / "example.py"
    source.write_text(
        "import os\n"
        "import torch._dynamo\n"
        "from torch.distributed._composable import replicate\n"
        "from lightning.fabric.utilities.load import _load_distributed_checkpoint\n"
        "from lightning_bfpp.engine._compat import parameter_slots\n"
        "def f(module, config, row):\n"
        "    os._exit(0)\n"
        "    row._asdict()\n"
        "    getattr(module, '_buffers')\n"
        "    return module._parameters, config._attn_implementation, parameter_slots(module)\n"
    )
    found = [use.split(" ", 1)[1] for use in private_name_uses(source, _own_private_names([source]))]
    assert found == [
        "import torch._dynamo",
        "from torch.distributed._composable import ...",
        "from lightning.fabric.utilities.load import _load_distributed_checkpoint",
        "getattr(module, '_buffers')",
        "module._parameters",
        "config._attn_implementation",
    ]


def test_the_collective_counter_counts_collectives_and_nothing_else(one_process):
    """``CollectiveCounter`` (a ``TorchDispatchMode``): the profile counts each layer's tensor-parallel
    collectives with it; torch's functional collectives also dispatch waits and autograd wrappers."""
    from torch.distributed._functional_collectives import all_reduce as functional_all_reduce

    from lightning_bfpp.engine._compat import CollectiveCounter

    x = torch.ones(3, requires_grad=True)
    with CollectiveCounter() as counter:
        y = (x * 2).detach()
        dist.all_reduce(y)  # c10d
        z = functional_all_reduce(y, "sum", one_process) + 1  # functional, then its wait
        dist.broadcast(z, src=0)
    assert counter.count == 3
