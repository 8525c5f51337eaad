"""The GPT example through ``LightningCLI``: every Trainer and strategy argument from the command line.

    python examples/cli.py fit --trainer.accelerator=cpu --trainer.devices=4 --trainer.strategy=bfpp
    python examples/cli.py fit --trainer.accelerator=cpu --trainer.devices=4 \\
        --trainer.strategy=lightning_bfpp.BFPPStrategy \\
        --trainer.strategy.pipeline_parallel_size=2 --trainer.strategy.num_microbatches=4

Lightning finds strategy names only in its registry, so ``import lightning_bfpp`` must run before the CLI
parses ``--trainer.strategy=bfpp``.
"""

from lightning.pytorch.cli import LightningCLI
from train_gpt import GPT, SortDigitsData

import lightning_bfpp  # noqa: F401  (registers strategy="bfpp")

if __name__ == "__main__":
    LightningCLI(GPT, SortDigitsData)
