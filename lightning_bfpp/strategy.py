"""``BFPPStrategy``: the Lightning adapter. Hooks in Lightning's call order, each delegating to a module.

Builds on Lightning's ``ModelParallelStrategy`` (launcher, process group, collectives, FSDP2-compatible
precision checks, ``is_distributed``) and replaces what assumes a whole model per rank:

- ``setup_environment``: a (data × pipeline) mesh instead of (data × tensor);
- ``setup``: partition the module's ``pipeline_layers()``, keep and shard this rank's stages, make the copies
  of parameters tied across stages equal (:mod:`lightning_bfpp.tied`), then create the optimizers over the
  local, sharded parameters;
- ``training_step`` / ``validation_step`` / ``test_step``: run the step through the pipeline
  (:class:`lightning_bfpp.pipeline.Pipeline`), then replay what it logged on every rank
  (:mod:`lightning_bfpp.logged_values`). Forward and backward both happen inside ``training_step``, so
  Lightning's own zero-grad and backward are switched off and done here at the same points.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from torchmetrics import Metric
from typing_extensions import override

from lightning_bfpp import _compat, auto, clipping
from lightning_bfpp import _lightning_compat as lc
from lightning_bfpp import checkpoint as checkpoint_io
from lightning_bfpp.agreement import AgreedError, PipelineAgreedError, agree, agree_on_failure
from lightning_bfpp.config import Auto, Layout, MeshShape, PartitionSpec, PipelineConfig
from lightning_bfpp.cpu_threads import available_cores, share_cores
from lightning_bfpp.executors import StageExecutor, WeightPassingExecutor
from lightning_bfpp.failures import FailureWatchdog
from lightning_bfpp.frozen import NothingToTrain, holds_trained_parameters, is_empty_parameter_list
from lightning_bfpp.initial_state import Broadcast, PendingBuild, buffers_outside, local_state
from lightning_bfpp.layers import (
    Recompute,
    StageModule,
    batch_statistics_layers,
    batch_statistics_warning,
    check_no_collective_layers,
    compile_options,
    compiled,
    keep_local_layers,
    layer_weights,
    materialize_meta,
    materialize_remaining,
    pipeline_layers,
    recompute_policy,
)
from lightning_bfpp.logged_values import (
    REDUCED_OVER_REPLICAS,
    LoggedValueSync,
    SharedStep,
    combine_microbatches,
    replay,
)
from lightning_bfpp.microbatch import batch_size
from lightning_bfpp.partition import StagePlan
from lightning_bfpp.pipeline import Pipeline, StepResult
from lightning_bfpp.plan.cluster import Cluster
from lightning_bfpp.plan.costs import ModelProfile
from lightning_bfpp.predictions import in_dataset_order, merge_microbatches
from lightning_bfpp.random_state import shared_base_seed
from lightning_bfpp.reductions import GradientReductions
from lightning_bfpp.sharding import (
    DATA_PARALLEL,
    PIPELINE_PARALLEL,
    build_mesh,
    data_parallel_mesh,
    schedule_sharding,
    second_data_parallel_group,
    shard_stage,
)
from lightning_bfpp.summary import WholeModelSummary
from lightning_bfpp.tied import TiedParameters, check_shared_modules, find_ties, record_identities, retie
from lightning_bfpp.topology import NodeTopology
from lightning_bfpp.trace import TraceSession
from lightning_bfpp.user_step import LightningStep, collective_refusal
from lightning_bfpp.weight_passing import ChunkTransfers, ChunkWeights, chunk_buffers, follow_mode

if TYPE_CHECKING:
    import lightning.pytorch as pl

_WATCHDOGS_STARTED = 0


class BFPPStrategy(ModelParallelStrategy):
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
        schedule: ``"breadth_first"`` (all micro-batches through one local stage before the next; the
            default), ``"depth_first"`` (Megatron's interleaved 1F1B), ``"gpipe"`` or ``"1f1b"`` (one stage
            per rank), or ``"weight_passing"`` (TawPipe: no pipeline; every rank trains on its own
            micro-batches through the whole model while the layers, cut into one chunk per rank and each owned
            by one rank, travel to it along the node topology; see :mod:`lightning_bfpp.weight_passing`).
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
        data_parallel_size: pipeline replicas; ``"auto"``: world size / ``pipeline_parallel_size``.
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
            :mod:`lightning_bfpp.reductions`): ``"stream"`` on FSDP2's reduction stream (CUDA), ``"thread"`` on
            a communication thread with a process group of its own (gloo). ``"auto"`` (default): ``"stream"``
            on CUDA, off elsewhere (on this package's CPU benchmark the thread gained nothing and held more
            memory); ``True``: the backend's way; ``False``: torch's blocking reduction.
        cluster: for ``pipeline_parallel_size="auto"``, the machine (a ``lightning_bfpp.plan.Cluster`` or its
            JSON, e.g. from ``python -m lightning_bfpp.plan calibrate``); default: this machine's devices
            and memory with assumed link bandwidths.
        plan_profile: for ``"auto"``, the model's costs (a ``ModelProfile`` or its JSON) instead of
            measuring them; needed for models created on the meta device.
        trace: a folder to write timelines of the first ``trace_steps`` training steps to: per step a Chrome
            trace (open it in Perfetto), a PNG with one row per rank, and a per-rank summary (busy, bubble,
            communication). Off (``None``) by default, and then nothing is recorded.
        failure_timeout: seconds after which a process that stopped responding (killed, lost) is declared
            dead and every other process stops; an exception on one process stops the others within about a
            second whatever this is (see :mod:`lightning_bfpp.failures`). ``None``: only react to exceptions.
        process_group_backend: as for other Lightning strategies (default: gloo on CPU, nccl on CUDA).
        timeout: process-group timeout.
    """

    strategy_name = "bfpp"

    def __init__(
        self,
        pipeline_parallel_size: int | Auto | None = None,
        stages_per_rank: int | Auto = "auto",
        num_microbatches: int | Auto = "auto",
        schedule: Literal["breadth_first", "depth_first", "gpipe", "1f1b", "weight_passing"] = "breadth_first",
        sharding: Literal["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"] = "full_shard",
        data_parallel_size: int | Auto = "auto",
        partition: PartitionSpec | None = None,
        microbatch_group_size: int | None = None,
        mesh_order: Literal["data_pipeline", "pipeline_data"] = "data_pipeline",
        prefetch_stages: int = 1,
        processes_per_node: int | None = None,
        activation_checkpointing: bool | type | tuple[type, ...] | Callable[[nn.Module], bool] = False,
        compile: bool | Mapping[str, Any] = False,
        overlap_reductions: bool | Literal["auto", "stream", "thread"] = "auto",
        trace: str | Path | None = None,
        trace_steps: int = 4,
        cluster: Cluster | str | Path | None = None,
        plan_profile: ModelProfile | str | Path | None = None,
        failure_timeout: float | None = 30.0,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        _compat.check_torch_version()
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
        )
        self._recompute = recompute_policy(activation_checkpointing)
        self._compile = compile_options(compile)
        self.whole_model_summary: WholeModelSummary | None = None  # taken when the layers are split
        # None: the module's own `pipeline_partition` if it has one (the Hugging Face adapter's is "time")
        self._partition_given = partition is not None
        self._layer_times: list[float] | None = None  # partition="time": measured at setup
        if not isinstance(overlap_reductions, bool) and overlap_reductions not in ("auto", "stream", "thread"):
            raise ValueError(
                "BFPPStrategy: `overlap_reductions` must be a bool, 'auto', 'stream' or 'thread', got"
                f" {overlap_reductions!r}."
            )
        self.overlap_reductions = overlap_reductions
        if isinstance(trace_steps, bool) or not isinstance(trace_steps, int) or trace_steps < 1:
            raise ValueError(f"BFPPStrategy: `trace_steps` must be a positive int, got {trace_steps!r}.")
        if failure_timeout is not None and (
            isinstance(failure_timeout, bool) or not isinstance(failure_timeout, (int, float)) or failure_timeout <= 0
        ):
            raise ValueError(
                "BFPPStrategy: `failure_timeout` must be a positive number of seconds or None, got"
                f" {failure_timeout!r}."
            )
        self.failure_timeout = failure_timeout
        self._watchdog: FailureWatchdog | None = None
        self._plan_cluster = cluster
        self._plan_profile = plan_profile
        self.trace_dir = Path(trace) if trace is not None else None
        self.trace_steps = trace_steps
        self._trace: TraceSession | None = None
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self.mesh_shape: MeshShape | None = None
        self.layout: Layout | None = None
        self.stage_plan: StagePlan | None = None
        self.pipeline: Pipeline | None = None
        self._log_sync: LoggedValueSync | None = None
        # whether this process received SIGTERM (shared with the others by the step's collective)
        self._sigterm_noted: Callable[[], bool] = lambda: False
        self._full_parameter_names: list[str] = []
        self._trained_parameter_names: list[str] = []
        # copies of parameters tied across stages (see lightning_bfpp.tied)
        self.tied = TiedParameters([], {})
        # the mesh the stages shard over: mesh[DATA_PARALLEL], or hybrid_shard's (replicate, shard) split of it
        self._sharding_mesh: Any = None

    # -- precision ---------------------------------------------------------------------------------

    @property  # type: ignore[override]
    def precision_plugin(self) -> Precision:
        return stored if (stored := lc.stored_precision_plugin(self)) is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None:
            _check_precision(plugin)
        lc.store_precision_plugin(self, plugin)

    # -- processes and mesh ------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        ParallelStrategy.setup_environment(self)
        self.set_world_ranks()
        if self.root_device.type == "cpu":
            threads = share_cores(self.num_processes)
            if threads is not None:
                rank_zero_info(
                    f"BFPPStrategy: {self.num_processes} processes share this node's {available_cores()} cores:"
                    f" torch runs {threads} intra-op thread(s) per process, as under torchrun (set"
                    " OMP_NUM_THREADS to choose another count)."
                )
        planned = self.config.pipeline_parallel_size == "auto"
        if not planned:  # every rank resolves the same sizes and raises the same error before any collective
            self.mesh_shape = self.config.resolve_mesh(self.world_size, self.processes_per_node)
        lc.setup_distributed(self)
        self._start_watchdog()
        if not planned:
            self._build_device_mesh()

    def _start_watchdog(self) -> None:
        global _WATCHDOGS_STARTED
        if self._watchdog is not None or self.world_size == 1 or not dist.is_initialized():
            return
        _WATCHDOGS_STARTED += 1  # every process sets strategies up in the same order: the same namespace
        self._watchdog = FailureWatchdog(
            _compat.default_store(),
            self.global_rank,
            self.world_size,
            namespace=str(_WATCHDOGS_STARTED),
            timeout=self.failure_timeout,
        )
        self._watchdog.start()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # an agreed error (and a SIGTERM stop, agreed through the step's collective) is raised by every rank at
        # the same point: nobody is left waiting; one agreed by a pipeline alone leaves the other replicas waiting
        agreed = isinstance(exception, (AgreedError, SIGTERMException)) and not isinstance(
            exception, PipelineAgreedError
        )
        if self._watchdog is not None and not agreed:
            self._watchdog.report(f"{type(exception).__name__}: {exception}")

    def _build_device_mesh(self) -> None:
        assert self.mesh_shape is not None and self.lightning_module is not None
        mesh = build_mesh(self.root_device, self.mesh_shape)
        lc.set_device_mesh(self, self.lightning_module, mesh)
        self._sharding_mesh = data_parallel_mesh(mesh, self.mesh_shape)  # hybrid_shard: creates its groups

    def _plan_layout(self, trainer: pl.Trainer) -> None:
        """``pipeline_parallel_size="auto"``: the planner picks the layout (see lightning_bfpp.auto)."""
        assert self.lightning_module is not None
        per_node = self.processes_per_node
        cluster = auto.load_cluster(self._plan_cluster, self.world_size, per_node, self.root_device)
        # the planner models the reductions this strategy will run
        cluster = dataclasses.replace(cluster, overlap_reductions=self._overlaps_reductions())
        profile = self._plan_profile
        if profile is not None and not isinstance(profile, ModelProfile):
            profile = ModelProfile.from_json(Path(profile))
        best, table = auto.choose(
            self.config, self.lightning_module, trainer, cluster, profile, self.root_device, self.is_global_zero
        )
        chosen = best.config
        rank_zero_info(f"BFPPStrategy(pipeline_parallel_size='auto') chose {chosen.describe()}:\n{table}")
        self.config = dataclasses.replace(
            self.config,
            pipeline_parallel_size=chosen.pipeline_parallel_size,
            stages_per_rank=chosen.stages_per_rank,
            num_microbatches=chosen.num_microbatches,
            microbatch_group_size=chosen.microbatch_group_size,
        )
        self.mesh_shape = self.config.resolve_mesh(self.world_size, per_node)
        self._build_device_mesh()

    def _resolve_partition(self, trainer: pl.Trainer) -> None:
        """The module's preferred partition when none was given; for ``"time"``, each layer's measured time."""
        module = self.lightning_module
        assert module is not None
        preferred = getattr(module, "pipeline_partition", None)
        if not self._partition_given and preferred is not None:
            meta = any(p.is_meta for p in module.parameters())
            if preferred == "time" and meta and self._plan_profile is None:
                rank_zero_info(
                    f"BFPPStrategy: `{type(module).__name__}` asks for partition='time', but it was created on the"
                    " meta device and cannot be measured; partitioning by parameters (pass `plan_profile=` to"
                    " balance by time)."
                )
            else:
                self.config = dataclasses.replace(self.config, partition=preferred)
        if self.config.partition == "time":
            profile = self._plan_profile
            if profile is not None and not isinstance(profile, ModelProfile):
                profile = ModelProfile.from_json(Path(profile))
            if profile is None and trainer.state.fn != TrainerFn.FITTING:
                # measuring needs a training batch; outside fit (validate, test, predict) the stages only need
                # to be consistent, not balanced: checkpoints load into any partition
                rank_zero_info("BFPPStrategy: partition='time' outside `fit` balances parameters instead.")
                self.config = dataclasses.replace(self.config, partition="parameters")
                return
            self._layer_times = auto.layer_times(module, trainer, profile, self.root_device, self.is_global_zero)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Samplers shard data over the data-parallel replicas; all ranks of a pipeline see the same batches.

        (Lightning's ``ModelParallelStrategy`` reads a mesh dimension it names itself; this strategy's own
        mesh names are used here explicitly.)
        """
        mesh = self.device_mesh[DATA_PARALLEL]
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    @property
    def processes_per_node(self) -> int:
        """The processes of one node: ``processes_per_node`` if given, else Lightning's devices per node."""
        given = self.config.processes_per_node
        if given is not None:
            if self.world_size % given:
                raise ValueError(
                    f"BFPPStrategy: `processes_per_node={given}` does not divide the world size ({self.world_size})."
                )
            return given
        return max(self.num_processes, 1)

    @property
    def pipeline_rank(self) -> int:
        return self.device_mesh[PIPELINE_PARALLEL].get_local_rank()

    @property
    def data_parallel_rank(self) -> int:
        return self.device_mesh[DATA_PARALLEL].get_local_rank()

    # -- model -------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, StochasticWeightAveraging):
                raise RuntimeError(
                    "BFPPStrategy cannot run StochasticWeightAveraging: it averages and re-evaluates the whole model"
                    " on every rank and switches Lightning's own backward back on, while each pipeline rank holds"
                    " a shard of a few stages. Average weights inside the module instead (e.g. an EMA of the"
                    " local parameters in `on_train_batch_end`), or average checkpoints offline."
                )
        if not module.automatic_optimization:
            raise RuntimeError(
                "BFPPStrategy runs forward and backward inside the pipeline and needs automatic optimization;"
                " remove `self.automatic_optimization = False` and `manual_backward` from the module."
            )
        if self.pipeline is None:
            if self.mesh_shape is None:
                self._plan_layout(trainer)
            self._resolve_partition(trainer)
            base_seed = shared_base_seed(lambda seed: self.broadcast(seed, src=0))
            reduce_group = self._reduction_group()
            # building checks the module on every rank; some checks (layer placement) differ between ranks
            pending = agree(lambda: self._build_pipeline(module, base_seed, reduce_group), "setting up the pipeline")
            # Lightning's summary callbacks print the whole model (this rank keeps only its stages' layers)
            lc.summarize_with(trainer.callbacks, self.whole_model_summary)  # type: ignore[attr-defined]
            # collectives, so after the agreement: every replica takes data-parallel rank 0's initial values (FSDP2
            # does not broadcast them as DDP does, see lightning_bfpp.initial_state), then the stages are sharded
            pending.share()
            self.pipeline = agree(pending.finish, "sharding the pipeline's stages")
            # collectives, so after the agreement: every rank knows every tie and creates its groups in one order
            self.tied.create_groups(self.device_mesh, DATA_PARALLEL, PIPELINE_PARALLEL)
            self.pipeline.executor.connect()  # collectives: after the agreement, in one order on every rank
            self.tied.broadcast_from_owner()
        elif self.pipeline.module is not module:
            raise RuntimeError(
                "BFPPStrategy was already set up with another LightningModule; create a new strategy (and"
                " Trainer) per model."
            )
        self.barrier()
        # Lightning clips by the norm of the gradients a rank holds; the pipeline needs the model's norm
        plugin = self.precision_plugin
        lc.replace_clip_grad_by_norm(plugin, partial(self._clip_grad_by_norm, plugin))
        if trainer.state.fn == TrainerFn.FITTING:
            self._setup_optimizers(trainer, module)
            self.tied.check_optimizers([lc.unwrap_optimizer(o) for o in self.optimizers])
            if self.trace_dir is not None:
                self._trace = TraceSession(
                    self.trace_dir,
                    self.trace_steps,
                    self.global_rank,
                    self.world_size,
                    self.root_device,
                    report=rank_zero_info,
                )
                for optimizer in self.optimizers:
                    optimizer.register_step_post_hook(self._trace.optimizer_step_hook)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            lc.optimizers_to_device(self.optimizers, self.root_device)

    def _setup_optimizers(self, trainer: pl.Trainer, module: nn.Module) -> None:
        """The user's optimizers; on a rank whose stages hold no trained parameter (LoRA or frozen layers
        elsewhere), where ``configure_optimizers`` over the trained parameters gets an empty list, none
        (:class:`~lightning_bfpp.frozen.NothingToTrain`)."""
        try:
            self.setup_optimizers(trainer)
        except ValueError as error:
            if holds_trained_parameters(module) or not is_empty_parameter_list(error):
                raise
            self.optimizers, self.lr_scheduler_configs = [NothingToTrain()], []

    def _overlap_mode(self) -> str | None:
        """How gradient reductions overlap the backward here, or None where there is nothing to overlap."""
        assert self.mesh_shape is not None
        if not self._overlaps_reductions() or self.mesh_shape.data_parallel_size == 1:
            return None
        if self.config.sharding == "no_shard":
            return None  # replicated gradients are all-reduced by FSDP2's replicate, kept synchronous
        # hybrid_shard overlaps too: FSDP2's post-backward reduce-scatters inside the node (under "thread" on a
        # second shard group, see second_data_parallel_group) and then all-reduces across nodes, in one reduction
        if self.overlap_reductions in ("stream", "thread"):
            return self.overlap_reductions
        return "stream" if self.root_device.type == "cuda" else "thread"

    def _overlaps_reductions(self) -> bool:
        """Whether the setting asks for overlapped reductions here (``"auto"``: on CUDA only)."""
        if self.overlap_reductions == "auto":
            return self.root_device.type == "cuda"
        return self.overlap_reductions is not False

    def _reduction_group(self) -> Any:
        """The process group the communication thread reduces on (a collective: every rank creates all)."""
        if self._overlap_mode() != "thread":
            return None
        assert self.mesh_shape is not None
        return second_data_parallel_group(self.device_mesh, self.mesh_shape.shard_size)

    def _build_pipeline(
        self, module: pl.LightningModule, base_seed: int, reduce_group: Any = None
    ) -> PendingBuild[Pipeline]:
        """Split and place: no collectives in here (see ``setup``: errors are agreed on afterwards). Returns the
        initial state the replicas share (see lightning_bfpp.initial_state), and the rest of the build (sharding
        the stages, which must see the shared values), run after that."""
        assert self.mesh_shape is not None
        named = pipeline_layers(module)
        ties = find_ties(module, named)
        _check_metrics(module)
        check_no_collective_layers(named)
        # the whole model's parameter order, to read single-device optimizer states (see checkpoint.py)
        self._full_parameter_names = [name for name, _ in module.named_parameters()]
        self._trained_parameter_names = [name for name, p in module.named_parameters() if p.requires_grad]
        weights = layer_weights(named)
        self.layout = layout = self.config.resolve_layout(self.mesh_shape, weights, self._layer_times)
        self.stage_plan = plan = StagePlan(
            tuple(name for name, _ in named), layout.stage_layer_counts, layout.pipeline_parallel_size
        )
        layer_stage = [s for s in range(plan.num_stages) for _ in plan.layer_range(s)]
        owner = [plan.rank_of(s) for s in layer_stage]
        self.whole_model_summary = WholeModelSummary.of(
            module, named, layer_stage, [plan.rank_of(s) for s in range(plan.num_stages)]
        )
        check_shared_modules(named, layer_stage)
        weight_passing = self.config.schedule == "weight_passing"
        warning = batch_statistics_warning(
            batch_statistics_layers(named), layout.num_microbatches, layout.data_parallel_size, weight_passing
        )
        if warning is not None:
            rank_zero_warn(warning)
        if weight_passing:
            return self._build_weight_passing(module, named, ties, plan, layer_stage, base_seed)
        # which local slots share a tensor, before materializing breaks that (see lightning_bfpp.tied.retie)
        identities = record_identities(named, [i for i, rank in enumerate(owner) if rank == self.pipeline_rank])
        local = keep_local_layers(module, named, owner, self.pipeline_rank, self.root_device)
        stage_rank = [plan.rank_of(s) for s in range(plan.num_stages)]
        self.tied = retie(identities, ties, layer_stage, stage_rank)
        materialize_remaining(module, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        stage_modules = []
        for stage in plan.stages_of(self.pipeline_rank):
            layers = [compiled(local[name], self._compile) for name in plan.stage_layers(stage)]
            layers = [Recompute(layer) if self._recompute(layer) else layer for layer in layers]
            names = plan.stage_layers(stage)
            stage_modules.append(StageModule(layers, stage, names=names, is_last=stage == plan.num_stages - 1))
        rank_zero_info(
            f"BFPPStrategy: pipeline_parallel_size={layout.pipeline_parallel_size},"
            f" data_parallel_size={layout.data_parallel_size}, stages_per_rank={layout.stages_per_rank},"
            f" num_microbatches={layout.num_microbatches}, schedule={self.config.schedule},"
            f" sharding={self.config.sharding}\n{plan.describe(weights)}"
        )
        if layout.num_microbatches < layout.pipeline_parallel_size:
            rank_zero_warn(
                f"BFPPStrategy: num_microbatches={layout.num_microbatches} is smaller than"
                f" pipeline_parallel_size={layout.pipeline_parallel_size}: under the breadth-first schedule every"
                " loop around the pipeline then waits for its first micro-batch to come back, so ranks idle."
                " Use at least as many micro-batches as pipeline ranks."
            )

        def finish() -> Pipeline:
            dp_mesh = self._sharding_mesh if self._sharding_mesh is not None else self.device_mesh[DATA_PARALLEL]
            sharded = [shard_stage(stage_module, dp_mesh, self.config.sharding) for stage_module in stage_modules]
            reductions = None
            mode = self._overlap_mode()
            if mode is not None:
                if mode == "thread":
                    for stage_module in sharded:
                        stage_module.set_custom_reduce_scatter(_compat.ReduceScatterOn(reduce_group))
                stages = dict(zip(plan.stages_of(self.pipeline_rank), sharded, strict=True))
                reductions = GradientReductions(stages, mode)  # type: ignore[arg-type]
            self._log_sync = LoggedValueSync(self.root_device)
            return Pipeline(
                module,
                plan,
                sharded,
                self.device_mesh,
                self.root_device,
                schedule=self.config.schedule,
                sharding=schedule_sharding(self.config.sharding),
                num_microbatches=layout.num_microbatches,
                microbatch_group_size=layout.microbatch_group_size,
                prefetch_stages=self.config.prefetch_stages,
                base_seed=base_seed,
                step_code=LightningStep(module),
                executor=StageExecutor(self.device_mesh, self.root_device, plan.pipeline_parallel_size, reductions),
                # a rank still waiting here after this long is not coming: see Pipeline._agree_before_schedule
                agreement_timeout=None if self.failure_timeout is None else max(120.0, 4 * self.failure_timeout),
                tied=self.tied,
            )

        # the layers of pipeline rank k take data-parallel rank 0 of pipeline rank k's values (each layer drawn
        # once, by one process, as under DDP), the buffers every rank keeps outside the layers global rank 0's
        replicas = self.device_mesh[DATA_PARALLEL].get_group() if layout.data_parallel_size > 1 else None
        layer_names = [name for name, _ in named]
        return PendingBuild(
            [
                Broadcast(local_state(stage_modules), 0, replicas),
                Broadcast(buffers_outside(module, layer_names), 0, dist.group.WORLD if self.world_size > 1 else None),
            ],
            finish,
        )

    def _build_weight_passing(
        self,
        module: pl.LightningModule,
        named: list[tuple[str, nn.Module]],
        ties: list[Any],
        plan: StagePlan,
        layer_stage: list[int],
        base_seed: int,
    ) -> PendingBuild[Pipeline]:
        """Weight passing: one chunk per rank, owned whole by the rank TawPipe's placement gives it; the
        LightningModule keeps the owned layers (so the optimizer and checkpoints see exactly those), the other
        chunks' layers are kept beside it with no storage until fetched (see lightning_bfpp.weight_passing).

        A chunk's parameters and persistent buffers are its owner's: the buffers travel with every fetch, and at
        setup every buffer of a chunk (persistent or not) takes the owner's value, as do the buffers outside the
        layers global rank 0's. Borrowed layers run in the LightningModule's mode (``train()`` / ``eval()``),
        which Lightning sets on the module and so on its own layers only."""
        assert self.layout is not None
        if ties:
            raise ValueError(
                f"BFPPStrategy(schedule='weight_passing') cannot train parameters shared by several layers yet"
                f" (`{ties[0].canonical}`); use schedule='breadth_first', which supports them."
            )
        device, me = self.root_device, self.global_rank
        topology = NodeTopology(self.world_size, self.processes_per_node)
        chunk_owner = [topology.chunk_owner(c) for c in range(plan.num_stages)]
        owner = [chunk_owner[s] for s in layer_stage]
        identities = record_identities(named, range(len(named)))
        local = keep_local_layers(module, named, owner, me, device)
        borrowed = {}
        for (name, layer), rank in zip(named, owner, strict=True):
            if rank != me:
                materialize_meta(layer, device)
                borrowed[name] = self.precision_plugin.convert_module(layer.to(device))
                follow_mode(borrowed[name], module)
        self.tied = retie(identities, ties, layer_stage, chunk_owner)  # a layer's own ties, broken by to_empty
        materialize_remaining(module, device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        layers_by_name = {**local, **borrowed}
        stage_modules, chunks = [], []
        world = dist.group.WORLD if self.world_size > 1 else None
        broadcasts = [Broadcast(buffers_outside(module, [name for name, _ in named]), 0, world)]
        for c in range(plan.num_stages):
            names = plan.stage_layers(c)
            layers = [layers_by_name[name] for name in names]
            broadcasts.append(Broadcast(local_state(layers, parameters=False), chunk_owner[c], world))
            layers = [compiled(layer, self._compile) for layer in layers]
            layers = [Recompute(layer) if self._recompute(layer) else layer for layer in layers]
            stage_module = StageModule(layers, c, names=names, is_last=c == plan.num_stages - 1)
            stage_modules.append(stage_module)
            chunks.append(
                ChunkWeights(
                    list(stage_module.parameters()), owned=chunk_owner[c] == me, buffers=chunk_buffers(stage_module)
                )
            )
        weights = layer_weights(named)
        rank_zero_info(
            f"BFPPStrategy: schedule=weight_passing over {self.world_size} ranks ({topology.num_nodes} node(s) of"
            f" {topology.processes_per_node}), num_microbatches={self.layout.num_microbatches} per rank\n"
            + "\n".join(
                f"chunk {c:>3} owned by rank {chunk_owner[c]:>3}: {len(plan.stage_layers(c)):>3} layers,"
                f" {sum(weights[i] for i in plan.layer_range(c)):,} parameters"
                for c in range(plan.num_stages)
            )
        )
        layout = self.layout

        def finish() -> Pipeline:
            self._log_sync = LoggedValueSync(device)
            return Pipeline(
                module,
                plan,
                stage_modules,
                self.device_mesh,
                device,
                schedule="weight_passing",
                sharding="weight_passing",
                num_microbatches=layout.num_microbatches,
                prefetch_stages=self.config.prefetch_stages,
                base_seed=base_seed,
                step_code=LightningStep(module),
                executor=WeightPassingExecutor(ChunkTransfers(chunks, topology, me), device),
                agreement_timeout=None if self.failure_timeout is None else max(120.0, 4 * self.failure_timeout),
            )

        return PendingBuild(broadcasts, finish)

    # -- training ----------------------------------------------------------------------------------

    @override
    def on_train_start(self) -> None:
        # the step's one collective carries Lightning's per-batch SIGTERM check (see LoggedValueSync)
        trainer = self.lightning_module.trainer
        self._sigterm_noted = lc.share_sigterm_through(
            trainer, lambda: self._log_sync is not None and self._log_sync.stop_agreed
        )

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # set per batch: a callback (e.g. StochasticWeightAveraging) may have switched it back
        lc.set_skip_backward(self.lightning_module.trainer, True)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.pipeline is not None and self.lightning_module is not None
        module = self.lightning_module
        trainer = module.trainer
        batch, batch_idx = args[0], args[1]
        accumulate = trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0:
            self._zero_grad(trainer, batch_idx)
        tracer = self._trace.start_step() if self._trace is not None else None
        # a `mean_over_items` step (or one not seen yet) reduces each batch's gradients on their own, apart from
        # what the accumulation window already holds, to divide them by the batch's item count after the step
        per_batch = self.pipeline.reduces_each_batch(window_start=batch_idx % accumulate == 0)
        with self.precision_plugin.train_step_context():
            result = self.pipeline.run(
                "training_step",
                batch,
                tuple(args[1:]),
                train=True,
                loss_scale=1.0 / accumulate,
                tracer=tracer,
                step_key=(0, trainer.current_epoch, batch_idx),
                last_batch=trainer.fit_loop.epoch_loop.batch_progress.is_last_batch,
                # within an accumulation window gradients are reduced once, with the window's last batch
                reduce_grads=per_batch or not lc.should_accumulate(trainer),
                set_aside_grads=per_batch,
            )
        sync_start = tracer.now() if tracer is not None else 0.0
        shared = self._share_logs(result)
        self.pipeline.normalize_gradients(shared.loss_items, shared.replicas, accumulating=accumulate > 1)
        if tracer is not None and self._trace is not None:
            # sharing the logged values waits for the pipeline's slowest rank: part of the drain
            tracer.add("step_sync", sync_start, tracer.now())
        lc.call_callback_hooks(trainer, "on_after_backward")
        lc.call_module_hook(trainer, "on_after_backward")
        if tracer is not None and self._trace is not None:
            self._trace.end_pipeline(trainer.global_step, self._trace_title())
        return shared.loss

    def _trace_title(self) -> str:
        assert self.layout is not None
        layout = self.layout
        return (
            f"{self.config.schedule}, {self.config.sharding}: p={layout.pipeline_parallel_size}"
            f" dp={layout.data_parallel_size} v={layout.stages_per_rank} m={layout.num_microbatches}"
        )

    @override
    def on_train_end(self) -> None:
        if self._trace is not None:
            self._trace.flush()

    def _zero_grad(self, trainer: pl.Trainer, batch_idx: int) -> None:
        optimizer = trainer.optimizers[0]
        lc.call_callback_hooks(trainer, "on_before_zero_grad", optimizer)
        lc.call_module_hook(trainer, "on_before_zero_grad", optimizer)
        lc.call_module_hook(trainer, "optimizer_zero_grad", trainer.current_epoch, batch_idx, optimizer)

    def _share_logs(self, result: StepResult) -> SharedStep:
        """Replay the step's logs on every rank; return the step's loss averaged like the logged values (for a
        ``mean_over_items`` step, with the global item count).

        Also where a step that failed on a last-stage rank is raised on every rank, and where the ranks of each
        pipeline are checked to have run the same batch (see LoggedValueSync).
        """
        assert self._log_sync is not None and self.pipeline is not None and self.lightning_module is not None
        module = self.lightning_module
        specs = values = None
        loss, items = result.loss_and_items()
        if self.pipeline.holds_last_stage and result.failure.error is None:
            try:
                specs, values = combine_microbatches(
                    result.recorder.records, module, on_step_by_default=result.step_name == "training_step"
                )
                loss = torch.zeros(()) if loss is None else loss
            except Exception as error:
                result.failure.record(error, self.pipeline.rank_label)
                specs = values = None
        shared = self._log_sync.share(
            specs,
            values,
            loss,
            result.failure,
            result.step_name,
            result.batch_digest,
            result.batch_description,
            stop_requested=self._sigterm_noted(),
            loss_items=items,
            content_digest=result.content_digest,
            pipelines=self.pipeline.pipelines,
        )
        replay(module, shared.specs, shared.values, metric_updated=self.pipeline.holds_last_stage)
        return shared

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
        assert self.layout is not None
        if self.config.schedule == "weight_passing":  # each chunk's gradients live on its owner alone
            return dist.group.WORLD if self.world_size > 1 else None
        return self.device_mesh[PIPELINE_PARALLEL].get_group() if self.layout.pipeline_parallel_size > 1 else None

    # -- evaluation --------------------------------------------------------------------------------

    def _eval_step(self, step_name: str, context: Any, args: tuple[Any, ...]) -> StepResult:
        assert self.pipeline is not None and self.lightning_module is not None
        trainer = self.lightning_module.trainer
        kind = ("validation_step", "test_step", "predict_step").index(step_name) + 1
        batch_idx = args[1] if len(args) > 1 else 0
        dataloader_idx = args[2] if len(args) > 2 else 0
        # evaluation may run under inference_mode (NCCL); tensors made there could never join the training
        # graph that shares these stages' FSDP buffers, so run the pipeline under plain no_grad
        with torch.inference_mode(False), torch.no_grad(), context:
            result = self.pipeline.run(
                step_name,
                args[0],
                tuple(args[1:]),
                train=False,
                step_key=(kind, trainer.current_epoch, trainer.global_step, dataloader_idx, batch_idx),
                last_batch=_evaluation_loop(trainer, step_name).batch_progress.is_last_batch,
            )
        return result

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> None:
        self._share_logs(self._eval_step("validation_step", self.precision_plugin.val_step_context(), args))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> None:
        self._share_logs(self._eval_step("test_step", self.precision_plugin.test_step_context(), args))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The batch's predictions as one device returns them, on every rank of the pipeline that computed them."""
        assert self.pipeline is not None
        result = self._eval_step("predict_step", self.precision_plugin.predict_step_context(), args)
        merged: list[Any] = [None]
        if self.pipeline.holds_last_stage and result.failure.error is None:
            try:
                microbatch_size = batch_size(args[0]) // result.num_microbatches
                merged = [merge_microbatches(result.outputs, microbatch_size)]
            except Exception as error:
                result.failure.record(error, self.pipeline.rank_label)
        # the point after the schedule where every rank meets: a failed predict_step is raised everywhere
        agree_on_failure("`predict_step`", result.failure, self.root_device)
        if self.layout is not None and self.layout.pipeline_parallel_size > 1:
            last = self.layout.pipeline_parallel_size - 1
            dist.broadcast_object_list(merged, group=self._pipeline_group(), group_src=last, device=self.root_device)
        return merged[0]

    @override
    def on_predict_end(self) -> None:
        """On global rank 0, replace the returned predictions by the whole dataset's, in dataset order."""
        assert self.layout is not None and self.lightning_module is not None
        trainer = self.lightning_module.trainer
        loop = trainer.predict_loop
        if self.layout.data_parallel_size == 1 or self.pipeline_rank != 0 or not loop.return_predictions:
            return
        group = self.device_mesh[DATA_PARALLEL].get_group()
        dataloaders = trainer.predict_dataloaders
        if not isinstance(dataloaders, (list, tuple)):
            dataloaders = [dataloaders] if dataloaders is not None else []
        for dataloader_idx, dataloader in enumerate(dataloaders):
            results = lc.prediction_lists(trainer)
            if dataloader_idx >= len(results):
                break
            batch_sampler = getattr(dataloader, "batch_sampler", None)
            indices = lc.seen_batch_indices(dataloader)
            share = (indices, results[dataloader_idx])
            gathered: list[Any] = [None] * self.layout.data_parallel_size if self.data_parallel_rank == 0 else []
            dist.gather_object(share, gathered if self.data_parallel_rank == 0 else None, group=group, group_dst=0)
            if self.data_parallel_rank != 0:
                continue
            ordered = None
            if all(indices is not None for indices, _ in gathered):
                ordered = in_dataset_order(gathered, getattr(batch_sampler, "batch_size", None) or 1)
            if ordered is None:
                rank_zero_warn(
                    "BFPPStrategy: the predictions have no per-sample values (tensors or lists whose first"
                    " dimension is the batch), or hold batch-level values that differ between batches, so they"
                    " cannot be put back into one device's batches: `trainer.predict` returns this replica's"
                    " share only, as with DDP."
                )
                continue
            results[dataloader_idx][:] = ordered

    @override
    def teardown(self) -> None:
        if self.lightning_module is not None and lc.attached_trainer(self.lightning_module) is not None:
            lc.set_skip_backward(self.lightning_module.trainer, False)
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self.pipeline is not None:
            self.pipeline.executor.close()
        super().teardown()

    # -- collectives --------------------------------------------------------------------------------

    def _refuse_inside_step(self, what: str) -> None:
        if self.pipeline is not None and self.pipeline.running_user_code:
            raise collective_refusal(what)

    @override
    def barrier(self, name: str | None = None) -> None:
        self._refuse_inside_step("`trainer.strategy.barrier`")
        super().barrier(name)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._refuse_inside_step("`trainer.strategy.broadcast`")
        return super().broadcast(obj, src)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        self._refuse_inside_step("`self.all_gather` (`trainer.strategy.all_gather`)")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Reduce over the data-parallel replicas, as DDP reduces over its ranks (``group=`` for another group).

        This is what ``self.log(..., sync_dist=True)`` in a hook does: every rank of a pipeline runs the hook
        with the same value, and the replicas' values are combined. Reducing over all ranks would count each
        replica once per pipeline rank (a ``"sum"`` ``p`` times too large). Values the strategy logged for a step
        (``group=REDUCED_OVER_REPLICAS``) are already reduced and come back as they are.
        """
        if group is REDUCED_OVER_REPLICAS:
            return tensor
        self._refuse_inside_step("`trainer.strategy.reduce`")
        if group is None and self.layout is not None and self.layout.data_parallel_size < self.world_size:
            if self.layout.data_parallel_size == 1:
                return tensor
            group = self.device_mesh[DATA_PARALLEL].get_group()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """A decision (e.g. EarlyStopping's) agreed by every process, whatever its place in the mesh."""
        self._refuse_inside_step("`trainer.strategy.reduce_boolean_decision`")
        if not dist.is_initialized() or self.world_size == 1:
            return decision
        votes = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(votes, op=dist.ReduceOp.SUM)
        return bool(votes == self.world_size) if all else bool(votes)

    # -- checkpoints -------------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return checkpoint_io.model_state(self.lightning_module, self.tied.aliases)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.lightning_module is not None
        optimizer = lc.unwrap_optimizer(optimizer)
        return checkpoint_io.optimizer_state(self.lightning_module, optimizer, self.tied.aliases)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: lc.PathLike, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "BFPPStrategy writes distributed checkpoints with torch.distributed.checkpoint and takes no"
                " `storage_options`."
            )
        assert self.layout is not None
        path = Path(self.broadcast(str(filepath)))
        state = {checkpoint_io.MODEL_KEY: checkpoint.pop("state_dict")}
        for i, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[checkpoint_io.optimizer_key(i)] = optimizer_state
        # meta.pt is global rank 0's dict, holding its replica's loader states only: add every replica's
        fit_state = self._fit_loop_state(checkpoint)
        loader_states = checkpoint_io.gather_loader_states(
            fit_state.get("combined_loader") if fit_state is not None else None,
            data_parallel_rank=self.data_parallel_rank,
            pipeline_rank=self.pipeline_rank,
            data_parallel_size=self.layout.data_parallel_size,
            is_global_zero=self.is_global_zero,
        )
        if loader_states is not None:
            checkpoint[checkpoint_io.LOADER_STATES_KEY] = loader_states
        if self.tied.aliases:  # stored once, under the canonical name: what `consolidate` adds back
            checkpoint[checkpoint_io.TIED_KEY] = dict(self.tied.aliases)
        checkpoint_io.save(path, state, checkpoint, is_global_zero=self.is_global_zero)

    @override
    def load_checkpoint(self, checkpoint_path: lc.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.lightning_module is not None and self.layout is not None
        module = self.lightning_module
        path = Path(self.broadcast(str(checkpoint_path)))
        optimizers = [lc.unwrap_optimizer(o) for o in self.optimizers]
        loaded, warning = checkpoint_io.load(
            path,
            module,
            optimizers,
            strict=module.strict_loading,
            weights_only=bool(weights_only),
            full_parameter_names=self._full_parameter_names,
            trained_parameter_names=self._trained_parameter_names,
            aliases=self.tied.aliases,
        )
        loaded.pop(checkpoint_io.TIED_KEY, None)
        if warning is not None:
            rank_zero_warn(warning)
        # each replica resumes its own place in the data (see checkpoint_io.replica_loader_states)
        stored = loaded.pop(checkpoint_io.LOADER_STATES_KEY, None)
        fit_state = self._fit_loop_state(loaded)
        if fit_state is not None and fit_state.get("combined_loader"):
            states, warning = checkpoint_io.replica_loader_states(
                stored,
                fit_state["combined_loader"],
                data_parallel_rank=self.data_parallel_rank,
                data_parallel_size=self.layout.data_parallel_size,
            )
            if warning is not None:
                rank_zero_warn(warning)
            if states is None:
                del fit_state["combined_loader"]
            else:
                fit_state["combined_loader"] = states
        return loaded

    @staticmethod
    def _fit_loop_state(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
        """The fit loop's own entry of a Lightning checkpoint, where ``FitLoop.on_save_checkpoint`` keeps the
        training loaders' states (``"combined_loader"``); ``None`` in a weights-only checkpoint."""
        state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict")
        return state if isinstance(state, dict) else None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Breadth-first pipeline parallelism over sharded data parallelism (lightning-bfpp)",
            override=True,
        )


def _evaluation_loop(trainer: pl.Trainer, step_name: str) -> Any:
    """The evaluation loop running ``step_name`` now (its ``batch_progress`` knows whether a batch is the last)."""
    if step_name == "predict_step":
        return trainer.predict_loop
    if step_name == "test_step":
        return trainer.test_loop
    if trainer.state.fn == TrainerFn.FITTING:
        return trainer.fit_loop.epoch_loop.val_loop
    return trainer.validate_loop


def _check_metrics(module: nn.Module) -> None:
    """Refuse torchmetrics that sync inside every step: only some ranks run a step's code, the sync would hang."""
    for name, metric in module.named_modules():
        if isinstance(metric, Metric) and metric.dist_sync_on_step:
            raise ValueError(
                f"BFPPStrategy: the metric `{name}` has `dist_sync_on_step=True`. Under the pipeline a step's metric"
                " code runs on the last stage's ranks only, where a sync would wait forever for the others. Drop"
                " `dist_sync_on_step`: a metric logged with `self.log(name, metric)` shows the step value of the"
                " global batch anyway (step values are reduced over data-parallel replicas), and its epoch value"
                " is synced by Lightning."
            )


_SUPPORTED_PRECISION = {
    Precision: ("32-true",),
    MixedPrecision: ("bf16-mixed",),
    HalfPrecision: ("bf16-true", "16-true"),
    DoublePrecision: ("64-true",),
}


def _check_precision(plugin: Precision) -> None:
    """Refuse precisions the pipeline cannot honour, when the Trainer is built, on every rank."""
    name = getattr(plugin, "precision", None)
    if name == "16-mixed":
        raise ValueError(
            "BFPPStrategy does not support `precision='16-mixed'`: its gradient scaler scales the loss in"
            " Lightning's backward, which the pipeline replaces, and would skip steps on some pipeline ranks"
            " only. Use `precision='bf16-mixed'` (no scaler needed), 'bf16-true' or '32-true'."
        )
    allowed = _SUPPORTED_PRECISION.get(type(plugin))
    if allowed is None or name not in allowed:
        supported = ", ".join(p for names in _SUPPORTED_PRECISION.values() for p in names)
        raise ValueError(
            f"BFPPStrategy does not support the precision plugin {type(plugin).__name__}"
            f" (precision={name!r}); choose one of: {supported}."
        )
