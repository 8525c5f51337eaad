"""Generation through the pipeline: tokens per second with groups in flight, with sharded weights, and beside
``transformers`` on one process.

    python -m benchmarks.generation                 # about 5 minutes on 2 cores
    python -m benchmarks.generation --quick         # fewer tokens, for a smoke run

Three measurements, each as ratios between configurations run back to back in one invocation:

1. **Groups in flight** (emulated layers: each decoder block's ``decode`` sleeps ``--row-ms`` per row of the group
   it runs, as a layer whose work grows with its batch does, while real tensors and a real KV cache flow): tokens
   per second with ``G = p`` groups against ``G = 1`` on the same prompts, for p = 2 and p = 4 (one process per
   pipeline rank). With one group the pipeline's ranks take turns; with ``p`` every rank has a group at every
   moment, so the ideal ratio is ``p``. Beside it, the other regime: a block whose time is fixed per call whatever
   its rows (``--call-ms``, an accelerator's decode at small batch, bound by reading the weights): there cutting
   the batch into groups gains nothing, since every rank's calls take as long for a part of the batch as for
   all of it, and the ratio is about 1.
2. **Sharded weights** (the same layers, each with a weight of ``--param-numel`` values): p=2 with dp=2 replicas,
   ``full_shard`` against ``no_shard``, tokens per second per replica. The weights are gathered once per
   ``generate`` call, not per token, so sharding should cost only that one gather.
3. **A real model**: a Llama of ``--real-layers`` blocks (hidden 256, built from a ``transformers`` config and saved
   with ``save_pretrained``) generating greedily: ``transformers``' ``generate`` on one process with as many
   threads as the pipeline's processes together, against ``HFCausalLM.generate`` under ``BFPPStrategy`` at p=2
   (one thread per process). On CPU cores the pipeline has no idle accelerator to fill; this row says what the
   ring's messages and caches cost against one process doing everything, not what a GPU pipeline gains.

Each configuration is a launch of the package's launcher running one ``trainer.validate`` whose
``on_validation_epoch_end`` times ``generate`` after one warm-up call; the median of ``--repeats`` calls is taken.
Results are printed and written to ``--output`` (default ``runs/generation/generation.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

import lightning_bfpp
from lightning_bfpp.measure import launcher

VOCABULARY = 64


class _Embedding(nn.Module):
    """Token ids to hidden states of ``width`` (a lookup in a real table, no sleep: an embedding is cheap)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(VOCABULARY, width, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: Any) -> Any:
        raise RuntimeError("this benchmark only generates")

    def decode(self, inputs: tuple[torch.Tensor, ...], cache: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        ids, mask, positions = inputs
        return self.table[ids], mask, positions


class _SleepingBlock(nn.Module):
    """A decoder block whose ``decode`` takes ``row_ms`` per row of its input plus ``call_ms`` per call, and keeps a
    KV cache that grows by its inputs."""

    def __init__(self, row_ms: float, call_ms: float, param_numel: int) -> None:
        super().__init__()
        self.row_s, self.call_s = row_ms / 1e3, call_ms / 1e3
        self.weight = nn.Parameter(torch.zeros(param_numel))

    def forward(self, x: Any) -> Any:
        raise RuntimeError("this benchmark only generates")

    def decode(self, inputs: tuple[torch.Tensor, ...], cache: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        hidden, mask, positions = inputs
        key = f"kv{id(self)}"
        cache[key] = hidden if key not in cache else torch.cat([cache[key], hidden], dim=1)
        time.sleep(self.call_s + self.row_s * hidden.shape[0])
        return hidden + self.weight[0], mask, positions


class _Head(nn.Module):
    """Logits whose argmax is the next position's token: decoding is deterministic and never ends early."""

    def forward(self, x: Any) -> Any:
        raise RuntimeError("this benchmark only generates")

    def decode(self, inputs: tuple[torch.Tensor, ...], cache: dict[str, Any]) -> torch.Tensor:
        hidden, _, positions = inputs
        nxt = (positions[:, -1:] + 1) % VOCABULARY
        return torch.nn.functional.one_hot(nxt, VOCABULARY).float() + hidden[:, -1:, :1] * 0.0


class EmulatedDecoder(L.LightningModule):
    def __init__(self, blocks: int, row_ms: float, call_ms: float, param_numel: int, width: int = 64) -> None:
        super().__init__()
        decoder = [_SleepingBlock(row_ms, call_ms, param_numel) for _ in range(blocks)]
        self.layers = nn.ModuleList([_Embedding(width), *decoder, _Head()])

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: Any) -> Any:
        raise RuntimeError("this benchmark only generates")

    def generate(self, input_ids: torch.Tensor, **options: Any) -> torch.Tensor:
        return lightning_bfpp.generate(self, input_ids, **options)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.generate(batch, max_new_tokens=1)  # the loop needs a step; the timing is in the callback


def _loader() -> torch.utils.data.DataLoader:
    """One batch of two 4-token prompts: a validation loop to time ``generate`` in."""
    return torch.utils.data.DataLoader(torch.ones(2, 4, dtype=torch.long), batch_size=2)


class _Timer(L.Callback):
    """Times ``generate`` in ``on_validation_epoch_end``, where every rank runs it; global rank 0 writes the result."""

    def __init__(self, generate: Any, prompts: torch.Tensor, repeats: int, out: Path) -> None:
        self.generate, self.prompts, self.repeats, self.out = generate, prompts, repeats, out

    def on_validation_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.generate(module, self.prompts)  # warm-up: connections, the first gather, shape-specific setup
        times, new_tokens = [], 0
        for _ in range(self.repeats):
            torch.distributed.barrier()
            start = time.perf_counter()
            out = self.generate(module, self.prompts)
            times.append(time.perf_counter() - start)
            new_tokens = (out.shape[1] - self.prompts.shape[1]) * out.shape[0]
        if trainer.global_rank == 0:
            median = statistics.median(times)
            self.out.write_text(json.dumps({"median_s": median, "tokens_per_s": new_tokens / median}))


def _emulated_worker(rank: int, config: dict[str, Any], out: str) -> None:
    torch.manual_seed(0)
    model = EmulatedDecoder(config["blocks"], config["row_ms"], config["call_ms"], config["param_numel"])
    prompts = torch.randint(0, VOCABULARY, (config["batch"], 8), generator=torch.Generator().manual_seed(1))

    def generate(module: L.LightningModule, ids: torch.Tensor) -> torch.Tensor:
        return module.generate(ids, max_new_tokens=config["tokens"], num_groups=config["groups"])

    strategy = lightning_bfpp.BFPPStrategy(
        pipeline_parallel_size=config["p"], stages_per_rank=config["v"], sharding=config["sharding"],
        num_microbatches=1, failure_timeout=120,
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=config["p"] * config["dp"], strategy=strategy, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[_Timer(generate, prompts, config["repeats"], Path(out) / "result.json")],
    )  # fmt: skip
    trainer.validate(model, _loader(), verbose=False)


def _real_worker(rank: int, folder: str, tokens: int, repeats: int, out: str) -> None:
    from lightning_bfpp.integrations.huggingface import HFCausalLM

    prompts = torch.randint(3, 1000, (8, 16), generator=torch.Generator().manual_seed(1))

    def generate(module: L.LightningModule, ids: torch.Tensor) -> torch.Tensor:
        return module.generate(ids, max_new_tokens=tokens, do_sample=False, eos_token_id=None)

    class Generating(HFCausalLM):
        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            self.generate(batch, max_new_tokens=1)

    model = Generating(folder)
    strategy = lightning_bfpp.BFPPStrategy(pipeline_parallel_size=2, failure_timeout=120)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
        callbacks=[_Timer(generate, prompts, repeats, Path(out) / "result.json")],
    )  # fmt: skip
    trainer.validate(model, _loader(), verbose=False)


