"""Adapters that turn third-party models into pipelinable LightningModules.

Each adapter lives in its own module or package and imports its library there, so ``import lightning_bfpp`` never needs
an optional dependency: ``from lightning_bfpp.integrations.huggingface import HFCausalLM`` needs
``transformers`` (``pip install "lightning-bfpp[huggingface]"``).
"""
