"""More than one machine: two "nodes" started by ``torchrun`` the way a cluster starts them, on this machine.

Each node is its own ``torchrun --nnodes 2 --node-rank R --nproc-per-node 2`` with the same rendezvous
address (what a cluster's job runs on each node of its allocation); Lightning sees
``TorchElasticEnvironment`` and ``Trainer(num_nodes=2, devices=2)``. The strategy's default mesh puts a
pipeline inside a node (``pipeline_parallel_size=None``: the processes of one node) and the data-parallel
replicas across nodes; the other order (``mesh_order="pipeline_data"``) keeps each data-parallel group
inside a node instead. Both must train equal to one device.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.harness import REPO, assert_params_match, assert_steps_match, load_results
from tests.models import RunSpec, reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(420)]

NODES, PER_NODE = 2, 2
RUNS = [
    RunSpec(
        name="two_nodes_pipeline_per_node",
        strategy={"stages_per_rank": 2, "num_microbatches": 4},  # p = processes per node = 2, dp = 2 nodes
        model={"optimizer": "adamw"},
        trainer={"num_nodes": NODES},
        reference={"trainer": {}},  # one process, one node
        local_batch_size=8,
        data_parallel_size=2,
    ),
    RunSpec(
        name="two_nodes_replicas_per_node",
        strategy={
            "pipeline_parallel_size": 2,
            "stages_per_rank": 2,
            "num_microbatches": 4,
            "mesh_order": "pipeline_data",
        },
        model={"optimizer": "sgd"},
        trainer={"num_nodes": NODES},
        reference={"trainer": {}},  # one process, one node
        local_batch_size=8,
        data_parallel_size=2,
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("multinode")
    spec = workdir / "spec.json"
    spec.write_text(json.dumps({"devices": PER_NODE, "runs": [r.to_json() for r in RUNS]}))
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    nodes = []
    for node_rank in range(NODES):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", f"--nproc-per-node={PER_NODE}",
            f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}",
            "-m", "tests.distributed.worker", str(spec), str(workdir / "out"),
        ]  # fmt: skip
        log = open(workdir / f"node{node_rank}.log", "w")  # noqa: SIM115 (closed below)
        nodes.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        codes = [proc.wait(timeout=360) for proc, _ in nodes]
    finally:
        for proc, log in nodes:
            if proc.poll() is None:
                proc.kill()
            log.close()
    tails = "\n".join(Path(workdir / f"node{n}.log").read_text()[-3000:] for n in range(NODES))
    assert codes == [0] * NODES, tails
    return load_results(RUNS, NODES * PER_NODE, workdir)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.name)
def test_two_nodes_train_like_one_device(run, results):
    result = results[run.name]
    placement = [(r["holdings"]["pipeline_rank"], r["holdings"]["data_parallel_rank"]) for r in result.ranks]
    if run.strategy.get("mesh_order") == "pipeline_data":  # a data-parallel group per node
        assert placement == [(0, 0), (0, 1), (1, 0), (1, 1)]
    else:  # a pipeline per node
        assert placement == [(0, 0), (1, 0), (0, 1), (1, 1)]
    ref = reference_run(run)
    assert_steps_match(result, ref, tol=1e-5, keys=("train_loss",))
    assert_params_match(result, ref, tol=1e-5)
