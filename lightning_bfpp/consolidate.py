"""``python -m lightning_bfpp.consolidate <folder>``: the command's public name (see
:mod:`lightning_bfpp.adapter.consolidate`)."""

from lightning_bfpp.adapter.consolidate import consolidate, main

__all__ = ["consolidate", "main"]

if __name__ == "__main__":
    main()