def _launched(target: str, nprocs: int, args: tuple[Any, ...], threads: int = 1) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        result = launcher.launch(target, nprocs, Path(tmp), args=(*args, tmp), start="spawn", timeout_s=900,
                                 threads=threads)  # fmt: skip
        if any(code != 0 for code in result.exitcodes):
            raise RuntimeError(f"{target} failed:\n{result.report()}")
        return json.loads((Path(tmp) / "result.json").read_text())


def _one_process_transformers(folder: str, tokens: int, repeats: int, threads: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompts = torch.randint(3, 1000, (8, 16), generator=torch.Generator().manual_seed(1))
    kwargs = {"max_new_tokens": tokens, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    model.generate(prompts, **kwargs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = model.generate(prompts, **kwargs)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {"median_s": median, "tokens_per_s": (out.shape[1] - prompts.shape[1]) * out.shape[0] / median}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row-ms", type=float, default=2.0, help="each block's decode time per row of a group")
    parser.add_argument("--call-ms", type=float, default=5.0, help="the constant-time regime's time per call")
    parser.add_argument("--blocks", type=int, default=8, help="emulated decoder blocks")
    parser.add_argument("--param-numel", type=int, default=250_000, help="each emulated block's weight values")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per call")
    parser.add_argument("--batch", type=int, default=16, help="prompts per call (per replica)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--real-layers", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="4 tokens, one repeat")
    parser.add_argument("--output", type=Path, default=Path("runs/generation/generation.json"))
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.repeats, args.batch = 4, 1, 8
    base = {
        "blocks": args.blocks, "row_ms": args.row_ms, "call_ms": 0.0, "param_numel": args.param_numel,
        "tokens": args.tokens, "batch": args.batch, "repeats": args.repeats, "v": 1, "dp": 1, "sharding": "full_shard",
    }  # fmt: skip
    results: dict[str, Any] = {"settings": vars(args) | {"output": str(args.output)}}
    for p in (2, 4):
        for groups in (1, p):
            config = {**base, "p": p, "groups": groups}
            results[f"p{p}_groups{groups}"] = _launched("benchmarks.generation:_emulated_worker", p, (config,))
        ratio = results[f"p{p}_groups{p}"]["tokens_per_s"] / results[f"p{p}_groups1"]["tokens_per_s"]
        results[f"p{p}_ratio"] = ratio
        print(f"p={p}: {p} groups / 1 group tokens per second: {ratio:.2f} (target at least {0.8 * p:.1f})")
    constant = {**base, "row_ms": 0.0, "call_ms": args.call_ms, "p": 2}
    for groups in (1, 2):
        config = {**constant, "groups": groups}
        results[f"constant_p2_groups{groups}"] = _launched("benchmarks.generation:_emulated_worker", 2, (config,))
    ratio = results["constant_p2_groups2"]["tokens_per_s"] / results["constant_p2_groups1"]["tokens_per_s"]
    results["constant_p2_ratio"] = ratio
    print(f"p=2, a block's time fixed per call whatever its rows: 2 groups / 1 group: {ratio:.2f}")
    for sharding in ("no_shard", "full_shard"):
        config = {**base, "p": 2, "dp": 2, "groups": 2, "sharding": sharding}
        results[f"dp2_{sharding}"] = _launched("benchmarks.generation:_emulated_worker", 4, (config,))
    ratio = results["dp2_full_shard"]["tokens_per_s"] / results["dp2_no_shard"]["tokens_per_s"]
    results["dp2_full_over_no_shard"] = ratio
    print(f"p=2 dp=2: full_shard / no_shard tokens per second per replica: {ratio:.2f} (target at least 0.9)")
    with tempfile.TemporaryDirectory() as folder:
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=args.real_layers,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
        )  # fmt: skip
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        results["real_transformers_one_process"] = _one_process_transformers(folder, args.tokens, args.repeats, 2)
        results["real_bfpp_p2"] = _launched(
            "benchmarks.generation:_real_worker", 2, (folder, args.tokens, args.repeats)
        )
    real = results["real_bfpp_p2"]["tokens_per_s"] / results["real_transformers_one_process"]["tokens_per_s"]
    results["real_bfpp_over_transformers"] = real
    print(
        f"a {args.real_layers}-block Llama, 8 prompts: BFPPStrategy p=2 (1 thread each)"
        f" {results['real_bfpp_p2']['tokens_per_s']:.0f} tokens/s, transformers on one process (2 threads)"
        f" {results['real_transformers_one_process']['tokens_per_s']:.0f} tokens/s: {real:.2f}"
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"written to {args.output}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
