"""The drafter's side of a round: its cache layout per mode, the γ draft steps and the catch-up.

Layouts (:func:`drafter_cache`, from the engine's mode and ``layout``): ``"chunk"`` BudgetDraft's chunk-budget cache
(optionally a window over the generated tokens), ``"window"`` sink + sliding window, ``"full"`` every token,
``"int4-drafter"`` a quantized store read in its INT4 view; ``"int4"`` self-speculation drafts on the verifier's
own store (no drafter cache of its own). Self-drafting (the drafter is the verifier) uses the same steps on the
verifier's weights.

A draft step reads ``seq[n-1]`` and writes ``drafts [B, γ]`` (and, sampling, the drafter's probabilities ``q [B, γ,
V]``; for a tree with siblings, its next most probable tokens at each depth, :func:`_alternatives`); after a round that
accepted every draft the drafter has not read the last one, which :func:`catch_up` feeds it before the next round
(:func:`catch_up_block`: up to γ + 1 of them, after a tree round whose kept path left the chain). A drafter whose
vocabulary differs from the verifier's by padding reads an id it lacks as id 0 and drafts only the shared ids
(:func:`widened`)."""

from __future__ import annotations

import torch

from ..caches.chunk_selection import ChunkSelection
from ..caches.static import (
    StaticChunkBudgetCache, StaticChunkWindowCache, StaticFullCache, StaticQuantCache, StaticSinkWindowCache,
)
from .common import CHUNK_SIZE, WINDOW_SINK, _attention_shape, layer_devices
from .graph_steps import static_forward
from .sampling import draw, penalized


def drafter_cache(drafter, spec, max_tokens: int, max_new: int, slack: int):
    """The drafter's static cache for ``spec`` (an :class:`~.engine.EngineSpec`): ``max_tokens`` bounds a row's
    length, ``max_new`` its new tokens, ``slack`` the positions a round may write past the last kept token."""
    shape, placed = _attention_shape(drafter), layer_devices(drafter)
    mode = spec.mode
    if mode == "chunk":
        chunk_size, selection, generated = spec.layout or (CHUNK_SIZE, ChunkSelection(), None)
        if generated is not None:  # bounded: the kept chunks, then a window of the generated tokens
            return StaticChunkWindowCache(spec.budget, generated, spec.gamma + 1, *shape, spec.dtype, spec.device,
                                          chunk_size, spec.batch, selection, placed)
        return StaticChunkBudgetCache(spec.budget, *shape, spec.budget + max_new + slack, spec.dtype,
                                      spec.device, chunk_size, batch=spec.batch, selection=selection,
                                      layer_devices=placed)
    if mode == "window":
        sink, window = spec.layout or (WINDOW_SINK, spec.budget - WINDOW_SINK)
        return StaticSinkWindowCache(sink, window, spec.gamma + 1, *shape, spec.dtype, spec.device, spec.batch,
                                     placed)
    if mode == "full":
        return StaticFullCache(*shape, max_tokens + slack, spec.dtype, spec.device, spec.batch, placed)
    if mode == "int4-drafter":  # the drafter's own store, always read in its INT4 view
        store = StaticQuantCache(spec.budget, max_tokens + slack, spec.gamma + 1, *shape, spec.dtype,
                                 spec.device, spec.batch, placed)
        store.view = "int4"
        return store
    raise ValueError(f"unknown static drafter mode {mode!r}")


