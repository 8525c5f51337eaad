"""Fine-tuning data as users have it: sequences of random length, each batch padded to its own longest.

``VariableLengthTokens`` draws token sequences of 1 to 20 tokens; about a third have a single token and so no
label token after the shift, so micro-batches and replicas hold very different numbers of label tokens (some
none at all). ``pad_collate`` pads each batch to its own longest sequence, right or left (left padding adds
the ``position_ids`` a model needs to place the tokens as unpadded), as ``DataCollatorWithPadding`` and SFT
collators do: the two replicas of a step, and consecutive steps, see different lengths.

``TokenLM`` is a small causal token model in plain torch (embedding, causal blocks, head) whose step returns
``mean_over_items``: the generic way a step says its loss is a token mean. The Hugging Face runs use
``HFCausalLM`` (``tests.hf_models``) on the same data.
"""

from __future__ import annotations

import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_bfpp import mean_over_items
from tests.models import Reference, RunSpec, StepRecorder, trainer_defaults

VOCAB = 40


class VariableLengthTokens(Dataset):
    """Token sequences of 1 to ``max_len`` tokens, the same on every process (unless ``seed`` is None)."""

    def __init__(self, num_samples: int = 64, seed: int | None = 1, max_len: int = 20, fixed: bool = False) -> None:
        g = torch.Generator()
        if seed is None:  # drawn differently in every process: what an unseeded data pipeline does
            g.seed()
        else:
            g.manual_seed(seed)
        self.samples = []
        for _ in range(num_samples):
            single = bool(torch.rand((), generator=g) < 0.35)
            length = 1 if single else int(torch.randint(2, max_len + 1, (), generator=g))
            length = max_len if fixed else length
            self.samples.append(torch.randint(3, VOCAB, (length,), generator=g))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.samples[i]


def pad_collate(samples: list[torch.Tensor], side: str = "right") -> dict[str, torch.Tensor]:
    """Pad to the batch's longest sequence; labels are the tokens, -100 at padding (and right after it)."""
    longest = max(len(s) for s in samples)
    input_ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for i, s in enumerate(samples):
        where = slice(0, len(s)) if side == "right" else slice(longest - len(s), longest)
        input_ids[i, where] = s
        mask[i, where] = 1
    labels = input_ids.masked_fill(mask == 0, -100)
    # a token right after padding (a left-padded sequence's first) would be predicted from a padding position,
    # whose output depends on how much padding there is: no label, as one device padded otherwise would agree
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
    if side == "left":
        batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return batch


class Embed(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, width)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(input_ids)


class CausalBlock(nn.Module):
    """Mixes each position with the mean of those before it: causal, so right padding changes nothing."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mix = nn.Linear(2 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype)[None, :, None]
        history = h.cumsum(1) / steps
        return h + torch.tanh(self.mix(torch.cat([h, history], -1)))


class TokenLM(L.LightningModule):
    def __init__(self, width: int = 16, blocks: int = 3, lr: float = 0.5) -> None:
        super().__init__()
        self.lr = lr
        self.embed = Embed(width)
        self.blocks = nn.ModuleList(CausalBlock(width) for _ in range(blocks))
        self.head = nn.Linear(width, VOCAB)

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch["input_ids"])
        labels = batch["labels"][:, 1:]
        total = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
        loss = mean_over_items(total, (labels != -100).sum())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def sft_module(run: RunSpec) -> L.LightningModule:
    """``run.model["family"]``: ``"token"`` for :class:`TokenLM`, else a ``tests.hf_models`` family."""
    if run.model.get("family", "token") == "token":
        torch.manual_seed(run.model.get("seed", 0))
        return TokenLM()
    from tests.hf_models import hf_module

    return hf_module(run)


def _dataset(run: RunSpec) -> VariableLengthTokens:
    seed = run.data.get("seed", 1)
    return VariableLengthTokens(seed=None if seed == "unseeded" else seed, fixed=run.data.get("fixed_length", False))


def sft_loader(run: RunSpec, trainer: L.Trainer) -> DataLoader:
    collate = partial(pad_collate, side=run.data.get("padding", "right"))
    return DataLoader(_dataset(run), batch_size=run.local_batch_size, collate_fn=collate)


def sft_reference_run(run: RunSpec) -> Reference:
    """``run`` on one process on the global batches (each padded to its own longest sequence)."""
    model = sft_module(run)
    data = _dataset(run)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    collate = partial(pad_collate, side=run.data.get("padding", "right"))
    batch_size = run.local_batch_size * run.data_parallel_size
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler, collate_fn=collate)
    recorder = StepRecorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="auto", callbacks=[recorder], **trainer_defaults(run))
    trainer.fit(model, loader)
    params = {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}
    return Reference(recorder.steps, params, recorder.validations, {"out": Path(tempfile.gettempdir())})
