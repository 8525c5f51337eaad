"""``BFPPStrategy``: the Lightning adapter. Lightning's hooks in call order, each delegating to its own module.

Builds on Lightning's ``ModelParallelStrategy`` (launcher, process group, collectives, FSDP2-compatible
precision checks, ``is_distributed``) and replaces what assumes a whole model per rank:

- ``setup_environment``: a (data × pipeline) mesh instead of (data × tensor);
- ``setup``: partition the module's ``pipeline_layers()``, keep and shard this rank's stages, make the copies
  of parameters tied across stages equal (:mod:`lightning_bfpp.engine.tied`), then create the optimizers over the
  local, sharded parameters;
- ``training_step`` / ``validation_step`` / ``test_step``: run the step through the pipeline
  (:class:`lightning_bfpp.engine.pipeline.Pipeline`), then replay what it logged on every rank
  (:mod:`lightning_bfpp.adapter.logged_values`). Forward and backward both happen inside ``training_step``, so
  Lightning's own zero-grad and backward are switched off and done here at the same points.

Elsewhere: building the pipeline (:mod:`lightning_bfpp.engine.build`), choosing the layout
(:mod:`~lightning_bfpp.adapter.auto`), what is refused (:mod:`~lightning_bfpp.adapter.guards`), checkpoints
(:mod:`~lightning_bfpp.adapter.checkpointing`), predictions (:mod:`~lightning_bfpp.adapter.predictions`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_bfpp.adapter import _lightning_compat as lc
from lightning_bfpp.adapter import auto, checkpointing, guards, predictions, weight_averaging
from lightning_bfpp.adapter.checkpointing import CheckpointPlace, parameter_names
from lightning_bfpp.adapter.collectives import PipelineCollectives
from lightning_bfpp.adapter.logged_values import LoggedValueSync, SharedStep
from lightning_bfpp.adapter.strategy_checkpoints import CheckpointMethods
from lightning_bfpp.adapter.summary import WholeModelSummary
from lightning_bfpp.adapter.user_step import LightningStep
from lightning_bfpp.engine import _compat, clipping, reductions
from lightning_bfpp.engine import checkpoint as engine_checkpoint
from lightning_bfpp.engine.agreement import AgreedError, PipelineAgreedError
from lightning_bfpp.engine.build import BuildContext, build_pipeline
from lightning_bfpp.engine.cpu_threads import available_cores, share_cores
from lightning_bfpp.engine.failures import FailureWatchdog, release_groups_at_exit, start_watchdog
from lightning_bfpp.engine.frozen import NothingToTrain, set_up_unless_all_frozen
from lightning_bfpp.engine.layers import compile_options, layer_weights, pipeline_layers, recompute_policy
from lightning_bfpp.engine.pipeline import Pipeline, StepResult
from lightning_bfpp.engine.random_state import shared_base_seed
from lightning_bfpp.engine.restarts import init_process_group_for_attempt
from lightning_bfpp.engine.sharding import (
    DATA_PARALLEL,
    PIPELINE_PARALLEL,
    build_mesh,
    data_parallel_mesh,
    second_data_parallel_group,
    tensor_parallel_mesh,
)
from lightning_bfpp.engine.tied import TiedParameters
from lightning_bfpp.engine.trace import TraceSession
from lightning_bfpp.plan.cluster import Cluster
from lightning_bfpp.plan.config import Auto, PartitionSpec, PipelineConfig
from lightning_bfpp.plan.costs import ModelProfile
from lightning_bfpp.plan.mesh import MeshShape
from lightning_bfpp.plan.plan import Plan
from lightning_bfpp.plan.search import Candidate

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_bfpp.engine.checkpoint.async_saving import AsyncSaver


class BFPPStrategy(CheckpointMethods, PipelineCollectives, ModelParallelStrategy):
    """Breadth-first pipeline parallelism over sharded data parallelism (Lamy-Poirier, MLSys 2023).

    The LightningModule adds one method, ``pipeline_layers()``, returning the ordered modules whose
    composition is ``forward``; its ``training_step`` stays single-device code calling ``self(...)``.

    Arguments:
        pipeline_parallel_size: ranks per pipeline (``p``). ``None`` (default): the processes of one node;
            ``"auto"``: the planner measures the model on one batch and picks the fastest layout (with
            ``stages_per_rank`` and ``num_microbatches`` where those are ``"auto"``), see ``cluster``.
        stages_per_rank: stages each pipeline rank holds (``v``); stage ``s`` lives on rank ``s mod p``.
            ``"auto"``: 2 if the model has at least ``2p`` layers, else 1.
        num_microbatches: micro-batches each batch is split into (``m``). ``"auto"``: ``p``.
        schedule: a registered schedule (:func:`lightning_bfpp.plan.schedule_names`): ``"breadth_first"`` (all
            micro-batches through one local stage before the next; the default), ``"breadth_first_zb"``
            (breadth-first with the backward split into input and weight gradients, the weight gradients placed
            where the rank would wait: zero-bubble's split in breadth-first's sweeps), ``"depth_first"``
            (Megatron's interleaved 1F1B), ``"gpipe"`` or ``"1f1b"`` (one stage per rank), ``"interleaved_zb"``
            (torch's interleaved zero bubble, ZB-H1), ``"zbv"`` (zero bubble with two stages per rank in a V), or
            ``"weight_passing"`` (TawPipe: no pipeline; every rank trains on its own micro-batches through the
            whole model while the layers, cut into one chunk per rank and each owned by one rank, travel to it
            along the node topology; see :mod:`lightning_bfpp.engine.runners.weight_passing`); or ``"auto"``: the
            planner measures the model and chooses the fastest schedule the other arguments allow (with
            ``stages_per_rank``, ``num_microbatches`` and ``pipeline_parallel_size`` where those are ``"auto"``).
        microbatch_group_size: for ``"depth_first"``, micro-batches per stage visit, from ``p``
            (depth-first, the default) to ``m`` (Megatron's breadth-first end of the same order).
        mesh_order: ``"data_pipeline"`` puts a pipeline's ranks on consecutive global ranks (inside a
            node); ``"pipeline_data"`` puts a data-parallel group's there, keeping the sharded
            all-gathers and reductions inside a node (the planner says which is faster).
        sharding: ``"full_shard"`` (ZeRO-3), ``"shard_grad_op"`` (ZeRO-2) or ``"no_shard"`` (replicated,
            gradients all-reduced) over the data-parallel group, one FSDP2 unit per stage; ``"hybrid_shard"``:
            ZeRO-3 over the data-parallel ranks of a node, replicated across nodes (FSDP2's HSDP; the
            data-parallel group must span several nodes, each holding several of its ranks, see
            ``processes_per_node``).
        prefetch_stages: how many upcoming stages' weight gathers are in flight while a stage computes (default
            1; 0 gathers each stage when its turn comes). Under ``"full_shard"`` at most ``prefetch_stages + 1``
            stages' full weights are held at once: raise it when a stage's compute is shorter than its gather.
        processes_per_node: the processes of one node, which decide what ``pipeline_parallel_size=None`` means
            and which ranks share a node for topology-aware sharding. ``None`` (default): Lightning's
            ``devices`` per node; set it to lay out one machine as several emulated nodes (tests, planning).
        data_parallel_size: pipeline replicas; ``"auto"``: world size / (``pipeline_parallel_size`` ×
            ``tensor_parallel_size``).
        tensor_parallel_size: processes that share each pipeline rank's layers by tensor parallelism (``t``,
            default 1): the mesh becomes (data, pipeline, ``"tensor_parallel"``) with a tensor group's ranks
            consecutive (inside a node). Each stage's layers are parallelised on the tensor group before FSDP2
            shards them over the data-parallel group, as torchtitan orders it: by the module's
            ``configure_model`` (Lightning's convention: ``parallelize_module(layer,
            self.device_mesh["tensor_parallel"], plan)`` on the layers), by ``parallelize_fn``, or by the module's
            ``parallelize_layer(layer, tp_mesh)`` (the Hugging Face adapter's, from the model's
            ``base_model_tp_plan``). A layer's output crosses to the next stage replicated over the tensor
            group (``use_local_output=True``, the default of ``ColwiseParallel`` / ``RowwiseParallel``).
        parallelize_fn: ``fn(layer, tp_mesh)``, called on each of this rank's pipeline layers with
            ``tensor_parallel_size > 1``; it may return the layer or None.
        partition: ``"parameters"`` (balance parameter counts), ``"uniform"`` (balance layer counts),
            ``"time"`` (balance forward + backward time per layer, measured on global rank 0 with one training
            batch, or taken from ``plan_profile``), or the number of layers of each stage, e.g. ``[2, 3, 3,
            2]``. Default: the module's ``pipeline_partition`` attribute if it has one (the Hugging Face
            adapter's modules say ``"time"``), else ``"parameters"``.
        activation_checkpointing: recompute layers' activations in backward instead of storing them:
            ``True`` for every layer, a layer type (or tuple of types), or a callable ``layer -> bool``.
        compile: compile each pipeline layer with ``torch.compile`` (``True``, or a dict of its arguments, e.g.
            ``{"mode": "max-autotune"}``), as torchtitan compiles each block: stages, transfers and sharding stay
            outside the compiled code. (``torch.compile(module)`` on the LightningModule is refused by Lightning
            for this strategy.)
        overlap_reductions: run each stage's gradient reduction while the rank's remaining backward computes,
            and wait for all of them once, before clipping and the optimizer step (see
            :mod:`lightning_bfpp.engine.reductions`): ``"stream"`` on FSDP2's reduction stream (CUDA), ``"thread"`` on
            a communication thread with a process group of its own (gloo). ``"auto"`` (default): ``"stream"``
            on CUDA, off elsewhere (on this package's CPU benchmark the thread gained nothing and held more
            memory); ``True``: the backend's way; ``False``: torch's blocking reduction.
        cluster: for ``pipeline_parallel_size="auto"``, the machine (a ``lightning_bfpp.plan.Cluster`` or its
            JSON, e.g. from ``python -m lightning_bfpp.plan calibrate``); default: this machine's devices
            and memory with assumed link bandwidths.
        plan_profile: for ``"auto"``, the model's costs (a ``ModelProfile`` or its JSON) instead of
            measuring them; needed for models created on the meta device.
        memory_budget: for ``"auto"``, the bytes per device the chosen layout's predicted peak must fit in
            (weights, gradients, optimizer state, gathered stages and activations); default: the cluster's memory.
        trace: a folder to write timelines of the first ``trace_steps`` training steps to: per step a Chrome
            trace (open it in Perfetto), a PNG with one row per rank, and a per-rank summary (busy, bubble,
            communication). Off (``None``) by default, and then nothing is recorded.
        failure_timeout: seconds after which a process that stopped responding (killed, lost) is declared
            dead and every other process stops; an exception on one process stops the others within about a
            second whatever this is (see :mod:`lightning_bfpp.engine.failures`). ``None``: only react to exceptions.
        process_group_backend: as for other Lightning strategies (default: gloo on CPU, nccl on CUDA).
        timeout: process-group timeout.
    """

    strategy_name = "bfpp"
    # a module's `pipeline_pretrained` weights (lightning_bfpp.load_pretrained, the Hugging Face adapter's names and
    # folders) are read here, each rank its own stages', when the layers are placed; modules leave them to us
    fills_pretrained_per_stage = True
    # `ckpt_path="last"` chooses among complete checkpoints only, and a save's leftover `.old` counts
    resolves_last_checkpoints = True

    def __init__(
        self,
        pipeline_parallel_size: int | Auto | None = None,
        stages_per_rank: int | Auto = "auto",
        num_microbatches: int | Auto = "auto",
        schedule: str = "breadth_first",  # a registered name or "auto", checked against the registry
        sharding: Literal["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"] = "full_shard",
        data_parallel_size: int | Auto = "auto",
        partition: PartitionSpec | None = None,
        microbatch_group_size: int | None = None,
        mesh_order: Literal["data_pipeline", "pipeline_data"] = "data_pipeline",
        prefetch_stages: int = 1,
        processes_per_node: int | None = None,
        tensor_parallel_size: int = 1,
        parallelize_fn: Callable[[nn.Module, Any], Any] | None = None,
        activation_checkpointing: bool | type | tuple[type, ...] | Callable[[nn.Module], bool] = False,
        compile: bool | Mapping[str, Any] = False,
        overlap_reductions: bool | Literal["auto", "stream", "thread"] = "auto",
        trace: str | Path | None = None,
        trace_steps: int = 4,
        cluster: Cluster | str | Path | None = None,
        plan_profile: ModelProfile | str | Path | None = None,
        memory_budget: int | None = None,
        failure_timeout: float | None = 30.0,
        async_checkpoint: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        _compat.check_torch_version()
        guards.check_arguments(overlap_reductions, trace_steps, failure_timeout, memory_budget, async_checkpoint)
        self.config = PipelineConfig(
            pipeline_parallel_size=pipeline_parallel_size,
            stages_per_rank=stages_per_rank,
            num_microbatches=num_microbatches,
            schedule=schedule,
            sharding=sharding,
            data_parallel_size=data_parallel_size,
            partition="parameters" if partition is None else partition,
            microbatch_group_size=microbatch_group_size,
            mesh_order=mesh_order,
            prefetch_stages=prefetch_stages,
            processes_per_node=processes_per_node,
            tensor_parallel_size=tensor_parallel_size,
        )
        self._parallelize_fn = parallelize_fn
        # None: the module's own `pipeline_partition` if it has one (the Hugging Face adapter's is "time")
        self._partition_given = partition is not None
        self._recompute = recompute_policy(activation_checkpointing)
        self._compile = compile_options(compile)
        self.overlap_reductions = overlap_reductions
        self.failure_timeout = failure_timeout
        self.async_checkpoint = async_checkpoint
        self._async_saver: AsyncSaver | None = None  # with async_checkpoint, once the process groups exist
        self._plan_cluster, self._plan_profile, self._memory_budget = cluster, plan_profile, memory_budget
        self.trace_dir = Path(trace) if trace is not None else None
        self.trace_steps = trace_steps
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self.mesh_shape: MeshShape | None = None
        # what runs: resolved at setup from the arguments and the model's layers (see lightning_bfpp.plan.plan)
        self.plan: Plan | None = None
        self.pipeline: Pipeline | None = None
        self.whole_model_summary: WholeModelSummary | None = None  # taken when the layers are split
        self.planned: Candidate | None = None  # "auto": the layout the planner chose, its predicted step and memory
        self.tied = TiedParameters([], {})  # copies of parameters tied across stages (see engine.tied)
        self._sharding_mesh: Any = None  # mesh[DATA_PARALLEL], or hybrid_shard's (replicate, shard) split of it
        self._watchdog: FailureWatchdog | None = None
        self._trace: TraceSession | None = None
        self._log_sync: LoggedValueSync | None = None
        self._checkpoint_place: CheckpointPlace | None = None
        self._ties_before_configure: list[tuple[str, ...]] = []
        # whether this process received SIGTERM (shared with the others by the step's collective)
        self._sigterm_noted: Callable[[], int] = lambda: 0
        lc.find_last_checkpoints_with(engine_checkpoint.complete_last_checkpoints)

    @property  # type: ignore[override]
    def precision_plugin(self) -> Precision:
        return stored if (stored := lc.stored_precision_plugin(self)) is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None:
            guards.check_precision(plugin)
        lc.store_precision_plugin(self, plugin)

    # -- processes and mesh ------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        guards.check_layer_sync(lc.layer_sync(self))
        guards.check_checkpoint_io(self.checkpoint_io)
        ParallelStrategy.setup_environment(self)
        self.set_world_ranks()
        if self.root_device.type == "cpu" and (threads := share_cores(self.num_processes)) is not None:
            rank_zero_info(
                f"BFPPStrategy: {self.num_processes} processes share this node's {available_cores()} cores:"
                f" torch runs {threads} intra-op thread(s) per process, as under torchrun (set"
                " OMP_NUM_THREADS to choose another count)."
            )
        # tied weights as the module has them before `configure_model` (see guards.check_ties_kept)
        self._ties_before_configure = guards.shared_parameters(self.lightning_module) if self.lightning_module else []
        if self.lightning_module is not None and (trainer := lc.attached_trainer(self.lightning_module)) is not None:
            guards.check_callbacks(trainer.callbacks)  # type: ignore[attr-defined]
            # before the callbacks' `setup`: their averages are built over the placed stages (adapter.weight_averaging)
            weight_averaging.defer_average_copies(trainer.callbacks)  # type: ignore[attr-defined]
        planned = self.config.pipeline_parallel_size == "auto"  # the mesh waits for the planner
        if not planned:  # every rank resolves the same sizes and raises the same error before any collective
            self.mesh_shape = self.config.resolve_mesh(self.world_size, self.processes_per_node)
        lc.setup_distributed(self, first=init_process_group_for_attempt)  # torchrun: a store per attempt
        release_groups_at_exit()
        if self._watchdog is None:
            self._watchdog = start_watchdog(self.global_rank, self.world_size, self.failure_timeout)
        self._start_async_saves()
        if not planned:
            self._build_device_mesh()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # an agreed error (and a SIGTERM stop, agreed through the step's collective) is raised by every rank at
        # the same point: nobody is left waiting; one agreed by a pipeline alone leaves the other replicas waiting
        agreed = isinstance(exception, (AgreedError, SIGTERMException))
        if isinstance(exception, SIGTERMException):  # a clean stop, on every rank at once: the save in flight counts
            self._finish_saves()
        if self._watchdog is not None and (not agreed or isinstance(exception, PipelineAgreedError)):
            self._watchdog.report(f"{type(exception).__name__}: {exception}")

    def _build_device_mesh(self) -> None:
        assert self.mesh_shape is not None and self.lightning_module is not None
        mesh = build_mesh(self.root_device, self.mesh_shape)
        lc.set_device_mesh(self, self.lightning_module, mesh)
        self._sharding_mesh = data_parallel_mesh(mesh, self.mesh_shape)  # hybrid_shard: creates its groups

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return checkpointing.resumable_loader(self.lightning_module, dataloader)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Samplers shard data over the data-parallel replicas; all ranks of a pipeline see the same batches.
        (Lightning's ``ModelParallelStrategy`` reads a mesh dimension it names itself.)"""
        mesh = self.device_mesh[DATA_PARALLEL]
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    @property
    def processes_per_node(self) -> int:
        """The processes of one node: ``processes_per_node`` if given, else Lightning's devices per node."""
        return self.config.node_size(self.world_size, self.num_processes)

    @property
    def pipeline_rank(self) -> int:
        return self.device_mesh[PIPELINE_PARALLEL].get_local_rank()

    @property
    def data_parallel_rank(self) -> int:
        return self.device_mesh[DATA_PARALLEL].get_local_rank()

    @property
    def tensor_rank(self) -> int:
        """This process's place in its tensor-parallel group (0 without tensor parallelism)."""
        tensor = tensor_parallel_mesh(self.device_mesh)
        return tensor.get_local_rank() if tensor is not None else 0

    # -- model -------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        guards.check_optimization(module)
        if self.pipeline is None:
            self._build_pipeline(trainer, module)
        elif self.pipeline.module is not module:
            raise RuntimeError(
                "BFPPStrategy was already set up with another LightningModule; create a new strategy (and"
                " Trainer) per model."
            )
        self.barrier()
        # Lightning clips by the norm of the gradients a rank holds; the pipeline needs the model's norm
        plugin = self.precision_plugin
        lc.replace_clip_grad_by_norm(plugin, partial(self._clip_grad_by_norm, plugin))
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            if not set_up_unless_all_frozen(lambda: self.setup_optimizers(trainer), module):
                self.optimizers, self.lr_scheduler_configs = [NothingToTrain()], []
            self.tied.check_optimizers([lc.unwrap_optimizer(o) for o in self.optimizers])
            if self.trace_dir is not None:
                self._trace = TraceSession(
                    self.trace_dir, self.trace_steps, self.global_rank, self.world_size, self.root_device,
                    report=rank_zero_info,
                )  # fmt: skip
                for optimizer in self.optimizers:
                    optimizer.register_step_post_hook(self._trace.optimizer_step_hook)
        self.setup_precision_plugin()
        replicas = self.distributed_sampler_kwargs["num_replicas"]  # the batches a step runs, world-wide
        lc.count_replicas_in_throughput(trainer.callbacks, replicas)  # type: ignore[attr-defined]
        if fitting:
            lc.optimizers_to_device(self.optimizers, self.root_device)
            weight_averaging.attach_averages(trainer.callbacks, module, self.root_device)  # type: ignore[attr-defined]

    def _build_pipeline(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Choose the layout, place this rank's stages, share the initial values, shard (see engine.build)."""
        device, zero, info = self.root_device, self.is_global_zero, rank_zero_info
        overlap = reductions.asked_for(self.overlap_reductions, device.type)
        if self.config.needs_planner:  # pipeline_parallel_size="auto" or schedule="auto"
            self.config, self.planned = auto.planned_config(
                self.config, module, trainer, cluster=self._plan_cluster, profile=self._plan_profile,
                overlap_reductions=overlap, world_size=self.world_size, processes_per_node=self.processes_per_node,
                device=device, is_global_zero=zero, info=info,
                parallelize=self._parallelize_fn or getattr(module, "parallelize_layer", None),
                pipeline_parallel_size=None if self.mesh_shape is None else self.mesh_shape.pipeline_parallel_size,
                memory_budget=self._memory_budget,
            )  # fmt: skip
            if self.mesh_shape is None:
                self.mesh_shape = self.config.resolve_mesh(self.world_size, self.processes_per_node)
                self._build_device_mesh()
        self.config, layer_times = auto.resolved_partition(
            self.config, module, trainer, partition_given=self._partition_given, profile=self._plan_profile,
            device=device, is_global_zero=zero, info=info,
        )  # fmt: skip
        base_seed = shared_base_seed(lambda seed: self.broadcast(seed, src=0))
        mesh_shape = self.mesh_shape
        assert mesh_shape is not None
        overlap_mode = reductions.overlap_mode(
            self.overlap_reductions, device.type, mesh_shape.data_parallel_size, self.config.sharding
        )
        reduce_group = None  # the communication thread's own group (a collective: every rank creates all)
        if overlap_mode == "thread":
            reduce_group = second_data_parallel_group(self.device_mesh, mesh_shape.shard_size)
        context = BuildContext(
            self.device_mesh, device, self.global_rank, self.world_size, self.processes_per_node,
            step_code=LightningStep(module), base_seed=base_seed, sharding_mesh=self._sharding_mesh,
            convert_module=self.precision_plugin.convert_module, recompute=self._recompute,
            compile_options=self._compile, overlap=overlap_mode, reduce_group=reduce_group, info=info,
            warn=rank_zero_warn, parallelize=self._parallelize_fn or getattr(module, "parallelize_layer", None),
            pretrained=getattr(module, "pipeline_pretrained", None),
            # a rank still waiting after this long is not coming: see Pipeline._agree_before_schedule
            agreement_timeout=None if self.failure_timeout is None else max(120.0, 4 * self.failure_timeout),
        )  # fmt: skip

        def layers_and_plan() -> tuple[list[tuple[str, nn.Module]], Plan]:
            # checks the module on every rank; some (layer placement) differ between ranks
            guards.check_metrics(module)
            guards.check_ties_kept(self._ties_before_configure, module, mesh_shape.tensor_parallel_size)
            named = pipeline_layers(module)
            names = [name for name, _ in named]
            self.plan = self.config.resolve_plan(mesh_shape, layer_weights(named), layer_times, names)
            self.whole_model_summary = WholeModelSummary.of(module, named, self.plan)
            full_names, trained_names = parameter_names(module)  # to read one-device optimizer states
            self._checkpoint_place = CheckpointPlace(
                self.data_parallel_rank, mesh_shape.data_parallel_size, self.pipeline_rank, zero,
                full_names, trained_names,
            )  # fmt: skip
            return named, self.plan

        self.pipeline, self.tied = build_pipeline(module, layers_and_plan, context)
        assert self._checkpoint_place is not None
        self._checkpoint_place.aliases = self.tied.aliases
        # Lightning's summary callbacks print the whole model (this rank keeps only its stages' layers)
        lc.summarize_with(trainer.callbacks, self.whole_model_summary)  # type: ignore[attr-defined]
        self._log_sync = LoggedValueSync(device)

    # -- training ----------------------------------------------------------------------------------

    @override
    def on_train_start(self) -> None:
        # the step's one collective carries Lightning's per-batch SIGTERM check (see LoggedValueSync)
        self._sigterm_noted = lc.share_sigterm_through(
            self.lightning_module.trainer,
            lambda: self._log_sync is not None and self._log_sync.stop_agreed,
            lambda: self._log_sync is not None and self._log_sync.requeue_agreed,
        )

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # set per batch: a callback (e.g. StochasticWeightAveraging) may have switched it back
        lc.set_skip_backward(self.lightning_module.trainer, True)
        self._saves_at_step_boundary()  # a save in flight is committed once every rank has written it

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.pipeline is not None and self.lightning_module is not None
        trainer = self.lightning_module.trainer
        batch_idx, accumulate = args[1], trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0:
            optimizer = trainer.optimizers[0]
            lc.call_callback_hooks(trainer, "on_before_zero_grad", optimizer)
            lc.call_module_hook(trainer, "on_before_zero_grad", optimizer)
            lc.call_module_hook(trainer, "optimizer_zero_grad", trainer.current_epoch, batch_idx, optimizer)
        tracer = self._trace.start_step() if self._trace is not None else None
        # a `mean_over_items` step (or one not seen yet) reduces each batch's gradients on their own, apart from
        # what the accumulation window already holds, to divide them by the batch's item count after the step
        per_batch = self.pipeline.reduces_each_batch(window_start=batch_idx % accumulate == 0)
        with self.precision_plugin.train_step_context():
            result = self.pipeline.run(
                "training_step", args[0], tuple(args[1:]), train=True, loss_scale=1.0 / accumulate, tracer=tracer,
                step_key=(0, trainer.current_epoch, batch_idx),
                last_batch=trainer.fit_loop.epoch_loop.batch_progress.is_last_batch,
                # within an accumulation window gradients are reduced once, with the window's last batch
                reduce_grads=per_batch or not lc.should_accumulate(trainer), set_aside_grads=per_batch,
            )  # fmt: skip
        sync_start = tracer.now() if tracer is not None else 0.0
        shared = self._share(result)
        self.pipeline.normalize_gradients(shared.loss_items, shared.replicas, accumulating=accumulate > 1)
        if tracer is not None:  # sharing the logged values waits for the pipeline's slowest rank: the drain
            tracer.add("step_sync", sync_start, tracer.now())
        lc.call_callback_hooks(trainer, "on_after_backward")
        lc.call_module_hook(trainer, "on_after_backward")
        if tracer is not None and self._trace is not None and self.plan is not None:
            self._trace.end_pipeline(trainer.global_step, self.plan.describe())
        return shared.loss

    def _share(self, result: StepResult) -> SharedStep:
        assert self._log_sync is not None and self.lightning_module is not None
        return self._log_sync.share_step(
            result, self.lightning_module, self.pipeline, stop_requested=self._sigterm_noted()
        )

    @override
    def on_train_end(self) -> None:
        self._finish_saves()
        if self._trace is not None:
            self._trace.flush()

    def _clip_grad_by_norm(self, plugin: Precision, optimizer: Optimizer, clip_val: float) -> None:
        clipping.clip_grad_norm(
            plugin.main_params(optimizer), clip_val, 2.0, self._pipeline_group(), exclude=self.tied.excluded_from_norm
        )

    def gradient_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the whole model's gradients, over every stage and shard, the same on every rank.

        A collective: call it on every rank, e.g. from ``on_before_optimizer_step`` to log it.
        Lightning's ``grad_norm`` utility sees only the shards this rank holds.
        """
        assert self.lightning_module is not None
        return clipping.total_norm(
            self.lightning_module.parameters(), norm_type, self._pipeline_group(), exclude=self.tied.excluded_from_norm
        )

    def _pipeline_group(self) -> Any:
        """The ranks a model's gradients are spread over beyond sharding (its executor's to say)."""
        assert self.pipeline is not None
        return self.pipeline.executor.gradient_group

    # -- evaluation --------------------------------------------------------------------------------

    def _eval_step(self, step_name: str, context: Any, args: tuple[Any, ...]) -> StepResult:
        assert self.pipeline is not None and self.lightning_module is not None
        trainer = self.lightning_module.trainer
        kind = ("validation_step", "test_step", "predict_step").index(step_name) + 1
        batch_idx, dataloader_idx = (args[1] if len(args) > 1 else 0), (args[2] if len(args) > 2 else 0)
        # evaluation may run under inference_mode (NCCL); tensors made there could never join the training
        # graph that shares these stages' FSDP buffers, so run the pipeline under plain no_grad
        with torch.inference_mode(False), torch.no_grad(), context:
            return self.pipeline.run(
                step_name, args[0], tuple(args[1:]), train=False,
                step_key=(kind, trainer.current_epoch, trainer.global_step, dataloader_idx, batch_idx),
                last_batch=lc.evaluation_loop(trainer, step_name).batch_progress.is_last_batch,
            )  # fmt: skip

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> None:
        self._share(self._eval_step("validation_step", self.precision_plugin.val_step_context(), args))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> None:
        self._share(self._eval_step("test_step", self.precision_plugin.test_step_context(), args))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The batch's predictions as one device returns them, on every rank of the pipeline that computed them."""
        result = self._eval_step("predict_step", self.precision_plugin.predict_step_context(), args)
        assert self.pipeline is not None
        group = self.pipeline.executor.output_group
        return predictions.batch_predictions(result, args[0], self.pipeline, self.root_device, group)

    @override
    def on_predict_end(self) -> None:
        """On global rank 0, replace the returned predictions by the whole dataset's, in dataset order."""
        assert self.plan is not None and self.lightning_module is not None
        trainer = self.lightning_module.trainer
        if self.plan.data_parallel_size > 1 and self.pipeline_rank == 0 and trainer.predict_loop.return_predictions:
            group = self.device_mesh[DATA_PARALLEL].get_group()
            predictions.gather_in_dataset_order(trainer, group, self.data_parallel_rank, rank_zero_warn)

    @override
    def teardown(self) -> None:
        if self.lightning_module is not None and (trainer := lc.attached_trainer(self.lightning_module)) is not None:
            lc.set_skip_backward(trainer, False)
            weight_averaging.restore_setup(trainer.callbacks)  # type: ignore[attr-defined]
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self.pipeline is not None:
            self.pipeline.executor.close()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Breadth-first pipeline parallelism over sharded data parallelism (lightning-bfpp)",
            override=True,
        )
