"""Train a Hugging Face causal LM on Python's own documentation, through ``LightningCLI``; offline, on CPU.

The text is ``pydoc_data.topics`` (the ~465 KB of reference documentation that ``help()`` shows, shipped with
Python). Whole topics are held out (a seeded tenth of the keys), so the held-out perplexity measures text the
model has not seen. By default the model is a small Llama built from scratch over a byte-level tokenizer
written here (256 bytes + padding), so nothing is downloaded; ``--model.family`` picks any tested family
(``lightning_bfpp.integrations.huggingface.CAUSAL_LM_FAMILIES``: Llama, Mistral, Qwen2, Qwen3, Gemma 1-3, Phi-3,
OLMo 2, Granite, GPT-NeoX, Cohere, Mixtral, Qwen3-MoE, GPT-2), ``--model.pretrained FOLDER`` fine-tunes a local
``from_pretrained`` folder with its own tokenizer instead, and ``--model.lora true`` trains LoRA adapters (rank
``--model.lora_rank``, on every linear layer but the LM head) with the model frozen.

    python examples/finetune_causal_lm.py fit                    # 4 CPU processes: pipeline 2 × data parallel 2
    python examples/finetune_causal_lm.py fit --trainer.devices 4 --trainer.strategy bfpp   # pipeline of 4
    python examples/finetune_causal_lm.py fit --trainer.strategy auto --trainer.devices 1
    python examples/finetune_causal_lm.py fit --model.family gpt2 --model.layers 6 --trainer.max_steps 50
    python examples/finetune_causal_lm.py fit --model.pretrained runs/finetune_causal_lm/pretrained --model.lora true

The held-out perplexity is measured before and after training (``trainer.validate``), and after every validation
the model's greedy completion of ``--model.completion_prompt`` is printed: ``HFCausalLM.generate``, through the
pipeline under BFPPStrategy (docs/generation.md). At the end every
process writes its part of a checkpoint, global rank 0 turns it into a ``from_pretrained`` folder with
``export_pretrained`` (``<default_root_dir>/pretrained``), loads that on its own and prints a sampled
continuation of a prompt: the same path whether the run was pipelined or ``strategy="auto"``. With LoRA, the
adapter folder is written too (``<default_root_dir>/adapter``) and the exported model has the adapters merged.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2Config

import lightning_bfpp  # noqa: F401  (registers strategy="bfpp")
from lightning_bfpp.integrations.huggingface import CAUSAL_LM_FAMILIES, HFCausalLM, export_pretrained


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255, and 256 for padding: a tokenizer that needs no vocabulary file."""

    vocab_size = 257
    pad_token_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def load_tokenizer(pretrained: str | None) -> Any:
    """The pretrained folder's own tokenizer, or the byte-level one for a model trained from scratch (and for a
    folder this example exported from such a model, which holds no tokenizer files)."""
    if pretrained is None or not (Path(pretrained) / "tokenizer_config.json").is_file():
        return ByteTokenizer()
    return AutoTokenizer.from_pretrained(pretrained)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids without special tokens, for either kind of tokenizer."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# what a family's config needs beyond the shared sizes to be small and well-formed (heads of hidden/heads, a
# sliding window shorter than the sequence where the family has one, a few experts for mixtures of experts)
FAMILY_EXTRAS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 64},
    "qwen2": {"use_sliding_window": False},
    "gemma2": {"sliding_window": 64},
    "gemma3_text": {"sliding_window": 64},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2},
}


def small_config(family: str, layers: int, hidden_size: int, heads: int, vocab_size: int, max_len: int) -> Any:
    """A from-scratch config of ``family`` (any of ``CAUSAL_LM_FAMILIES``), with untied input and output
    embeddings as larger LMs have them (tied ones train too: the strategy keeps the copies on the first and last
    stages equal)."""
    if family == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size,
            n_embd=hidden_size,
            n_layer=layers,
            n_head=heads,
            n_positions=max_len,
            bos_token_id=None,
            eos_token_id=None,
            tie_word_embeddings=False,
        )
    if family not in CAUSAL_LM_FAMILIES:
        raise ValueError(f"`family` must be one of {', '.join(CAUSAL_LM_FAMILIES)}; got {family!r}.")
    decoder = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 3 * hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": hidden_size // heads,
        "max_position_embeddings": max_len,
        "tie_word_embeddings": False,
        "pad_token_id": ByteTokenizer.pad_token_id,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    if family in ("qwen3_moe", "mixtral"):
        decoder["moe_intermediate_size"] = hidden_size
    if family in ("gemma2", "gemma3_text"):
        decoder["query_pre_attn_scalar"] = hidden_size // heads
    return AutoConfig.for_model(family, **decoder, **FAMILY_EXTRAS.get(family, {}))


