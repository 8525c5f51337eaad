"""Lightning's model summary of the whole model, not of one rank's part.

After setup a rank's LightningModule holds its own stages' layers and a ``RemoteLayer`` for every other one, so
Lightning's ``ModelSummary`` (on by default) would print global rank 0's share as if it were the model, with
rows of empty placeholders. :class:`WholeModelSummary` is taken before the layers are split: one row per
pipeline layer, with its type, its parameters (a parameter shared by layers counted once, where first met),
the stage that runs it and that stage's pipeline rank, and the whole model's totals (trainable ones apart, so
LoRA and frozen layers show). The strategy hands it to the trainer's summary callbacks
(:func:`~lightning_bfpp.adapter._lightning_compat.summarize_with`), which then print it as they print any summary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count
from torch import nn

from lightning_bfpp.plan.plan import Plan

__all__ = ["LayerRow", "WholeModelSummary"]


@dataclasses.dataclass(frozen=True)
class LayerRow:
    name: str
    type: str
    parameters: int
    trainable: int
    training: bool
    stage: int
    pipeline_rank: int


@dataclasses.dataclass(frozen=True)
class WholeModelSummary:
    """What Lightning's summary callbacks read from a summary (the same attributes as Lightning's own)."""

    rows: tuple[LayerRow, ...]
    outside_layers: int  # parameters of the module outside every pipeline layer
    bytes_per_parameter: float = 4.0

    @classmethod
    def of(
        cls,
        module: nn.Module,
        named: Sequence[tuple[str, nn.Module]],
        plan: Plan,
    ) -> WholeModelSummary:
        layer_stage = plan.stage_of_layer()
        stage_rank = [plan.rank_of(s) for s in range(plan.num_stages)]
        seen: set[int] = set()
        rows = []
        for (name, layer), stage in zip(named, layer_stage, strict=True):
            fresh = [p for p in layer.parameters() if id(p) not in seen]
            seen.update(id(p) for p in fresh)
            rows.append(
                LayerRow(
                    name=name,
                    type=type(layer).__name__,
                    parameters=sum(p.numel() for p in fresh),
                    trainable=sum(p.numel() for p in fresh if p.requires_grad),
                    training=layer.training,
                    stage=stage,
                    pipeline_rank=stage_rank[stage],
                )
            )
        outside = sum(p.numel() for p in module.parameters() if id(p) not in seen)
        sizes = {p.element_size() for p in module.parameters()}
        return cls(tuple(rows), outside, float(sizes.pop()) if len(sizes) == 1 else 4.0)

    @property
    def total_parameters(self) -> int:
        return sum(r.parameters for r in self.rows) + self.outside_layers

    @property
    def trainable_parameters(self) -> int:
        return sum(r.trainable for r in self.rows) + self.outside_layers

    @property
    def model_size(self) -> float:
        """Megabytes of the whole model's parameters, as Lightning's summary states it."""
        return self.total_parameters * self.bytes_per_parameter / 1e6

    @property
    def total_training_modes(self) -> dict[str, int]:
        modes = [r.training for r in self.rows]
        return {"train": modes.count(True), "eval": modes.count(False)}

    total_flops = 0

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        return [
            (" ", [str(i) for i in range(len(self.rows))]),
            ("Name", [r.name for r in self.rows]),
            ("Type", [r.type for r in self.rows]),
            ("Params", [get_human_readable_count(r.parameters) for r in self.rows]),
            ("Mode", ["train" if r.training else "eval" for r in self.rows]),
            ("Stage", [str(r.stage) for r in self.rows]),
            ("Pipeline rank", [str(r.pipeline_rank) for r in self.rows]),
        ]
