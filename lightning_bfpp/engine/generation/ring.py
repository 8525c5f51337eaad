"""Autoregressive decoding through a pipeline's stages: groups of sequences circling the ring of ranks.

Stage ``s`` runs on ring position ``position_of(s)`` (pipeline rank ``s mod p``), so one token of a group passes
every stage in order, ``v`` times round the ring, and the last stage's logits choose the group's next token, which
goes back to the first stage. With ``G`` groups in flight (default ``p``, the ring's size) every rank has a group
to run at every moment once the ring has filled, as vLLM and SGLang keep ``p`` batches in flight and Megatron-LM
and torchchat (one batch, one lane) do not. Each rank keeps a KV cache only for its own stages, one per (stage,
group): the ``cache`` dict a stage's layers are handed with that group's inputs, for the whole call.

Every rank runs the messages it receives from its predecessor in arrival order, which is the order its predecessor
sent them in, so every stage sees the groups in the same order (0, 1, …, G − 1, 0, …), whatever ``p`` and ``v``: the
random draws of sampling (made on the last stage, in that order) do not depend on the layout. A group whose rows
have all finished leaves the ring: the last stage sends word of it once round the ring instead of its next token,
each rank frees the group's caches, and the other groups go on. No rank takes part in a collective per token; the
only collectives of a call are the caller's (gathering sharded weights once before, the result once after).

The layers' side is a protocol of one method, :class:`DecodingLayer`: ``decode(inputs, cache)``. The first
layer takes ``(input_ids, attention_mask, position_ids)`` — the whole prompt at prefill, the last token after it,
the attention mask always over the whole sequence so far — and the last returns logits ``[batch, tokens,
vocabulary]``, of which the last position's are read. The Hugging Face adapter's layers implement it
(:mod:`lightning_bfpp.integrations.huggingface.blocks`).

Written here, not taken from torch: ``torch.distributed.pipelining`` runs forward-only steps of fixed shapes and
has no generation (pytorch #157795, #162822).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from lightning_bfpp.engine.generation.messages import Kind, Mailbox, Message
from lightning_bfpp.engine.layers import Recompute


class DecodingLayer(Protocol):
    """A pipeline layer that can decode: ``decode(inputs, cache)`` runs the layer on ``inputs`` (the previous
    layer's outputs; for the first layer ``(input_ids, attention_mask, position_ids)``) with ``cache``, a dict of
    this layer's own for one group, kept for the whole ``generate`` call, in which the layer keeps its keys and
    values."""

    def decode(self, inputs: Any, cache: dict[str, Any]) -> Any: ...


# (ids so far [b, length], the last position's logits [b, vocabulary] in fp32) -> the next tokens [b]
TokenChooser = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Stopping:
    """When a row stops, as ``transformers``' ``MaxLengthCriteria`` and ``EosTokenCriteria`` decide it: after
    ``max_new_tokens`` tokens, or at one of ``eos_token_ids``; a row that has stopped takes ``pad_token_id`` for the
    rest of its group's steps."""

    max_new_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be at least 1; got {self.max_new_tokens}.")
        if self.eos_token_ids and self.pad_token_id is None:
            raise ValueError("Stopping at an end-of-sequence token needs a `pad_token_id` for the rows that stopped.")


@dataclass
class Generated:
    """What a ``generate`` call produced: ``sequences`` (prompt and new tokens, ``pad_token_id`` after a row's end,
    as long as the longest group's), and with ``record_logits`` each step's last-position logits ``[batch,
    vocabulary]`` in fp32 (zeros for the rows of groups that had left)."""

    sequences: torch.Tensor
    logits: list[torch.Tensor] = field(default_factory=list)


def prefill_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """The prompt's position ids as ``transformers``' ``generate`` makes them: the count of attended tokens before
    each one (left padding is skipped), 0 on padding."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


def group_rows(batch_size: int, num_groups: int) -> list[slice]:
    """The rows of each group: ``num_groups`` contiguous slices of the batch, sizes differing by at most one (the
    first ones larger), none empty (fewer groups than asked when the batch is smaller)."""
    count = min(num_groups, batch_size)
    base, extra = divmod(batch_size, count) if count else (0, 0)
    rows, start = [], 0
    for g in range(count):
        size = base + (g < extra)
        rows.append(slice(start, start + size))
        start += size
    return rows


@dataclass
class RingStats:
    """What one rank's part of a call did: the groups, the messages it sent, and (with ``measure``) the largest
    size each of its caches reached, per (stage, group)."""

    measure: bool = False
    groups: int = 0
    messages: int = 0
    cache_bytes: dict[tuple[int, int], int] = field(default_factory=dict)


def tensor_bytes(value: Any, seen: set[int] | None = None) -> int:
    """The bytes of the tensors ``value`` holds (in dicts, lists, tuples and objects' attributes), each once: what a
    layer keeps in a generation cache."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return 0
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v, seen) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in value)
    if hasattr(value, "__dict__") and not isinstance(value, (type, nn.Module)):
        return sum(tensor_bytes(v, seen) for v in vars(value).values())
    return 0


