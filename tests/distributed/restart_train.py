"""A user's training script under ``torchrun --max-restarts N`` or a SLURM requeue:
``trainer.fit(model, loader, ckpt_path="last")``.

    python -m torch.distributed.run --standalone --nproc-per-node 4 --max-restarts 2 \\
        tests/distributed/restart_train.py OUT [--kill-rank R --kill-step S [--stop] [--always]] [--async-saves]
    srun --ntasks 4 python tests/distributed/restart_train.py OUT --kill-rank R --requeue-step S

p=2 dp=2 v=2, 12 steps, a ``ModelCheckpoint(save_last=True, every_n_train_steps=3)``, a ``StatefulDataLoader`` whose
epochs end mid-way between checkpoints (5 steps an epoch), AdamW with a step scheduler, ``EMAWeightAveraging``, and
random draws in the step. With ``--kill-rank`` that rank kills itself (SIGKILL; with ``--stop`` it stops itself,
SIGSTOP, as a hung process) at the start of step ``--kill-step`` in the first attempt only
(``TORCHELASTIC_RESTART_COUNT`` 0), or in every attempt with ``--always``. With ``--requeue-step`` that rank gets
SLURM's requeue signal instead (see ``Requeue``; the first attempt is ``SLURM_RESTART_COUNT`` 0). Every rank
appends each step's loss, with its attempt, to ``OUT/losses_rank<R>.jsonl``; at the end data-parallel rank 0 of
each pipeline rank writes its stages' full weights and optimizer state to ``OUT/final_pp<P>.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from torch import nn
from torch.distributed.tensor import DTensor
from torchdata.stateful_dataloader import StatefulDataLoader

import lightning_bfpp

# torchrun's restart count, or SLURM's for a requeued job
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("SLURM_RESTART_COUNT", "0")))


class Net(L.LightningModule):
    noise = True

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(8, 16), *(nn.Linear(16, 16) for _ in range(4)), nn.Linear(16, 1)])

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        x, y, _ = batch  # the samples' indices last
        noisy = x + 0.1 * torch.randn_like(x) if self.noise else x  # a random draw in the step
        loss = ((self(noisy) - y) ** 2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> object:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 4, 0.5)}


class Kill(L.Callback):
    """At the start of step ``step`` on global rank ``rank``, send this process ``signum`` (SIGKILL: lost; SIGSTOP:
    hung), in the first attempt only unless ``always``."""

    def __init__(self, rank: int | None, step: int | None, signum: int, always: bool) -> None:
        self.rank, self.step, self.signum, self.always = rank, step, signum, always

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: object, i: int) -> None:
        if (ATTEMPT == 0 or self.always) and trainer.global_rank == self.rank and trainer.global_step + 1 == self.step:
            os.kill(os.getpid(), self.signum)


class Requeue(L.Callback):
    """SLURM's warning before a job's time limit (``--signal=USR1@90``), as it reaches the tasks: on global rank
    ``rank`` at the start of step ``step`` in the first attempt (SLURM signals every task; one first is the harder
    case). Once ``scontrol requeue`` was called (the stand-in on ``PATH`` writes ``requeued``), SLURM ends the job with
    SIGTERM to every task: here each rank sends it to itself at its next step."""

    def __init__(self, rank: int, step: int, requeued: Path) -> None:
        self.rank, self.step, self.requeued = rank, step, requeued

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: object, i: int) -> None:
        if ATTEMPT != 0:
            return
        if trainer.global_rank == self.rank and trainer.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)
        if self.requeued.exists():
            os.kill(os.getpid(), signal.SIGTERM)


class LoseNode(L.Callback):
    """A machine lost: at the start of step ``step`` in the first attempt, the first local rank of the torchrun
    agent started with ``LOSE_THIS_NODE=1`` kills the agent, the agent's other workers and itself (SIGKILL)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: object, i: int) -> None:
        lost = os.environ.get("LOSE_THIS_NODE") == "1" and os.environ.get("LOCAL_RANK") == "0"
        if ATTEMPT == 0 and lost and trainer.global_step + 1 == self.step:
            agent = os.getppid()
            workers = subprocess.run(["pgrep", "-P", str(agent)], capture_output=True, text=True).stdout.split()
            os.kill(agent, signal.SIGKILL)
            for pid in map(int, workers):
                if pid != os.getpid():
                    os.kill(pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


class Record(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, i: int) -> None:
        strategy = trainer.strategy
        line = {
            "attempt": ATTEMPT,
            "step": trainer.global_step,
            "loss": float(outputs["loss"]),
            "batch": round(float(batch[0].sum()), 4),
            "samples": batch[2].tolist(),
            "epoch": trainer.current_epoch,
            "replica": strategy.data_parallel_rank,
            "replicas": strategy.distributed_sampler_kwargs["num_replicas"],
            "stage_rank": strategy.pipeline_rank,
        }
        with open(self.out / f"losses_rank{trainer.global_rank}.jsonl", "a") as file:
            file.write(json.dumps(line) + "\n")

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        def full(t: torch.Tensor) -> torch.Tensor:
            return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

        names = {id(p): n for n, p in module.named_parameters()}
        state = {f"param/{n}": full(p) for n, p in module.named_parameters()}
        for param, entries in trainer.optimizers[0].state.items():
            state.update({f"optim/{names[id(param)]}/{k}": full(v) for k, v in entries.items()})
        strategy = trainer.strategy
        if strategy.data_parallel_rank == 0:
            torch.save(state, self.out / f"final_pp{strategy.pipeline_rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--kill-step", type=int, default=None)
    parser.add_argument("--stop", action="store_true", help="SIGSTOP instead of SIGKILL: a hung process")
    parser.add_argument("--always", action="store_true", help="in every attempt, not only the first")
    parser.add_argument("--async-saves", action="store_true", help="BFPPStrategy(async_checkpoint=True)")
    parser.add_argument("--failure-timeout", type=float, default=30.0)
    parser.add_argument("--requeue-step", type=int, default=None, help="SLURM's requeue signal on --kill-rank")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--without", default="", help="comma-separated: ema, noise, shuffle, scheduler")
    parser.add_argument("--lose-node-step", type=int, default=None, help="see LoseNode")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(1)
    data = list(zip(torch.randn(40, 8, generator=g), torch.randn(40, 1, generator=g), range(40), strict=True))
    without = set(args.without.split(","))
    Net.noise = "noise" not in without
    shuffle = "shuffle" not in without
    # one global batch of 8 on any number of machines (torchrun's --nnodes MIN:MAX): 4 per replica on 4 processes
    local, world = int(os.environ.get("LOCAL_WORLD_SIZE", 4)), int(os.environ.get("WORLD_SIZE", 4))
    replicas = world // 2
    loader = StatefulDataLoader(
        data, batch_size=8 // replicas, shuffle=shuffle, generator=torch.Generator().manual_seed(2)
    )
    strategy = lightning_bfpp.BFPPStrategy(
        pipeline_parallel_size=2, stages_per_rank=2, num_microbatches=2, failure_timeout=args.failure_timeout,
        async_checkpoint=args.async_saves,
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu",
        devices=local,
        num_nodes=world // local,
        strategy=strategy,
        max_steps=args.max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,  # where a requeue's checkpoint goes (hpc_ckpt_<n>.ckpt)
        callbacks=[
            ModelCheckpoint(dirpath=args.out / "ckpts", save_last=True, every_n_train_steps=3, save_top_k=0),
            *([] if "ema" in without else [EMAWeightAveraging(decay=0.9)]),
            Kill(args.kill_rank, args.kill_step, signal.SIGSTOP if args.stop else signal.SIGKILL, args.always),
            *([Requeue(args.kill_rank, args.requeue_step, args.out / "requeued")] if args.requeue_step else []),
            *([LoseNode(args.lose_node_step)] if args.lose_node_step else []),
            Record(args.out),
        ],
    )
    trainer.fit(Net(), loader, ckpt_path="last")


if __name__ == "__main__":
    main()
