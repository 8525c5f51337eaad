"""Sharded data parallelism per pipeline stage (FSDP2), and the device mesh it runs on.

Each stage is one FSDP2 unit over the data-parallel group: ``fully_shard`` for ``"full_shard"`` (ZeRO-3)
and ``"shard_grad_op"`` (ZeRO-2), FSDP2's ``replicate`` for ``"no_shard"`` (gradients all-reduced), and for
``"hybrid_shard"`` ``fully_shard`` over a 2-D (replicate, shard) mesh (HSDP, see :func:`data_parallel_mesh`):
ZeRO-3 inside a node, gradients all-reduced across nodes.
FSDP2's own per-forward resharding is switched off (``reshard_after_forward=False``): when a stage's
weights are gathered and freed is decided by the schedule's UNSHARD / RESHARD actions, once per sweep over
all micro-batches rather than once per micro-batch. Whatever the sharding, optimizer state follows the
parameters: sharded when they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lightning_bfpp.engine._compat import replicate, unflatten_mesh
from lightning_bfpp.engine.process_groups import reused, reused_subgroup

if TYPE_CHECKING:
    from lightning_bfpp.plan.mesh import MeshShape

DATA_PARALLEL = "data_parallel"
PIPELINE_PARALLEL = "pipeline_parallel"
TENSOR_PARALLEL = "tensor_parallel"  # Lightning's ModelParallelStrategy's name, which users' code indexes
# hybrid_shard's data-parallel dimensions: copies across nodes (outer), shards inside a node (inner)
REPLICATE = "replicate"
SHARD = "shard"


def build_mesh(device: torch.device, shape: MeshShape) -> DeviceMesh:
    """The 2-D (data × pipeline) mesh, or with tensor parallelism the 3-D one with ``"tensor_parallel"``
    innermost (a tensor group's ranks consecutive: inside a node, as torchtitan and Megatron place it).

    With ``mesh_order="data_pipeline"`` the ranks of one pipeline are consecutive global ranks (so a
    pipeline stays inside a node and data-parallel groups span nodes); with ``"pipeline_data"`` the ranks of
    one data-parallel group are (so its all-gathers and reductions, the heaviest traffic under sharding,
    stay inside a node while the pipeline's point-to-point transfers cross nodes).

    Created once per process for each layout, and returned again to every later setup
    (:mod:`lightning_bfpp.engine.process_groups`), as are the groups of the functions below.
    """
    dims = {DATA_PARALLEL: shape.data_parallel_size, PIPELINE_PARALLEL: shape.pipeline_parallel_size}
    names = (
        (DATA_PARALLEL, PIPELINE_PARALLEL)
        if shape.mesh_order == "data_pipeline"
        else (PIPELINE_PARALLEL, DATA_PARALLEL)
    )
    if shape.tensor_parallel_size > 1:
        dims[TENSOR_PARALLEL] = shape.tensor_parallel_size
        names = (*names, TENSOR_PARALLEL)
    sizes = tuple(dims[n] for n in names)
    return reused(
        ("mesh", device.type, sizes, names), lambda: init_device_mesh(device.type, sizes, mesh_dim_names=names)
    )


def tensor_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh's tensor-parallel dimension, or None without tensor parallelism."""
    names = mesh.mesh_dim_names or ()
    return mesh[TENSOR_PARALLEL] if TENSOR_PARALLEL in names else None


def tensor_group_mesh(size: int, device: torch.device) -> DeviceMesh:
    """This rank's tensor group (``size`` consecutive global ranks, as in every layout) as a 1-D
    ``"tensor_parallel"`` mesh of its own, before a layout and its mesh exist, so that each group can measure
    layers split as training will split them. A collective the first time: every rank calls it."""

    def create() -> DeviceMesh:
        rank = dist.get_rank()
        mine = None
        for first in range(0, dist.get_world_size(), size):
            group = dist.new_group(list(range(first, first + size)))  # every rank creates every group, in order
            if first <= rank < first + size:
                mine = group
        return DeviceMesh.from_group(mine, device.type, mesh_dim_names=(TENSOR_PARALLEL,))

    return reused(("tensor_group_mesh", device.type, size), create)


def data_parallel_mesh(mesh: DeviceMesh, shape: MeshShape) -> DeviceMesh:
    """The mesh this rank's stages shard over: the data-parallel dimension, or for ``hybrid_shard`` that
    dimension split into (replicate, shard) = (nodes, ranks per node), the 2-D mesh FSDP2 runs HSDP on.

    A node's data-parallel ranks are consecutive in both mesh orders (see
    :func:`lightning_bfpp.plan.mesh.hybrid_shard_size`), so splitting the dimension row-major puts every shard
    group inside a node. The split is DeviceMesh's ``_unflatten`` of ``mesh[DATA_PARALLEL]`` rather than a
    3-D ``init_device_mesh`` (replicate, shard, pipeline) or a ``DeviceMesh`` from explicit rank tensors: the
    root mesh keeps its (data, pipeline) dimensions, which samplers, ``data_parallel_rank``, logged values,
    checkpoint loader states and tie groups index as ``mesh[DATA_PARALLEL]``, and only the replicate and shard
    groups are created (a second root mesh would duplicate the pipeline groups). A collective over the world the
    first time: every rank creates every group, in the same order.
    """
    data = mesh[DATA_PARALLEL]
    if shape.shard_size is None:
        return data
    sizes = (shape.replicate_size, shape.shard_size)
    return reused(("hybrid_shard", mesh, sizes), lambda: unflatten_mesh(data, sizes, (REPLICATE, SHARD)))


def shard_stage(
    stage: nn.Module,
    data_parallel_mesh: DeviceMesh,
    sharding: str,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Make ``stage`` one data-parallel unit over ``data_parallel_mesh``; parameters become DTensors in place.

    ``hybrid_shard`` takes the 2-D (replicate, shard) mesh of :func:`data_parallel_mesh`: FSDP2 then gathers
    and reduce-scatters inside the shard dimension and all-reduces the reduced shards over the replicate one.

    Without data parallelism (a mesh of one rank) the stage is returned as it is: FSDP2 over one rank shards
    nothing, while its hooks cost host time on every micro-batch's forward and backward (6% of a step of
    5–10 ms layers on the emulated benchmark, p=4 v=2 m=4), and its schedule actions are then left out too.
    """
    if data_parallel_mesh.size() == 1:
        return stage
    policy = mp_policy or MixedPrecisionPolicy()
    if sharding == "no_shard":
        return replicate(stage, mesh=data_parallel_mesh, mp_policy=policy)
    if sharding in ("full_shard", "shard_grad_op", "hybrid_shard"):
        return fully_shard(stage, mesh=data_parallel_mesh, reshard_after_forward=False, mp_policy=policy)
    raise ValueError(f"unknown sharding {sharding!r}")


def second_data_parallel_group(mesh: DeviceMesh, shard_size: int | None = None) -> dist.ProcessGroup:
    """A new process group over this rank's data-parallel replicas (the same ranks as the mesh's own), or with
    ``shard_size`` (``hybrid_shard``) over its shard group: the data-parallel group cut into runs of that many.

    Gradient reductions run on a communication thread (see :mod:`lightning_bfpp.engine.reductions`) while the main
    thread gathers weights; each needs its own group, or ranks could issue the two in different orders on
    one group. Under ``hybrid_shard`` the gathers use the shard group only, so the reduce-scatter needs a
    second one, while the all-reduce across nodes keeps the mesh's replicate group (only the communication
    thread uses it during a step). A collective over the world the first time: every rank creates every group,
    in the same order.
    """
    ranks = mesh.mesh
    dim = mesh.mesh_dim_names.index(DATA_PARALLEL)  # type: ignore[union-attr]
    groups = ranks.movedim(dim, -1).reshape(-1, shard_size or ranks.shape[dim]).tolist()
    mine = reused_subgroup("reductions", groups)
    assert mine is not None  # every rank is in one data-parallel group
    return mine
