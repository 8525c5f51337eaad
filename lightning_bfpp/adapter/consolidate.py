"""``python -m lightning_bfpp.consolidate <folder> --output_file <file>``: one ordinary checkpoint file.

Lightning's ``python -m lightning.pytorch.utilities.consolidate_checkpoint`` does the same, but a parameter tied
across pipeline stages is stored once, under its canonical name (see :mod:`lightning_bfpp.engine.tied`), so its file
lacks the other names that a one-device tied model's ``load_state_dict(strict=True)`` asks for. This tool adds
them, pointing to the same tensor (``torch.save`` then stores it once), from the names ``meta.pt`` records.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from lightning_bfpp.adapter import _lightning_compat as lc
from lightning_bfpp.engine.checkpoint import CURRENT_MODEL_STATE, TIED_KEY, with_tied_names


def consolidate(folder: Path, output_file: Path, *, weights_only: bool | None = None) -> None:
    """Write the DCP checkpoint ``folder`` as one file loadable by ``Module.load_from_checkpoint`` on one device.

    ``weights_only`` as ``torch.load`` takes it (``None``: torch's default, ``True``), for every file of the
    folder: a folder from elsewhere runs no code unless ``False`` says it is trusted."""
    checkpoint = lc.consolidated_checkpoint(Path(folder), weights_only=weights_only)
    aliases = checkpoint.pop(TIED_KEY, {})
    with_tied_names(checkpoint["state_dict"], aliases)
    if CURRENT_MODEL_STATE in checkpoint:  # the trained weights beside averaged ones (weight averaging)
        with_tied_names(checkpoint[CURRENT_MODEL_STATE], aliases)
    torch.save(checkpoint, output_file)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint_folder", type=Path, help="a checkpoint folder written under BFPPStrategy")
    parser.add_argument("--output_file", type=Path, default=None, help="default: <folder>.consolidated")
    parser.add_argument(
        "--no_weights_only",
        action="store_true",
        help="unpickle the files in full (`weights_only=False`), which may run code: only for folders you trust",
    )
    args = parser.parse_args(argv)
    output = args.output_file or args.checkpoint_folder.with_name(args.checkpoint_folder.name + ".consolidated")
    consolidate(args.checkpoint_folder, output, weights_only=False if args.no_weights_only else None)


if __name__ == "__main__":
    main()
