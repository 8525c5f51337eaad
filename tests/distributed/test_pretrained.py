"""A module built on the meta device loads a full checkpoint into its stages, each rank reading only its own.

The suite's module is created under ``trainer.init_module(empty_init=True)`` and given its weights with
``lightning_bfpp.load_pretrained(module, path)``: from a one-device Lightning ``.ckpt``, a DCP folder and a
safetensors file, each holding the weights the one-device reference starts from (the module as its seed makes it),
so the pipelined run (p=2 × dp=2, full sharding; and weight passing over 4 processes) must train exactly as one
device does: without the checkpoint
each rank would initialize its layers afresh, with other values. The garbage collector is off from the module's
creation to the end of setup, and no rank may hold a tensor of a layer another rank keeps. A checkpoint missing a
tensor stops every rank with one message naming it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from tests.distributed.harness import assert_trained_as_on_one_device, launch, run_2x2
from tests.models import RunSpec, make_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

TOL = 1e-5
SOURCES = {"lightning_ckpt": "seed.ckpt", "dcp_folder": "seed_dcp", "safetensors_file": "seed.safetensors"}
RUNS = {
    kind: run_2x2(f"pretrained_{kind}", checks=["empty_init", f"pretrained:{path}", "no_foreign_tensors"])
    for kind, path in SOURCES.items()
}
# weight passing keeps each chunk on its owner only: the owner reads it
RUNS["weight_passing"] = RunSpec(
    name="pretrained_weight_passing",
    strategy={"schedule": "weight_passing", "processes_per_node": 2, "num_microbatches": 2},
    model={"optimizer": "sgd"},
    local_batch_size=4,
    data_parallel_size=4,
    trainer={"max_steps": 3},
    checks=["empty_init", f"pretrained:{SOURCES['safetensors_file']}"],
)
BROKEN = run_2x2("pretrained_missing_tensor", checks=["empty_init", "pretrained:broken.safetensors"], expect_error=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("pretrained")
    files = workdir / "out"  # where the runs' `pretrained:` paths start, as `resume_from` ones do
    files.mkdir()
    state = {k: v.detach().clone() for k, v in make_model(RUNS["lightning_ckpt"]).state_dict().items()}
    torch.save({"state_dict": state, "epoch": 0}, files / SOURCES["lightning_ckpt"])  # Lightning's layout
    dcp.save({"model": state}, checkpoint_id=files / SOURCES["dcp_folder"], no_dist=True)  # BFPPStrategy's
    save_file({k: v.contiguous() for k, v in state.items()}, files / SOURCES["safetensors_file"])
    broken = dict(state)
    broken.pop("blocks.1.up.weight")
    save_file({k: v.contiguous() for k, v in broken.items()}, files / "broken.safetensors")
    return workdir, launch([*RUNS.values(), BROKEN], 4, workdir, timeout=540)


@pytest.mark.parametrize("kind", [*SOURCES, "weight_passing"])
def test_a_meta_module_loads_its_stages_and_trains_as_one_device(kind, results):
    _, res = results
    result = res[RUNS[kind].name]
    assert_trained_as_on_one_device(result, RUNS[kind], tol=TOL)
    for rank in result.ranks if kind in SOURCES else ():  # nothing of another rank's layers alive, the collector off
        foreign = rank["foreign_tensors"]
        assert foreign["kept"] and foreign["dropped"] and foreign["alive"] == 0, foreign


def test_a_checkpoint_missing_a_tensor_stops_every_rank_naming_it(results):
    _, res = results
    errors = [rank["error"] for rank in res[BROKEN.name].ranks]
    assert len(errors) == 4
    for error in errors:
        assert "broken.safetensors has no tensor for `blocks.1.up.weight`" in error, error