class PydocLM(HFCausalLM):
    """``HFCausalLM`` with the example's model choices as plain arguments (for the CLI) and a warmup-cosine LR.

    The hyper-parameters saved are ``HFCausalLM``'s (the model's config as a dict), so the checkpoint turns
    into a ``from_pretrained`` folder with ``export_pretrained``.
    """

    def __init__(
        self,
        pretrained: str | None = None,
        family: str = "llama",
        layers: int = 4,
        hidden_size: int = 128,
        heads: int = 4,
        max_len: int = 256,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 20,
        lora: bool = False,
        lora_rank: int = 8,
        completion_prompt: str = 'The "for" statement',
        completion_tokens: int = 40,
    ) -> None:
        if pretrained is None:
            model: Any = small_config(family, layers, hidden_size, heads, ByteTokenizer.vocab_size, max_len)
        else:
            model = pretrained  # a tied LM head stays tied: BFPPStrategy keeps its copies on both stages equal
        # LoRA: adapters of rank `lora_rank` on every linear layer but the LM head, the model itself frozen
        adapters = {"r": lora_rank, "lora_alpha": 2 * lora_rank, "target_modules": "all-linear"} if lora else None
        super().__init__(model, lr=lr, weight_decay=weight_decay, lora=adapters)
        self.warmup_steps = warmup_steps
        self.tokenizer = load_tokenizer(pretrained)
        self.completion_prompt, self.completion_tokens = completion_prompt, completion_tokens
        # `from_pretrained` leaves the model in eval mode, and Lightning keeps each submodule's mode: train
        # mode here so that dropout (where the config has it) is on while training
        self.train()

    def on_validation_epoch_end(self) -> None:
        """What the model writes now: a greedy completion of a fixed prompt after each validation, generated through
        the pipeline under BFPPStrategy (every process takes part; global rank 0 prints it)."""
        if self.trainer.sanity_checking or not self.completion_tokens:
            return
        ids = torch.tensor([encode(self.tokenizer, self.completion_prompt)])
        out = self.generate(ids, max_new_tokens=self.completion_tokens, do_sample=False, eos_token_id=None)
        if self.trainer.is_global_zero:
            text = self.tokenizer.decode(out[0].tolist())
            print(f"\ncompletion at step {self.trainer.global_step}: {text!r}", flush=True)

    def configure_optimizers(self) -> Any:
        trained = [p for p in self.parameters() if p.requires_grad]  # with LoRA, the adapters
        opt = torch.optim.AdamW(trained, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        total = max(1, self.trainer.estimated_stepping_batches)
        warmup = min(self.warmup_steps, total // 2)

        def lr_at(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class PydocTopics(L.LightningDataModule):
    """``pydoc_data.topics`` cut into blocks of ``seq_len`` tokens; a seeded ``held_out`` share of topics kept out.

    Each split's topics are joined (a blank line between them) and cut into full blocks, so every sequence
    has ``seq_len`` real tokens: no padding, and a micro-batch's mean loss is the token mean. Batches are
    tensors of token ids; ``batch_size`` is per data-parallel replica.
    """

    def __init__(
        self,
        tokenizer: str | None = None,
        seq_len: int = 128,
        batch_size: int = 16,
        held_out: float = 0.1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        from pydoc_data.topics import topics

        keys = sorted(topics)
        random.Random(seed).shuffle(keys)
        n_val = max(1, round(len(keys) * held_out))
        self.val_topics, self.train_topics = sorted(keys[:n_val]), sorted(keys[n_val:])
        self.tokenizer = load_tokenizer(tokenizer)
        self.train_blocks = self._blocks([topics[k] for k in self.train_topics], seq_len)
        self.val_blocks = self._blocks([topics[k] for k in self.val_topics], seq_len)
        self.batch_size = batch_size

    def _blocks(self, texts: list[str], seq_len: int) -> torch.Tensor:
        ids = torch.tensor(encode(self.tokenizer, "\n\n".join(texts)))
        return ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_blocks, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        # full batches only: every batch then has the same number of tokens, and the logged mean is theirs
        return DataLoader(self.val_blocks, batch_size=self.batch_size, drop_last=True)


@torch.no_grad()
def sample(model: Any, tokenizer: Any, prompt: str, new_tokens: int, top_k: int, window: int, seed: int = 0) -> str:
    """A top-k sampled continuation of ``prompt`` (``top_k=1``: greedy), seeded so that it can be compared."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([encode(tokenizer, prompt)])
    for _ in range(new_tokens):
        logits = model(input_ids=ids[:, -window:]).logits[0, -1]
        top = torch.topk(logits, top_k)
        choice = torch.multinomial(torch.softmax(top.values, -1), 1, generator=generator)
        ids = torch.cat([ids, top.indices[choice].view(1, 1)], dim=1)
    return tokenizer.decode(ids[0].tolist())


class PydocCLI(LightningCLI):
    """``LightningCLI`` with this example's defaults, held-out perplexity before and after ``fit``, and a sample."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.link_arguments("model.pretrained", "data.tokenizer")
        parser.link_arguments("data.seq_len", "model.max_len")
        parser.add_argument("--prompt", default='The "while" statement')
        parser.add_argument("--sample_tokens", type=int, default=200)
        parser.add_argument("--top_k", type=int, default=4)
        parser.set_defaults(
            {
                "trainer.accelerator": "cpu",
                "trainer.devices": 4,
                "trainer.strategy": {
                    "class_path": "lightning_bfpp.BFPPStrategy",
                    "init_args": {"pipeline_parallel_size": 2},
                },
                "trainer.max_steps": 200,
                "trainer.val_check_interval": 100,
                "trainer.check_val_every_n_epoch": None,
                "trainer.num_sanity_val_steps": 0,
                "trainer.log_every_n_steps": 10,
                "trainer.enable_checkpointing": False,
                "trainer.default_root_dir": "runs/finetune_causal_lm",
            }
        )

    def before_fit(self) -> None:
        self.start = time.perf_counter()
        self.loss_before = self._validate()

    def after_fit(self) -> None:
        loss_after = self._validate()
        root = Path(self.trainer.default_root_dir)
        # every process writes its stages' part (a folder under `bfpp`, one file with `auto`) ...
        checkpoint = root / "final.ckpt"
        self.trainer.save_checkpoint(checkpoint)
        if not self.trainer.is_global_zero:
            return
        # ... and global rank 0 alone reads it whole into a `from_pretrained` folder and samples from that; with
        # LoRA, also the adapter folder that `PeftModel.from_pretrained(base, folder)` loads
        lora = self.model.lora_config is not None
        if lora:
            adapter = export_pretrained(checkpoint, root / "adapter")
            print(f"\nadapter written to {adapter} ({', '.join(sorted(p.name for p in adapter.iterdir()))})")
        out = export_pretrained(checkpoint, root / "pretrained", merge=lora)
        tokenizer = self.datamodule.tokenizer
        if not isinstance(tokenizer, ByteTokenizer):
            tokenizer.save_pretrained(out)
        model = AutoModelForCausalLM.from_pretrained(out)
        config = self.config[self.config.subcommand]
        text = sample(model, tokenizer, config.prompt, config.sample_tokens, config.top_k, config.data.seq_len)
        data = self.datamodule
        unit = "byte" if isinstance(tokenizer, ByteTokenizer) else "token"
        print(f"\nheld-out topics ({len(data.val_topics)}): {', '.join(data.val_topics)}")
        trained = (
            sum(p.numel() for p in self.model.parameters() if p.requires_grad) if self.trainer.world_size == 1 else None
        )
        print(
            f"{model.config.model_type}: strategy={type(self.trainer.strategy).__name__},"
            f" {self.trainer.world_size} process(es), {self.trainer.global_step} steps,"
            f" {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters"
            + (f", LoRA rank {self.model.lora_config.r}" if lora else "")
            + (f" ({trained / 1e6:.3f} M trained)" if lora and trained is not None else "")
        )
        for label, loss in (("before", self.loss_before), ("after", loss_after)):
            print(f"held-out perplexity per {unit} {label:6}: {math.exp(loss):8.2f} (loss {loss:.3f})")
        print(f"exported to {out}; wall time {time.perf_counter() - self.start:.0f} s")
        print(f"sample (top-{config.top_k}):\n{text}")

    def _validate(self) -> float:
        results = self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)
        return float(results[0]["val_loss"])


if __name__ == "__main__":
    PydocCLI(PydocLM, PydocTopics, seed_everything_default=0)