class _Group:
    """A group's sequences on the rank holding the last stage: what it has generated and whether it has finished."""

    def __init__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        choose: TokenChooser,
        stopping: Stopping,
        record_logits: bool,
    ) -> None:
        self.ids = input_ids
        self.mask = attention_mask
        self.position = prefill_positions(attention_mask)[:, -1:]
        self.choose = choose
        self.stopping = stopping
        self.unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        self.eos = torch.tensor(stopping.eos_token_ids, dtype=input_ids.dtype, device=input_ids.device)
        self.steps = 0
        self.logits: list[torch.Tensor] = [] if record_logits else None  # type: ignore[assignment]

    def advance(self, logits: torch.Tensor) -> bool:
        """Choose the next tokens from the last position's ``logits``; True when every row has finished."""
        last = logits[:, -1].to(dtype=torch.float32, copy=True)
        if self.logits is not None:
            self.logits.append(last)
        tokens = self.choose(self.ids, last)
        if self.stopping.eos_token_ids:
            pad = self.stopping.pad_token_id
            tokens = tokens * self.unfinished + pad * (1 - self.unfinished)
        self.ids = torch.cat([self.ids, tokens[:, None]], dim=-1)
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=-1)
        self.position = self.position + 1
        self.steps += 1
        if self.stopping.eos_token_ids:
            self.unfinished = self.unfinished & ~torch.isin(tokens, self.eos).long()
        return self.steps >= self.stopping.max_new_tokens or not bool(self.unfinished.any())

    def next_input(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.ids[:, -1:], self.mask, self.position


def _unwrapped(layer: nn.Module) -> nn.Module:
    """The layer itself, inside the recomputation wrapper a stage may put round it (``torch.compile`` compiles a
    layer in place, without a wrapper)."""
    return layer.layer if isinstance(layer, Recompute) else layer


def decoding_layers(layers: Sequence[nn.Module], names: Sequence[str]) -> list[DecodingLayer]:
    """``layers`` as :class:`DecodingLayer` s; a layer without ``decode`` is refused, by name, with the protocol."""
    found = []
    for name, layer in zip(names, layers, strict=True):
        inner = _unwrapped(layer)
        if not callable(getattr(inner, "decode", None)):
            raise TypeError(
                f"lightning_bfpp: pipeline layer `{name}` ({type(inner).__name__}) cannot generate: it has no"
                " `decode(inputs, cache)` method. Generation through the pipeline runs each layer once per token with"
                " a cache of its own (a dict kept per stage and group for the whole call): the first layer takes"
                " (input_ids, attention_mask, position_ids), the last returns logits [batch, tokens, vocabulary]."
                " The Hugging Face wrappers' layers implement it (HFCausalLM.generate); see docs/generation.md."
            )
        found.append(inner)
    return found


def _as_tuple(value: Any) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def _received(tensors: tuple[torch.Tensor, ...]) -> Any:
    return tensors[0] if len(tensors) == 1 else tensors


def run_ring(
    stages: Mapping[int, Sequence[DecodingLayer]],
    num_stages: int,
    position_of: Callable[[int], int],
    me: int,
    ring_size: int,
    mailbox: Mailbox | None,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    chooser_for: Callable[[slice], TokenChooser],
    stopping: Stopping,
    num_groups: int,
    *,
    record_logits: bool = False,
    stats: RingStats | None = None,
) -> Generated | None:
    """Decode ``input_ids`` (every rank of the ring passes the same prompts) through the ring; the result on the
    position holding the last stage, None on the others. ``stages``: this position's stages (index -> layers);
    ``chooser_for(rows)``: the token choice for a group of those rows (built on the last stage only)."""
    stats = stats if stats is not None else RingStats()
    rows = group_rows(input_ids.shape[0], num_groups)
    stats.groups = len(rows)
    first, last = position_of(0), position_of(num_stages - 1)
    previous, following = (me - 1) % ring_size, (me + 1) % ring_size
    groups: dict[int, _Group] = {}
    if me == last:
        for g, part in enumerate(rows):
            groups[g] = _Group(input_ids[part], attention_mask[part], chooser_for(part), stopping, record_logits)
    local: deque[Message] = deque()
    if me == first:
        for g, part in enumerate(rows):
            mask = attention_mask[part]
            local.append(Message(Kind.DATA, g, 0, (input_ids[part], mask, prefill_positions(mask))))
    caches: dict[tuple[int, int], list[dict[str, Any]]] = {}
    finished: set[int] = set()

    def deliver(message: Message, to: int) -> None:
        # every message travels forward round the ring (to the stage's rank, hop by hop where a placement puts the
        # next stage elsewhere, as the V of "zbv" does), so that a rank receives from its predecessor alone: a
        # receive from any source is not available on every backend (NCCL)
        if to == me:
            local.append(message)
        else:
            assert mailbox is not None
            mailbox.send(message, following)
            stats.messages += 1

    def leave(g: int) -> None:
        finished.add(g)
        for key in [key for key in caches if key[1] == g]:
            del caches[key]

    while len(finished) < len(rows):
        if local:
            message = local.popleft()
        else:
            assert mailbox is not None, "a ring of one rank never waits for a message"
            message = mailbox.receive(previous)
        g = message.group
        if message.kind is Kind.DATA and position_of(message.stage) != me:
            deliver(message, position_of(message.stage))  # passing through on its way
            continue
        if message.kind is Kind.DONE:
            leave(g)
            if following != last:
                deliver(message, following)
            continue
        stage = message.stage
        cache = caches.setdefault((stage, g), [{} for _ in stages[stage]])
        x = _received(message.tensors)
        for layer, layer_cache in zip(stages[stage], cache, strict=True):
            x = layer.decode(x, layer_cache)
        if stats.measure:
            stats.cache_bytes[stage, g] = max(stats.cache_bytes.get((stage, g), 0), tensor_bytes(cache))
        if stage < num_stages - 1:
            deliver(Message(Kind.DATA, g, stage + 1, _as_tuple(x)), position_of(stage + 1))
        elif groups[g].advance(x):
            leave(g)
            if ring_size > 1 and following != last:
                deliver(Message(Kind.DONE, g, 0), following)
        else:
            deliver(Message(Kind.DATA, g, 0, groups[g].next_input()), first)
    if mailbox is not None:
        mailbox.flush()
    if me != last:
        return None
    return _assemble(input_ids, groups, rows, stopping, record_logits)


def _assemble(
    input_ids: torch.Tensor, groups: Mapping[int, _Group], rows: Sequence[slice], stopping: Stopping, record: bool
) -> Generated:
    """The batch's sequences (the longest group's length, ``pad_token_id`` after a shorter group's end) and logits."""
    longest = max((group.ids.shape[1] for group in groups.values()), default=input_ids.shape[1])
    pad = stopping.pad_token_id if stopping.pad_token_id is not None else 0
    sequences = input_ids.new_full((input_ids.shape[0], longest), pad)
    sequences[:, : input_ids.shape[1]] = input_ids
    logits: list[torch.Tensor] = []
    for g, part in enumerate(rows):
        ids = groups[g].ids
        sequences[part, : ids.shape[1]] = ids
    if record and groups:
        vocabulary = next(iter(groups.values())).logits[0].shape[-1]
        for step in range(longest - input_ids.shape[1]):
            step_logits = torch.zeros(input_ids.shape[0], vocabulary, device=input_ids.device)
            for g, part in enumerate(rows):
                if step < len(groups[g].logits):
                    step_logits[part] = groups[g].logits[step]
            logits.append(step_logits)
    return Generated(sequences, logits)
