"""The same start for the same seed, whatever the layout: what a rank initializes itself.

A model built on the meta device is materialized by the ranks, each its own layers; LoRA adapters added to a model
read from a folder, a new head, a user's layers under ``empty_init``. Each module starts from the run's seed and its
own name (``lightning_bfpp.engine.layers.materialize_meta``), so:

- a ``transformers`` Llama read from a ``save_pretrained`` folder with LoRA adapters (their A matrices drawn, their
  B zero) starts from the same values at p=1 (one process under the strategy), p=2, p=4, p=2 dp=2 and p=2 t=2,
  and from what one process under ``strategy="auto"`` starts from (``HFCausalLM`` materializes there too);
- a module of the suite's own built under ``trainer.init_module(empty_init=True)`` (its blocks' MLPs tensor
  parallel at t=2) starts alike at the same layouts, and as one process materializing it whole from that seed.

Every comparison is bit for bit, between what the runs' ranks saved after setup; nothing is copied between runs.
Each run stops after one step.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import lightning as L
import torch

from tests.distributed.harness import launch, started_from
from tests.models import RunSpec, make_model_as_the_run_does, trainer_defaults

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

FOLDER = Path(tempfile.mkdtemp(prefix="bfpp-initial-values-"))  # a Llama's `save_pretrained`, written by `results`
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "lora_dropout": 0.0}
# (processes, pipeline ranks, tensor ranks, stages per rank) of each layout
LAYOUTS = {
    "p1": (1, 1, 1, 2),
    "p2": (2, 2, 1, 2),
    "p4": (4, 4, 1, 1),
    "p2_dp2": (4, 2, 1, 2),
    "p2_t2": (4, 2, 2, 2),
}
MODELS = {
    "hf_lora": {
        "model": {"family": "llama", "layers": 3, "seed": 3, "pretrained": str(FOLDER), "lora": LORA},
        "model_factory": "tests.hf_models:hf_module",
        "loader_factory": "tests.hf_models:hf_loader",
        "checks": ["save_initial_params"],
    },
    "empty_init": {
        "model": {"optimizer": "sgd", "tp": "layer", "seed": 11},
        "model_factory": "tests.tp_models:make",
        "checks": ["empty_init", "save_initial_params"],
    },
}


def layout_run(model: str, layout: str) -> RunSpec:
    processes, p, t, v = LAYOUTS[layout]
    dp = processes // (p * t)
    strategy = {"pipeline_parallel_size": p, "tensor_parallel_size": t, "stages_per_rank": v, "num_microbatches": 2}
    return RunSpec(
        name=f"{model}_{layout}",
        strategy=strategy,
        trainer={"max_steps": 1},
        local_batch_size=8 // dp,
        data_parallel_size=dp,
        **MODELS[model],
    )


RUNS = {(model, layout): layout_run(model, layout) for model in MODELS for layout in LAYOUTS}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from tests.hf_models import tiny_config

    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(tiny_config("llama", layers=3)).save_pretrained(FOLDER)
    root = tmp_path_factory.mktemp("initial_values")
    for processes in sorted({n for n, *_ in LAYOUTS.values()}):
        runs = [run for (_, layout), run in RUNS.items() if LAYOUTS[layout][0] == processes]
        (root / str(processes)).mkdir()
        launch(runs, processes, root / str(processes), timeout=300)
    return root


def initial(workdir: Path, model: str, layout: str) -> dict[str, torch.Tensor]:
    return started_from(workdir / str(LAYOUTS[layout][0]) / "out" / RUNS[model, layout].name)


def assert_equal_values(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    assert set(got) == set(want), f"{where}: {sorted(set(got) ^ set(want))[:5]}"
    differ = [name for name in want if not torch.equal(got[name], want[name])]
    assert not differ, f"{where}: {len(differ)} of {len(want)} tensors differ, e.g. {differ[:3]}"


@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout != "p1"])
@pytest.mark.parametrize("model", list(MODELS))
def test_every_layout_starts_where_one_process_under_the_strategy_starts(workdir, model, layout):
    assert_equal_values(initial(workdir, model, layout), initial(workdir, model, "p1"), f"{layout} vs p1")


def test_lora_adapters_start_as_under_strategy_auto(workdir):
    """The Hugging Face wrapper on one process under ``strategy="auto"`` (which materializes the model whole in its
    ``configure_model``): the same adapters, the same frozen base."""
    from tests.hf_models import hf_loader, hf_module

    run = RUNS["hf_lora", "p1"]
    seen: dict[str, torch.Tensor] = {}

    class Start(L.Callback):
        def on_fit_start(self, trainer, module):
            seen.update({k: v.detach().clone() for k, v in module.named_parameters()})

    trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[Start()], **trainer_defaults(run))
    trainer.fit(hf_module(run), hf_loader(run, trainer))
    adapters = [name for name in seen if ".lora_A." in name]
    assert len(adapters) == 9 and all(seen[name].abs().sum() > 0 for name in adapters)
    assert_equal_values(initial(workdir, "hf_lora", "p1"), seen, "p1 vs strategy='auto'")


def test_a_module_built_on_the_meta_device_starts_as_one_process_materializes_it(workdir):
    want = {k: v.detach() for k, v in make_model_as_the_run_does(RUNS["empty_init", "p1"]).named_parameters()}
    assert_equal_values(initial(workdir, "empty_init", "p1"), want, "p1 vs one process")
