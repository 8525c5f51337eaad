"""A model whose output head reuses the input embedding's weight (``RunSpec.model_factory``), as GPT-2, Llama 3.2
1B/3B and small Qwen2 models tie theirs: the two users land on different pipeline stages.

``run.model`` takes PipeNet's fields; ``in_dim``, ``width`` and ``out_dim`` are set equal so that the head's
``Linear(width, out_dim)`` weight has the embedding's ``Linear(in_dim, width)`` shape.
"""

from __future__ import annotations

import torch

from tests.models import PipeNet, RunSpec

WIDTH = 16
TIED_MODEL = {"in_dim": WIDTH, "width": WIDTH, "out_dim": WIDTH, "optimizer": "adamw"}


def tied_net(run: RunSpec) -> PipeNet:
    """A PipeNet with ``head[1].weight is embed.weight`` (``embed.weight`` the canonical name)."""
    net = PipeNet(**{"batch_format": run.data.get("batch_format", "tuple"), **TIED_MODEL, **run.model})
    net.head[1].weight = net.embed.weight
    return net


def tied_net_grouped_by_name(run: RunSpec) -> PipeNet:
    """A tied PipeNet whose optimizer groups parameters by name, exempting the head from weight decay: on one
    device the tied weight is `embed.weight` (decayed); under the pipeline the head's stage sees its copy as
    `head.1.weight` (not decayed), so the copies would be optimized differently. Refused on every rank."""
    net = tied_net(run)

    def configure_optimizers() -> torch.optim.Optimizer:
        head = [p for n, p in net.named_parameters() if n.startswith("head.")]
        rest = [p for n, p in net.named_parameters() if not n.startswith("head.")]
        groups = [{"params": rest}, {"params": head, "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-3)

    net.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    return net
