"""Hugging Face ``transformers`` models as pipelines of layers, ready for :class:`~lightning_bfpp.BFPPStrategy`.

The strategy needs a LightningModule whose ``pipeline_layers()`` compose to ``forward`` and pass only tensors
between each other. A ``transformers`` model is one ``forward`` that builds attention masks and rotary tables
once and hands them, with a cache, to every block; this package cuts it into layers that each rebuild what
they need from a few small tensors:

- **embeddings** — ``(input_ids, attention_mask=None, position_ids=None, token_type_ids=None)`` (of the causal
  LMs only GPT-2 takes token types; encoders: ``(input_ids, attention_mask, token_type_ids, position_ids)``)
  to ``(hidden_states, attention_mask, position_ids)`` (encoders: ``(hidden_states, attention_mask)``). A
  missing ``position_ids`` becomes ``arange(seq_len)[None]``, as the model's own forward does. Only tensors
  enter the pipeline and cross stages, yet a causal LM's mask must stay "none" when the batch has none:
  ``transformers`` separates packed documents (``position_ids`` restarting at 0, as
  ``DataCollatorWithFlattening`` makes them) only when no 2-D mask is given. So a missing mask travels as one
  column of ones, which the blocks read as none;
- **one layer per transformer block** — builds the 4-D mask from the 2-D one (and ``position_ids``) with
  ``transformers``' own mask functions (so the configured attention implementation decides its form) and, for
  rotary models, the ``(cos, sin)`` table from ``position_ids`` with its own copy of the model's rotary
  embedding, then calls the model's real block (``LlamaDecoderLayer``, ``Gemma2DecoderLayer``, ``GPT2Block``,
  ``BertLayer``, …) with its weights, without a cache;
- **head** — final norm and LM head (logits), or for encoders a pooling and a linear head.

The composition equals the model's own forward without a cache (``model(**batch, use_cache=False)``, what
``transformers``' Trainer runs: with a cache, ``transformers`` does not separate packed documents).

Causal LMs: any ``*ForCausalLM`` with an embedding, one ``ModuleList`` of decoder layers, a final norm and a
rotary embedding (:func:`decoder_parts`: from ``config.base_model_pp_plan``, or inferred), plus GPT-2. The
families in :data:`CAUSAL_LM_FAMILIES` are tested; another is checked against its own forward when built
(:func:`check_composition`). What this package does for particular families is :data:`FAMILY_CODE`. Encoders:
``BertModel`` (e.g. ``sentence-transformers/all-MiniLM-L6-v2``) and ``RobertaModel``. Tied input/output
embeddings stay tied: the head's weight is the embedding layer's ``Parameter``. LoRA adapters (``lora=``, or a
``peft`` model) train with the rest of the model frozen.

Models created on the meta device (``trainer.init_module(empty_init=True)``) come out right when the
strategy materializes each rank's layers: every ``transformers`` submodule that holds tensors gets a
``reset_parameters()`` that runs the model's own ``_init_weights`` (weights as ``from_config`` draws them,
and non-persistent buffers such as rotary ``inv_freq`` and BERT's ``position_ids`` recomputed).

:func:`export_pretrained` writes a trained module (or a checkpoint of one) back as a ``save_pretrained``
folder.

One concern a module (each name this docstring cites is importable from the package itself):

- ``masks``: the 2-D mask that crosses stages (and its stand-in for "none"), the 4-D masks the blocks rebuild;
- ``blocks``: the pipeline layers (embeddings, decoder and encoder blocks, LM and pooling heads);
- ``parts``: which modules of which models become which layers; the tested families, the composition check;
- ``resets``: ``reset_parameters()`` as the model (or ``peft``) initializes, for meta-device layers;
- ``lora``: ``peft`` configs and models as LoRA layers inside the model;
- ``tensor_parallel``: the model's tensor-parallel plan, per layer, as torch's parallel styles;
- ``loading``: the wrappers' ``model`` and ``dtype`` arguments as a ``transformers`` model;
- ``pretrained``: the weights' ``transformers`` names, per-stage reading, ``materialize``;
- ``modules``: :class:`HFCausalLM`, :class:`HFSequenceRegressor` and their shared base class;
- ``export``: :func:`export_pretrained`, streaming a checkpoint out one shard at a time.
"""

from __future__ import annotations

try:  # each module below imports `transformers`: one error that says what to install, before any of them
    import transformers.masking_utils  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "lightning_bfpp.integrations.huggingface needs `transformers` (>= 5.24): "
        'pip install "lightning-bfpp[huggingface]"'
    ) from error

from lightning_bfpp.integrations.huggingface.blocks import POOLINGS as POOLINGS
from lightning_bfpp.integrations.huggingface.blocks import CausalEmbedding as CausalEmbedding
from lightning_bfpp.integrations.huggingface.blocks import CausalLMHead as CausalLMHead
from lightning_bfpp.integrations.huggingface.blocks import DecoderBlock as DecoderBlock
from lightning_bfpp.integrations.huggingface.blocks import EncoderBlock as EncoderBlock
from lightning_bfpp.integrations.huggingface.blocks import EncoderEmbedding as EncoderEmbedding
from lightning_bfpp.integrations.huggingface.blocks import GPT2DecoderBlock as GPT2DecoderBlock
from lightning_bfpp.integrations.huggingface.blocks import PoolingHead as PoolingHead
from lightning_bfpp.integrations.huggingface.export import TASK_HEAD_FILE as TASK_HEAD_FILE
from lightning_bfpp.integrations.huggingface.export import export_pretrained
from lightning_bfpp.integrations.huggingface.modules import HFCausalLM, HFSequenceRegressor
from lightning_bfpp.integrations.huggingface.parts import (
    CAUSAL_LM_FAMILIES,
    ENCODER_CLASSES,
    FAMILY_CODE,
    DecoderParts,
    causal_lm_layers,
    check_composition,
    decoder_parts,
    encoder_layers,
)
from lightning_bfpp.integrations.huggingface.tensor_parallel import (
    GradientsSummedOverTensorGroup as GradientsSummedOverTensorGroup,
)
from lightning_bfpp.integrations.huggingface.tensor_parallel import VocabParallelEmbedding as VocabParallelEmbedding
from lightning_bfpp.integrations.huggingface.tensor_parallel import _tp_style as _tp_style
from lightning_bfpp.integrations.huggingface.tensor_parallel import tensor_parallel_plan as tensor_parallel_plan

# the API; the layers, the tensor-parallel styles and `TASK_HEAD_FILE` above are importable from here too
__all__ = [
    "CAUSAL_LM_FAMILIES",
    "ENCODER_CLASSES",
    "FAMILY_CODE",
    "DecoderParts",
    "HFCausalLM",
    "HFSequenceRegressor",
    "causal_lm_layers",
    "check_composition",
    "decoder_parts",
    "encoder_layers",
    "export_pretrained",
]
