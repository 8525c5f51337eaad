"""Train a small GPT with breadth-first pipeline parallelism on CPU processes; no download needed.

The task is synthetic and learnable in a few hundred steps: the model reads eight random digits and a
separator, then must write the digits sorted. The LightningModule is ordinary single-device code plus
``pipeline_layers()``; switch ``--strategy auto`` to train the same module on one process.

    python examples/train_gpt.py                      # 4 CPU processes: p=2 pipeline × dp=2 replicas, v=2
    python examples/train_gpt.py --devices 2 --pipeline-parallel-size 2 --sharding no_shard
    python examples/train_gpt.py --tensor-parallel-size 2   # p=2 pipeline × t=2 tensor parallelism, dp=1
    python examples/train_gpt.py --strategy auto --devices 1
"""

from __future__ import annotations

import argparse
import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset

import lightning_bfpp  # noqa: F401  (registers strategy="bfpp")
from lightning_bfpp import BFPPStrategy

DIGITS, SEP = 10, 10
VOCAB = 11


class SortDigits(Dataset):
    """``length`` random digits, a separator, the same digits sorted; the loss covers the sorted half."""

    def __init__(self, num_samples: int, length: int = 8, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        digits = torch.randint(0, DIGITS, (num_samples, length), generator=g)
        sep = torch.full((num_samples, 1), SEP)
        seq = torch.cat([digits, sep, digits.sort(dim=1).values], dim=1)
        self.inputs = seq[:, :-1]
        self.targets = seq[:, 1:].clone()
        self.targets[:, : length - 1] = -100  # no loss on predicting the random digits themselves

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[i], self.targets[i]


class Embeddings(nn.Module):
    def __init__(self, vocab: int, block_size: int, dim: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(block_size, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.tokens(idx) + self.positions(pos)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.norm1 = nn.LayerNorm(dim)
        # fused, head by head (each head's query, key and value rows together, as Megatron lays it out), so that
        # splitting its rows over a tensor group hands each rank whole heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(self.norm1(x))  # under tensor parallelism: this rank's heads only
        q, k, v = qkv.view(b, t, -1, 3, self.head_dim).transpose(1, 2).unbind(3)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).flatten(2))
        return x + self.mlp(self.norm2(x))

    def parallelize(self, tp_mesh: DeviceMesh) -> None:
        """Megatron's split over the tensor group: attention by heads and the MLP by hidden units (the fused
        ``qkv`` and the MLP's first layer column-wise, ``proj`` and its second layer row-wise), so that the block's
        output is whole again on every tensor rank after one all-reduce each."""
        size = tp_mesh.size()
        if self.heads % size:
            raise ValueError(f"tensor_parallel_size={size} must divide the attention heads ({self.heads})")
        plan = {"qkv": ColwiseParallel(), "proj": RowwiseParallel()}
        plan |= {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
        parallelize_module(self, tp_mesh, plan)


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)  # untied: the embedding lives on another stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class GPT(L.LightningModule):
    def __init__(self, layers: int = 8, dim: int = 64, heads: int = 4, block_size: int = 16, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = Embeddings(VOCAB, block_size, dim)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.head = Head(dim, VOCAB)

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def parallelize_layer(self, layer: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
        """``BFPPStrategy(tensor_parallel_size=t)`` calls this for each layer a rank holds: blocks are split; the
        embedding and the head (an 11-token vocabulary) stay whole on every tensor rank."""
        if isinstance(layer, Block):
            layer.parallelize(tp_mesh)
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = batch
        logits = self(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        mask = targets != -100
        accuracy = (logits.argmax(-1)[mask] == targets[mask]).float().mean()
        return loss, accuracy

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, accuracy = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", accuracy, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss, accuracy = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_acc", accuracy, prog_bar=True)

    def configure_optimizers(self) -> dict:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        steps = self.trainer.estimated_stepping_batches
        warmup = max(1, int(0.05 * steps))

        def lr_at(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))

        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SortDigitsData(L.LightningDataModule):
    """The sorting task as a DataModule, for ``LightningCLI`` (see ``examples/cli.py``)."""

    def __init__(self, batch_size: int = 32, train_samples: int = 8192, val_samples: int = 512) -> None:
        super().__init__()
        self.batch_size, self.train_samples, self.val_samples = batch_size, train_samples, val_samples

    def train_dataloader(self) -> DataLoader:
        data = SortDigits(self.train_samples, seed=0)
        return DataLoader(data, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(SortDigits(self.val_samples, seed=1), batch_size=self.batch_size, drop_last=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--strategy", default="bfpp", choices=["bfpp", "auto"])
    parser.add_argument("--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("--stages-per-rank", type=int, default=2)
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument("--sharding", default="full_shard", choices=["full_shard", "shard_grad_op", "no_shard"])
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="split each block over this many ranks")
    parser.add_argument("--batch-size", type=int, default=32, help="per data-parallel replica")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--val-every", type=int, default=100, help="validate every this many steps")
    parser.add_argument("--root", default="runs/train_gpt")
    args = parser.parse_args()

    L.seed_everything(0)
    if args.strategy == "bfpp":
        strategy = BFPPStrategy(
            pipeline_parallel_size=args.pipeline_parallel_size,
            stages_per_rank=args.stages_per_rank,
            num_microbatches=args.num_microbatches,
            sharding=args.sharding,
            tensor_parallel_size=args.tensor_parallel_size,
        )
    else:
        strategy = "auto"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        log_every_n_steps=10,
        default_root_dir=args.root,
    )
    model = GPT(layers=args.layers, dim=args.dim)
    trainer.fit(model, datamodule=SortDigitsData(batch_size=args.batch_size))
    if trainer.is_global_zero:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"final metrics: {metrics}")


if __name__ == "__main__":
    main()
