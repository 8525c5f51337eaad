"""The engine driven from a plain torch loop: no Lightning, no strategy (see test_plain_loop.py).

``python -m tests.distributed.plain_loop OUT`` spawns 4 CPU processes (gloo): a pipeline of 2 ranks × 2
data-parallel replicas, 2 stages per rank, breadth-first, fully sharded. Each process builds its part with
the engine's builder (``engine.build``: stage plan, local layers, initial values, FSDP2 sharding), runs 4
training steps with its own SGD optimizer, where the step is two callbacks (the first stage's input; the last
stage's loss), and writes the model's full weights and the losses it saw to ``OUT/rank<r>.pt``. Lightning and
torchmetrics are blocked from import in the processes, so the run also shows the engine needs neither.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any, ClassVar


class _Refuse(importlib.abc.MetaPathFinder):
    """Refuses Lightning and torchmetrics, and records every attempt (an optional import that caught the
    refusal would otherwise go unseen)."""

    attempts: ClassVar[list[str]] = []

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.split(".")[0] in {"lightning", "lightning_fabric", "pytorch_lightning", "torchmetrics"}:
            self.attempts.append(name)
            raise ImportError(f"{name} is blocked in the plain loop")
        return None


import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

STEPS, BATCH, MICROBATCHES, P, DP = 4, 16, 4, 2, 2


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 32)]
    for _ in range(6):
        layers += [nn.Sequential(nn.Tanh(), nn.Linear(32, 32))]
    layers.append(nn.Sequential(nn.Tanh(), nn.Linear(32, 1)))
    return nn.Sequential(*layers)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 1, generator=g)) for _ in range(STEPS)]


class RegressionStep:
    """The step as the engine's callbacks: the input is the micro-batch's features, the loss the MSE."""

    def capture(self, step_name: str, microbatch: Any, step_args: tuple) -> tuple[tuple, dict]:
        return (microbatch[0],), {}

    def running(self) -> Any:
        return nullcontext()

    def new_recorder(self) -> None:
        return None

    def finish(self, step_name: str, microbatch: Any, step_args: tuple, output: Any, recorder: Any) -> Any:
        return F.mse_loss(output, microbatch[1])

    def loss(self, step_output: Any, step_name: str) -> torch.Tensor:
        return step_output


def run(rank: int, out: str, init_file: str) -> None:
    # in the spawned process only (the test's own process imports this module for the model and the data)
    sys.meta_path.insert(0, _Refuse())
    import lightning_bfpp  # noqa: F401  the package asks for Lightning once, to register the strategy if it can

    _Refuse.attempts.clear()  # from here on the engine must not even try
    from lightning_bfpp.engine.build import BuildContext, build_pipeline
    from lightning_bfpp.engine.layers import layer_weights
    from lightning_bfpp.engine.sharding import DATA_PARALLEL, PIPELINE_PARALLEL, build_mesh
    from lightning_bfpp.plan.config import PipelineConfig
    from lightning_bfpp.plan.mesh import MeshShape

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=P * DP)
    device = torch.device("cpu")
    model = make_model()
    named = [(str(i), layer) for i, layer in enumerate(model)]
    shape = MeshShape(pipeline_parallel_size=P, data_parallel_size=DP)
    config = PipelineConfig(
        pipeline_parallel_size=P, stages_per_rank=2, num_microbatches=MICROBATCHES, partition="uniform"
    )
    mesh = build_mesh(device, shape)
    plan = config.resolve_plan(shape, layer_weights(named), layer_names=[name for name, _ in named])
    context = BuildContext(mesh, device, rank, P * DP, processes_per_node=P * DP, step_code=RegressionStep())
    # every replica takes data-parallel rank 0's initial values, then the stages are sharded
    pipeline, _ = build_pipeline(model, lambda: (named, plan), context)
    stages = pipeline.stage_modules
    pipeline_rank = mesh[PIPELINE_PARALLEL].get_local_rank()
    replica = mesh[DATA_PARALLEL].get_local_rank()
    local = [p for stage in stages for p in stage.parameters()]
    optimizer = torch.optim.SGD(local, lr=0.1, momentum=0.9)
    losses = []
    for step, (x, y) in enumerate(batches()):  # each replica takes its half of the global batch
        half = slice(replica * BATCH // DP, (replica + 1) * BATCH // DP)
        result = pipeline.run("training_step", (x[half], y[half]), (), train=True, step_key=(step,))
        loss, _ = result.loss_and_items()
        losses.append(None if loss is None else float(loss))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    weights = {}  # under the model's own names: a stage's `layers.<k>.<rest>` is its k-th layer's `<rest>`
    for stage_index, stage in zip(plan.stages_of(pipeline_rank), stages, strict=True):
        layer_names = plan.stage_layers(stage_index)
        for name, p in stage.named_parameters():
            _, k, rest = name.split(".", 2)
            full = p.full_tensor() if isinstance(p, DTensor) else p
            weights[f"{layer_names[int(k)]}.{rest}"] = full.detach().clone()
    blocked = sorted(set(_Refuse.attempts))
    torch.save({"losses": losses, "weights": weights, "stages": list(plan.stages_of(pipeline_rank)),
                "blocked_imports": blocked}, Path(out) / f"rank{rank}.pt")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    mp.spawn(run, args=(out, os.path.join(out, "init")), nprocs=P * DP, join=True)