def widened(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """``logits [..., V']`` of a drafter as ``[..., vocab]``: a narrower drafter (limited to the shared ids) padded
    with -inf, a wider one cut."""
    if logits.shape[-1] < vocab:
        pad = logits.new_full((*logits.shape[:-1], vocab - logits.shape[-1]), float("-inf"))
        logits = torch.cat([logits, pad], dim=-1)
    return logits[..., :vocab]


def drafter_input(tokens: torch.Tensor, draft_vocab: tuple[int, int] | None) -> torch.Tensor:
    """``tokens`` as the drafter reads them: an id it lacks (padded vocabularies, ``draft_vocab = (outputs, inputs)``)
    as id 0."""
    if draft_vocab is None:
        return tokens
    return torch.where(tokens < draft_vocab[1], tokens, torch.zeros_like(tokens))


def draft(engine) -> None:
    """γ drafter steps from ``seq[n-1]``: ``engine.drafts [B, γ]`` (each step's argmax, or draw, the next step's input)
    and, sampling, ``engine.q [B, γ, V]``. Self-speculation reads the shared store's INT4 view."""
    quant = engine.spec.mode == "int4"
    if quant:
        engine.drafter_cache.view = "int4"
    token = drafter_input(engine.last(1), engine.draft_vocab)
    seen = None if engine.penalty is None else engine.seen  # the drafter's scores get the penalty too
    siblings = engine.tree is not None and engine.tree.siblings
    for i in range(engine.spec.gamma):
        logits = static_forward(engine.drafter, token, (engine.n - 1 + i)[:, None], engine.drafter_cache, 1,
                                engine.drafter_keyword)[:, 0]
        if engine.draft_vocab is not None:
            logits = widened(logits, engine.vocab)
        token = engine.drafts[:, i : i + 1]
        if engine.warpers is None:
            scores = logits if seen is None else penalized(logits, seen, engine.penalty[0])
            token.copy_(scores.argmax(-1)[:, None])
            if siblings:
                _alternatives(engine, i, torch.log_softmax(scores.float(), -1), token)
        else:
            q = engine.probabilities(logits[:, None], engine.n + i, None if seen is None else seen[:, None])[:, 0]
            engine.q.index_copy_(1, engine.block_offsets[i : i + 1], q[:, None])  # in place once compiled
            token.copy_(draw(q)[:, None])
            if siblings:
                _alternatives(engine, i, q.log(), token)
        if seen is not None:
            seen = seen.scatter(1, token, True)
    if quant:
        engine.drafter_cache.view = "int8"
    if engine.tree is not None:  # what this step fed the drafter, checked against the sequence after verification
        engine.fed[:, :1].copy_(engine.last(1))
        engine.fed[:, 1:].copy_(engine.drafts[:, :-1])
        engine.fed_at.copy_(engine.n - 1)
        engine.fed_valid.fill_(True)


def _alternatives(engine, depth: int, logq: torch.Tensor, token: torch.Tensor) -> None:
    """A tree's candidates at ``depth`` (:mod:`.draft_tree`): the drafter's ``K`` most probable tokens after the
    chain so far other than its draft ``token [B, 1]``, and the log-probabilities ``logq [B, V]`` of both."""
    at = engine.block_offsets[depth : depth + 1]
    engine.chain_logq.index_copy_(1, at, logq.gather(1, token))
    best = logq.scatter(1, token, float("-inf")).topk(engine.tree.siblings, dim=1)
    engine.candidates.index_copy_(1, at, best.indices[:, None])
    engine.candidate_logq.index_copy_(1, at, best.values[:, None])


def catch_up(engine) -> None:
    """Feed the drafter ``seq[n-2]``, the last draft of a round that accepted every draft (it proposed it but never
    read it)."""
    static_forward(engine.drafter, drafter_input(engine.last(2), engine.draft_vocab), (engine.n - 2)[:, None],
                   engine.drafter_cache, 1, engine.drafter_keyword)


def catch_up_block(engine) -> None:
    """After a tree round whose kept path left the chain: feed the drafter ``seq[held .. held+γ]`` at their
    positions, the tokens it has not read (at most γ + 1: a round moves the sequence by at most that much); it then
    holds every position before ``n - 1``. The block's tokens past ``n - 1`` are stale and land where the next steps
    write over them."""
    positions = engine.held[:, None] + engine.block_offsets
    tokens = engine.seq.gather(1, positions.clamp_max(engine.seq.shape[1] - 1))
    static_forward(engine.drafter, drafter_input(tokens, engine.draft_vocab), positions, engine.drafter_cache, 1,
                   engine.drafter_keyword)
    engine.held.copy_(engine.n - 1)
