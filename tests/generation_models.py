"""A Llama that generates in its steps and hooks, for ``tests/distributed/test_generation.py`` (built by the worker).

- :func:`prompts`: 13 left-padded prompts of lengths 1 to 13 in one batch; :data:`EOS`, chosen from one process's
  greedy continuations so that it stops several rows early (``test_generation`` checks that it does);
- :func:`generating_llama` (``RunSpec.model_factory``): :class:`GeneratingLlama` from a ``save_pretrained`` folder
  (``run.model["pretrained"]``); ``run.model["generate"]`` says what it generates where:

  - ``"hooks"``: at the start of training, on every rank (the hook path): greedy with ``EOS`` and logits, sampling
    from a seed with ``run.model["groups"]`` groups and with one, greedy without an end for 8 and for 32 new tokens
    counting the collectives of each call, and (``"replica_prompts"``) each data-parallel replica its own number of
    prompts, zero included;
  - ``"steps"``: ``validation_step`` generates from its batch (the step path) and logs the new tokens' count,
    ``predict_step`` returns completions, ``on_validation_epoch_end`` samples once more (randomness used while
    training goes on);

  everything it generated is kept in ``bfpp_generated``, which the worker saves per rank;
- :func:`prompt_loader`: the prompts as a dataset (``RunSpec.loader_factory``), training on them as token data.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from tests.hf_models import SGDCausalLM
from tests.models import RunSpec

PROMPT_LENGTH = 13
PAD = 0
# end-of-sequence tokens: greedy continuations of the prompts below (test_generation checks that at least three rows
# stop before the last step with these, on one process)
EOS = (3, 5)
NEW_TOKENS = 10
SAMPLING = {"do_sample": True, "top_k": 20, "top_p": 0.95, "temperature": 0.8, "repetition_penalty": 1.2}
COUNTED = ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "reduce_scatter_tensor", "barrier")


def prompts(rows: int = PROMPT_LENGTH, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` prompts, row ``i`` of ``i % 13 + 1`` tokens left-padded to 13 (padding id 0, mask 0)."""
    ids = torch.randint(3, 100, (rows, PROMPT_LENGTH), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(rows, PROMPT_LENGTH, dtype=torch.long)
    for i in range(rows):
        mask[i, PROMPT_LENGTH - (i % PROMPT_LENGTH + 1) :] = 1
    return ids.masked_fill(mask == 0, PAD), mask


@contextmanager
def counted_collectives() -> Any:
    """Count the calls of ``torch.distributed``'s collectives made inside the block (FSDP2's gathers among them)."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_param_group  # FSDP2's gather of a unit

    counts: Counter[str] = Counter()
    saved = {(dist, name): getattr(dist, name) for name in COUNTED}
    saved[fsdp_param_group, "foreach_all_gather"] = fsdp_param_group.foreach_all_gather

    def counting(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)

        return call

    for (owner, name), fn in saved.items():
        setattr(owner, name, counting(name, fn))
    try:
        yield counts
    finally:
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)


class GeneratingLlama(SGDCausalLM):
    def __init__(self, folder: str, generate: str, groups: int | None, fail_rank: int | None = None, **kwargs: Any):
        super().__init__(folder, **kwargs)
        self.mode, self.groups, self.fail_rank = generate, groups, fail_rank
        self.bfpp_generated: dict[str, Any] = {"validation": [], "sanity": [], "epoch_end": []}

    def _fail_in_decode(self) -> None:
        """This rank's first decoder block raises on its third ``decode`` call (in the middle of a ``generate``)."""
        from lightning_bfpp.engine.layers import RemoteLayer

        block = next(b for b in self.blocks if not isinstance(b, RemoteLayer))
        decode, calls = block.decode, [0]

        def failing(inputs: Any, cache: dict[str, Any]) -> Any:
            calls[0] += 1
            if calls[0] == 3:
                rank = self.trainer.global_rank
                raise RuntimeError(f"injected failure in decode on rank {rank} at {time.time()}")
            return decode(inputs, cache)

        block.decode = failing  # type: ignore[method-assign]

    def _greedy(self, ids: torch.Tensor, mask: torch.Tensor, **options: Any) -> Any:
        return self.generate(ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=list(EOS), pad_token_id=PAD, **options)

    def on_train_start(self) -> None:
        if self.mode != "hooks":
            return
        from lightning_bfpp.engine.layers import RemoteLayer

        if self.fail_rank is not None and self.trainer.global_rank == self.fail_rank:
            self._fail_in_decode()
        ids, mask = prompts()
        record = self.bfpp_generated
        record["decoder_layers"] = sum(not isinstance(block, RemoteLayer) for block in self.blocks)
        out = self._greedy(ids, mask, return_dict_in_generate=True, output_logits=True, num_groups=self.groups)
        record["greedy"], record["logits"] = out.sequences, torch.stack(out.logits)
        # a group per row: groups leave the ring at different steps, the first after its prompt
        record["greedy_row_groups"] = self._greedy(ids, mask, num_groups=PROMPT_LENGTH)
        pipeline = self._generation_pipeline()
        stats = getattr(pipeline, "generation_stats", None)
        record["cache_keys"] = sorted(stats.cache_bytes) if stats is not None else []
        for groups in (self.groups or 2, 1):
            torch.manual_seed(7)
            record[f"sampled_groups{groups}"] = self._greedy(ids, mask, num_groups=groups, **SAMPLING)
        for tokens in (8, 32):
            with counted_collectives() as counts:
                record[f"long_{tokens}"] = self.generate(ids, mask, max_new_tokens=tokens, eos_token_id=None)
            record[f"collectives_{tokens}"] = dict(counts)
            stats = getattr(pipeline, "generation_stats", None)
            record[f"cache_bytes_{tokens}"] = dict(stats.cache_bytes) if stats is not None else {}
        # each replica its own prompts: replica r the first 13 // (r + 1) rows, the last replica none
        replicas = pipeline.data_parallel_size if pipeline is not None else 1
        replica = getattr(self.trainer.strategy, "data_parallel_rank", 0)
        rows = 0 if replica == replicas - 1 and replicas > 1 else PROMPT_LENGTH // (replica + 1)
        record["replica_rows"] = rows
        record["replica"] = self._greedy(ids[:rows], mask[:rows])

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        if self.mode != "steps":
            return super().validation_step(batch, batch_idx)
        sequences = self._greedy(batch["input_ids"], batch["attention_mask"], num_groups=self.groups)
        new = sequences[:, PROMPT_LENGTH:]
        self.log("val_new_tokens", (new != PAD).sum().float(), reduce_fx="sum")
        self.bfpp_generated["sanity" if self.trainer.sanity_checking else "validation"].append(sequences.cpu())
        return None

    def on_validation_epoch_end(self) -> None:
        if self.mode == "steps":
            ids, mask = prompts(4, seed=2)
            self.bfpp_generated["epoch_end"].append(self._greedy(ids, mask, **SAMPLING).cpu())

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._greedy(batch["input_ids"], batch["attention_mask"])


def generating_llama(run: RunSpec) -> L.LightningModule:
    spec = run.model
    torch.manual_seed(spec.get("seed", 0))
    return GeneratingLlama(
        spec["pretrained"], spec.get("generate", "hooks"), spec.get("groups"), spec.get("fail_rank"),
        lr=spec.get("lr", 0.05),
    )  # fmt: skip


class PromptData(Dataset):
    """32 prompts of :func:`prompts` (lengths 1 to 13, cycling), as token batches."""

    def __init__(self) -> None:
        self.ids, self.mask = prompts(32)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i]}


def prompt_loader(run: RunSpec, trainer: L.Trainer) -> DataLoader:
    return DataLoader(PromptData(), batch_size=run.local_batch_size)


def generate_at_end(module: L.LightningModule) -> torch.Tensor:
    """The worker's ``generate_at_end`` check: greedy continuations of :func:`prompts` (8 new tokens, ``EOS``), on every
    rank after training (the hook path)."""
    ids, mask = prompts()
    return module.generate(ids, mask, max_new_tokens=8, eos_token_id=list(EOS), pad_token_id=PAD).cpu()


def assert_generates_as_exported(folder: Path, exported: Path) -> None:
    """What every rank generated after training (the worker's ``generate_at_end``) is ``transformers``' ``generate``
    on the exported weights: greedy, 8 new tokens, the same end-of-sequence tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    ids, mask = prompts()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=list(EOS), pad_token_id=PAD)
    for rank in range(4):
        assert torch.equal(torch.load(folder / f"generated_at_end_rank{rank}.pt"), want), rank
