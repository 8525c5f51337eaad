"""A 1 GB model from a safetensors folder at ``pipeline_parallel_size`` 1, 2 and 4: each rank's memory and the time
to its first step.

``python -m benchmarks.large_model [--out docs/benchmarks/large-model.json]`` saves a Llama-shaped model of 271 M
parameters (hidden 1024, 16 blocks, a 32,000-token vocabulary, untied: 1.08 GB in fp32) with ``save_pretrained``
as four shards, then trains one step of ``HFCausalLM(folder)`` (SGD) under ``BFPPStrategy(pipeline_parallel_size=p,
stages_per_rank=1)`` on ``p`` CPU processes, the default ``partition="time"``. Per rank it reports the bytes the
rank holds after setup, the resident memory its setup added at its peak (``VmHWM`` over the resident memory at
Lightning's ``setup`` hook, when the model exists on the meta device and the process group is up), that peak
through the first step, and the seconds from the model's creation to the first step; against ``p=1`` (one
process holding the whole model) and the ideal share (the model's bytes over ``p``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from tests.distributed.harness import launch
from tests.models import RunSpec

SIZES = (1, 2, 4)


def config():
    import transformers

    return transformers.LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=32000, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip


def run_for(p: int, folder: Path) -> RunSpec:
    return RunSpec(
        name=f"p{p}",
        strategy={"pipeline_parallel_size": p, "stages_per_rank": 1, "num_microbatches": max(p, 2)},
        model={"family": "llama", "pretrained": str(folder), "optimizer": "sgd", "lr": 0.0},
        model_factory="tests.hf_models:hf_module",
        loader_factory="tests.hf_models:hf_loader",
        trainer={"max_steps": 1},
        local_batch_size=4,
        data_parallel_size=1,
        checks=["setup_memory"],
    )


def main(argv: list[str] | None = None) -> dict:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bfpp-large-model-"))
    folder = work / "llama"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config())
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(folder, max_shard_size="300MB")
    del model
    results: dict = {"model_bytes": model_bytes, "command": "python -m benchmarks.large_model", "sizes": {}}
    for p in SIZES:
        started = time.perf_counter()
        (work / f"p{p}").mkdir()
        result = launch([run_for(p, folder)], p, work / f"p{p}", timeout=1200)[f"p{p}"]
        ranks = [rank["setup_memory"] for rank in result.ranks]
        results["sizes"][p] = {"launch_s": time.perf_counter() - started, "ranks": ranks}
    one = results["sizes"][1]["ranks"][0]
    print(f"model: {model_bytes / 2**20:,.0f} MiB; per rank: held / setup peak / peak through the first step (MiB);"
          " seconds from the model's creation to the first step; the strategy's setup (profile, placement, reads) and"
          " the first step")  # fmt: skip
    for p, entry in results["sizes"].items():
        for rank, m in enumerate(entry["ranks"]):
            seconds = m["creation_to_first_step_s"]
            print(
                f"p={p} rank {rank}: {m['held_bytes'] / 2**20:7,.0f} / {m['setup_peak'] / 2**20:7,.0f} /"
                f" {m['peak_through_training'] / 2**20:7,.0f}   ideal share {model_bytes / p / 2**20:7,.0f}   "
                f"{seconds:6.1f} s ({seconds / one['creation_to_first_step_s']:.2f} of p=1); setup"
                f" {m['setup_s']:.1f} s, first step {m['first_step_s']:.1f} s"
            )
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
