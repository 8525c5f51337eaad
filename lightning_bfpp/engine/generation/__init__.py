"""Generation through the pipeline: sequences decoded token by token across the stages, a KV cache per stage.

- :mod:`~lightning_bfpp.engine.generation.ring`: groups of sequences circling the ring of ranks, each rank running
  its own stages with a cache per (stage, group), the layers' ``decode`` protocol, when a row stops;
- :mod:`~lightning_bfpp.engine.generation.messages`: what travels between the ranks of the ring;
- :mod:`~lightning_bfpp.engine.generation.pipelined`: a call on a built pipeline (weights gathered once per call,
  the result on every rank of the pipeline), and the same decoding on one process.

This package is the engine side: it imports no Lightning and no ``transformers``; which token comes next is the
caller's (the Hugging Face adapter applies ``transformers``' own logits processors).
"""

from lightning_bfpp.engine.generation.pipelined import (
    evaluating,
    generate_in_pipeline,
    generate_locally,
    sampling_generator,
    sampling_seed,
)
from lightning_bfpp.engine.generation.ring import (
    DecodingLayer,
    Generated,
    Stopping,
    TokenChooser,
    decoding_layers,
    group_rows,
    prefill_positions,
    run_ring,
)

__all__ = [
    "DecodingLayer",
    "Generated",
    "Stopping",
    "TokenChooser",
    "decoding_layers",
    "evaluating",
    "generate_in_pipeline",
    "generate_locally",
    "group_rows",
    "prefill_positions",
    "run_ring",
    "sampling_generator",
    "sampling_seed",
]
