"""``python -m lightning_bfpp.plan``: rank every configuration for a model on a machine.

    # a model described by a profile (JSON), on 64 GPUs in nodes of 8
    python -m lightning_bfpp.plan --model profile.json --devices 64 --devices-per-node 8 --memory 80GiB \\
        --intra-node-bandwidth 200GB/s --inter-node-bandwidth 25GB/s --global-batch 256

    # an analytic GPT (layers, hidden, sequence, vocabulary) at a sustained 156 TFLOP/s per device
    python -m lightning_bfpp.plan --gpt 64,8192,2048,51200 --flops 156e12 --recompute --devices 64 ...

    # your LightningModule, measured on this machine with one batch of its DataModule, in one command
    python -m lightning_bfpp.plan --module examples.train_gpt:GPT --datamodule examples.train_gpt:SortDigitsData \\
        --microbatch-size 8 --devices 8 --memory 80GiB --intra-node-bandwidth 200GB/s --global-batch 256

    # or in steps: the profile, this machine's links, then the plan
    python -m lightning_bfpp.plan profile --module examples.train_gpt:GPT \\
        --datamodule examples.train_gpt:SortDigitsData --microbatch-size 8 --out profile.json
    python -m lightning_bfpp.plan calibrate --devices 4 --out cluster.json
    python -m lightning_bfpp.plan --model profile.json --cluster cluster.json --global-batch 64
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from lightning_bfpp.plan.cluster import MESH_ORDERS, Cluster
from lightning_bfpp.plan.costs import ModelProfile, gpt
from lightning_bfpp.plan.schedules import schedule_names
from lightning_bfpp.plan.schedules.weight_passing import WeightPassingOptions
from lightning_bfpp.plan.search import SearchSpace, format_table, search
from lightning_bfpp.plan.timeline import draw

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def quantity(text: str) -> float:
    """``80GiB``, ``25GB/s``, ``1.5e9`` → a number of bytes (or bytes/s)."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMgGtT]?i?)\s*[bB]?(?:/s)?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size or bandwidth: {text!r} (e.g. 80GiB, 25GB/s)")
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _load(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    sys.path.insert(0, str(Path.cwd()))
    return getattr(importlib.import_module(module_name), attr)


def _search_parser(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", type=Path, help="a model profile (JSON, see lightning_bfpp.plan.costs)")
    model.add_argument("--gpt", type=_ints, metavar="L,H,S,V", help="layers, hidden, sequence, vocabulary")
    model.add_argument("--module", help="measure this LightningModule (package.module:Class) on this machine")
    _profile_source(parser, required=False)
    parser.add_argument("--flops", type=float, help="sustained FLOP/s per device (with --gpt)")
    parser.add_argument("--recompute", action="store_true", help="activation recomputation (with --gpt)")
    parser.add_argument(
        "--flash-attention", action="store_true", help="attention stores no score matrices (with --gpt)"
    )
    parser.add_argument("--optimizer-state-ratio", type=float, help="optimizer bytes per parameter byte")
    parser.add_argument("--cluster", type=Path, help="a machine description (JSON, e.g. from `calibrate`)")
    parser.add_argument("--devices", type=int)
    parser.add_argument("--devices-per-node", type=int)
    parser.add_argument("--memory", type=quantity, help="memory per device, e.g. 80GiB")
    parser.add_argument("--intra-node-bandwidth", type=quantity, help="per device, e.g. 200GB/s")
    parser.add_argument("--inter-node-bandwidth", type=quantity, help="per device, e.g. 25GB/s")
    parser.add_argument(
        "--rail-bandwidth",
        type=quantity,
        help="what one device reaches across nodes while the rest of its node is quiet (weight passing's rail"
        " transfers; e.g. a shared NIC's whole bandwidth); default: --inter-node-bandwidth",
    )
    parser.add_argument("--latency", type=float, help="seconds per message")
    parser.add_argument(
        "--reductions",
        choices=("overlapped", "blocking"),
        help="whether gradient reductions overlap later compute: BFPPStrategy's default on CUDA (overlapped, the"
        " default for a machine given by flags), or torch's blocking REDUCE_GRAD (gloo's default; a --cluster"
        " file keeps its own setting unless this is given)",
    )
    parser.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    parser.add_argument("--schedules", type=lambda s: tuple(s.split(",")), default=schedule_names())
    parser.add_argument(
        "--stagger",
        action="store_true",
        help="also rank weight passing with the node stagger (a what-if: the runtime does not implement it)",
    )
    parser.add_argument("--shardings", type=lambda s: tuple(s.split(",")))
    parser.add_argument("--mesh-orders", type=lambda s: tuple(s.split(",")), default=MESH_ORDERS)
    parser.add_argument("--pipeline-sizes", type=_ints)
    parser.add_argument("--stages-per-rank", type=_ints, default=(1, 2, 4, 8))
    parser.add_argument("--microbatches", type=_ints, help="candidate micro-batch counts per replica")
    parser.add_argument(
        "--tensor-parallel-sizes",
        type=_ints,
        default=(1,),
        help="tensor group sizes to consider, e.g. 1,2,4 (each dividing a node's devices); a layer splits if its"
        " profile counts tensor-parallel all-reduces (--gpt's blocks do)",
    )
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--timeline", type=Path, help="draw the best configuration's predicted timeline (PNG)")
    parser.add_argument("--json", type=Path, help="write every candidate (JSON)")


def _profile_source(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--init-args", default="{}", help="JSON keyword arguments for --module")
    parser.add_argument("--datamodule", required=required, help="package.module:Class of a LightningDataModule")
    parser.add_argument("--microbatch-size", type=int, help="profile a micro-batch of this many samples")
    parser.add_argument("--repeats", type=int, default=5)


def _measure(args: argparse.Namespace) -> ModelProfile:
    from lightning_bfpp.adapter.user_step import training_step_input
    from lightning_bfpp.engine.microbatch import batch_size, split_microbatches
    from lightning_bfpp.measure.profile import profile_module

    if not args.datamodule:
        raise SystemExit("--module needs --datamodule (a training batch to measure with)")
    module = _load(args.module)(**json.loads(args.init_args))
    datamodule = _load(args.datamodule)()
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    if args.microbatch_size:
        batch = split_microbatches(batch, batch_size(batch) // args.microbatch_size)[0]
    return profile_module(module, batch, training_step_input, repeats=args.repeats)


def _profile(args: argparse.Namespace) -> ModelProfile:
    if args.model is not None:
        profile = ModelProfile.from_json(args.model)
    elif args.module is not None:
        profile = _measure(args)
    else:
        if args.flops is None:
            raise SystemExit("--gpt needs --flops (sustained FLOP/s per device)")
        layers, hidden, sequence, vocab = args.gpt
        profile = gpt(
            layers,
            hidden,
            sequence,
            vocab,
            flops_per_second=args.flops,
            recompute=args.recompute,
            flash_attention=args.flash_attention,
        )
    if args.optimizer_state_ratio is not None:
        profile = replace(profile, optimizer_state_ratio=args.optimizer_state_ratio)
    return profile


def _cluster(args: argparse.Namespace) -> Cluster:
    cluster = Cluster.from_json(args.cluster) if args.cluster else None
    given = {
        "num_devices": args.devices,
        "devices_per_node": args.devices_per_node,
        "memory_bytes": int(args.memory) if args.memory else None,
        "intra_node_bandwidth": args.intra_node_bandwidth,
        "inter_node_bandwidth": args.inter_node_bandwidth,
        "latency_s": args.latency,
        "inter_node_rail_bandwidth": args.rail_bandwidth,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if cluster is None:
        missing = {"num_devices", "memory_bytes", "intra_node_bandwidth"} - set(given)
        if missing:
            flags = ", ".join(
                "--" + m.replace("_bytes", "").replace("num_", "").replace("_", "-") for m in sorted(missing)
            )
            raise SystemExit(f"describe the machine with --cluster FILE, or give {flags}")
        given.setdefault("devices_per_node", given["num_devices"])
        given.setdefault("inter_node_bandwidth", given["intra_node_bandwidth"])
        cluster = Cluster(**given, overlap_reductions=True)
    else:
        cluster = replace(cluster, **given)
    if args.reductions is not None:
        cluster = replace(cluster, overlap_reductions=args.reductions == "overlapped")
    return cluster


def run_search(args: argparse.Namespace) -> None:
    profile, cluster = _profile(args), _cluster(args)
    staggered = (WeightPassingOptions(), WeightPassingOptions(stagger=True))  # the runtime's, and the what-if
    space = SearchSpace(
        schedules=args.schedules,
        shardings=args.shardings or SearchSpace().shardings,
        mesh_orders=args.mesh_orders,
        pipeline_sizes=args.pipeline_sizes,
        stages_per_rank=args.stages_per_rank,
        num_microbatches=args.microbatches,
        options={"weight_passing": staggered} if args.stagger else {},
        tensor_parallel_sizes=args.tensor_parallel_sizes,
    )
    candidates = search(profile, cluster, args.global_batch, space)
    feasible = [c for c in candidates if c.infeasible is None]
    print(
        f"{profile.name}: {profile.num_layers} layers, {profile.param_bytes / 2**30:.1f} GiB of parameters;"
        f" {cluster.num_devices} devices ({cluster.devices_per_node} per node, {cluster.memory_bytes / 2**30:.0f} GiB);"
        f" global batch {args.global_batch}; {len(feasible)} of {len(candidates)} configurations feasible\n"
    )
    print(format_table(candidates, top=args.top))
    if args.timeline and feasible:
        best = feasible[0].prediction
        assert best is not None
        draw(best.spans, args.timeline, f"predicted: {best.config.describe()}")
    if args.json:
        rows = [
            {
                "config": asdict(c.config),
                "infeasible": c.infeasible,
                **({} if c.prediction is None else {
                    "step_time": c.prediction.step_time, "bubble_fraction": c.prediction.bubble_fraction,
                    "peak_memory": c.prediction.peak_memory, "comm_bytes": c.prediction.comm_bytes,
                }),
            }
            for c in candidates
        ]  # fmt: skip
        args.json.write_text(json.dumps(rows, indent=1))


def run_profile(args: argparse.Namespace) -> None:
    profile = _measure(args)
    profile.to_json(args.out)
    print(f"wrote {args.out}: {profile.num_layers} layers, micro-batch of {profile.microbatch_size}")
    for i, layer in enumerate(profile.layers):
        print(
            f"  layer {i}: forward {1e3 * layer.forward_s:.2f} ms, backward {1e3 * layer.backward_s:.2f} ms,"
            f" {layer.param_bytes / 2**20:.2f} MiB parameters, {layer.saved_bytes / 2**20:.2f} MiB saved"
        )


def run_calibrate(args: argparse.Namespace) -> None:
    from lightning_bfpp.measure.calibrate import calibrate

    strategy: type | None = None
    if args.runtime:  # measured by training with the strategy, which the measuring code takes as an argument
        from lightning_bfpp.adapter.strategy import BFPPStrategy

        strategy = BFPPStrategy
    cluster, timings = calibrate(args.devices, group_size=args.group_size, runtime=args.runtime, strategy=strategy)
    cluster.to_json(args.out)
    print(f"wrote {args.out}: {cluster}")
    if args.timings is not None:  # what the terms were fitted on, and how far the rounds of the links disagree
        args.timings.write_text(json.dumps(timings, indent=1))
        print(f"wrote {args.timings}")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "profile":
        parser = argparse.ArgumentParser(prog="python -m lightning_bfpp.plan profile")
        parser.add_argument("--module", required=True, help="package.module:Class (or factory) of the LightningModule")
        _profile_source(parser, required=True)
        parser.add_argument("--out", type=Path, required=True)
        run_profile(parser.parse_args(argv[1:]))
    elif argv and argv[0] == "calibrate":
        parser = argparse.ArgumentParser(prog="python -m lightning_bfpp.plan calibrate")
        parser.add_argument("--devices", type=int, required=True)
        parser.add_argument("--group-size", type=int, default=2, help="data-parallel group size to measure")
        parser.add_argument(
            "--no-runtime",
            dest="runtime",
            action="store_false",
            help="measure the links only; leave the runtime's per-action and per-step costs at 0",
        )
        parser.add_argument("--out", type=Path, required=True)
        parser.add_argument("--timings", type=Path, help="also write the raw measurements (JSON) here")
        run_calibrate(parser.parse_args(argv[1:]))
    else:
        parser = argparse.ArgumentParser(
            prog="python -m lightning_bfpp.plan",
            description=__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _search_parser(parser)
        run_search(parser.parse_args(argv[1:] if argv and argv[0] == "search" else argv))


if __name__ == "__main__":
    main()
