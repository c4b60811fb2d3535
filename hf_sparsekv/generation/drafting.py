"""The drafter's side of a round: its cache layout per mode, the γ draft steps and the catch-up.

Layouts (:func:`drafter_cache`, from the engine's mode and ``layout``): ``"chunk"`` BudgetDraft's chunk-budget cache
(optionally a window over the generated tokens), ``"window"`` sink + sliding window, ``"full"`` every token,
``"int4-drafter"`` a quantized store read in its INT4 view; ``"int4"`` self-speculation drafts on the verifier's
own store (no drafter cache of its own). Self-drafting (the drafter is the verifier) uses the same steps on the
verifier's weights.

A draft step reads ``seq[n-1]`` and writes ``drafts [B, γ]`` (and, sampling, the drafter's probabilities ``q [B, γ,
V]``); after a round that accepted every draft the drafter has not read the last one, which :func:`catch_up` feeds it
before the next round (:func:`catch_up_block`: up to γ + 1 of them, after a round of retrieval beside the drafter
whose kept path left the chain). A ``draft_tree_size`` round drafts a tree instead (:func:`draft_tree`: the drafter
grows it on its own cache, and first reads what it has not, so no catch-up step runs). A drafter whose
vocabulary differs from the verifier's by padding reads an id it lacks as id 0 and drafts only the shared ids
(:func:`widened`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..caches.chunk_selection import ChunkSelection
from ..caches.static import (
    StaticChunkBudgetCache, StaticChunkWindowCache, StaticFullCache, StaticQuantCache, StaticSinkWindowCache,
)
from .common import CHUNK_SIZE, WINDOW_SINK, _attention_shape, layer_devices
from .draft_tree import SCORE_FLOOR
from .graph_steps import static_forward
from .sampling import draw, penalized


def drafter_cache(drafter, spec, max_tokens: int, max_new: int, slack: int, scratch: int = 0, ahead: int = 0):
    """The drafter's static cache for ``spec`` (an :class:`~.engine.EngineSpec`), in the drafter's own dtype (which
    may differ from the verifier's ``spec.dtype``): ``max_tokens`` bounds a row's length, ``max_new`` its new tokens,
    ``slack`` the positions a round may write past the last kept token, ``scratch`` the nodes of the drafter's tree
    block (a ring keeps them after the ring), ``ahead`` the positions a lag catch-up (:func:`catch_up_lag`) may write
    past the sequence (a ring keeps that many more slots; ``slack`` includes them).

    Sized by what the engine can hold, never by the budget alone: positions stay below ``max_tokens + slack`` (the
    verifier's capacity), so a budget, sink or window beyond that is capped to it (and a window over the generated
    tokens to ``max_new + slack``), which keeps every token it would have kept (a budget at or above the sequence is
    the full cache)."""
    shape, placed = _attention_shape(drafter), layer_devices(drafter)
    mode, dtype = spec.mode, next(drafter.parameters()).dtype
    reach = max_tokens + slack  # every position a row's steps write is below it
    rollback = max(spec.gamma + 1, ahead)
    if mode == "chunk":
        chunk_size, selection, generated = spec.layout or (CHUNK_SIZE, ChunkSelection(), None)
        budget = min(spec.budget, max(reach, chunk_size))
        if generated is not None:  # bounded: the kept chunks, then a window of the generated tokens
            return StaticChunkWindowCache(budget, min(generated, max_new + slack), rollback, *shape, dtype,
                                          spec.device, chunk_size, spec.batch, selection, placed, scratch)
        # the kept prompt tokens (at most min(budget, P)) and the tokens after them: min(budget + max_new, max_tokens)
        return StaticChunkBudgetCache(budget, *shape, min(budget + max_new, max_tokens) + slack, dtype, spec.device,
                                      chunk_size, batch=spec.batch, selection=selection, layer_devices=placed)
    if mode == "window":
        sink, window = spec.layout or (WINDOW_SINK, spec.budget - WINDOW_SINK)
        return StaticSinkWindowCache(min(sink, reach), min(window, reach), rollback, *shape, dtype, spec.device,
                                     spec.batch, placed, scratch)
    if mode == "full":
        return StaticFullCache(*shape, reach, dtype, spec.device, spec.batch, placed)
    if mode == "int4-drafter":  # the drafter's own store, always read in its INT4 view
        store = StaticQuantCache(spec.budget, reach, spec.gamma + 1, *shape, dtype, spec.device, spec.batch, placed)
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


def draft(engine, width: int | None = None, reread: bool = False) -> None:
    """``width`` (default γ) drafter steps from ``seq[n-1]``: ``engine.drafts[:, :width]`` (each step's argmax, or
    draw, the next step's input) and, sampling, ``engine.q[:, :width]``. Self-speculation reads the shared store's
    INT4 view. Each step is :meth:`~.engine.StaticEngine.draft_token` (:func:`draft_token`), one compiled function
    for the steps of every width. ``reread``: the first step reads ``seq[n-2]`` too (a round queued before the host
    knows how many drafts the last one accepted: its last draft where it accepted every draft, which the drafter
    never read, else a token the drafter read, its keys written again), one forward of two tokens."""
    width = engine.spec.gamma if width is None else width
    quant = engine.spec.mode == "int4"
    if quant:
        engine.drafter_cache.view = "int4"
    engine.draft_input.copy_(drafter_input(engine.last(1), engine.draft_vocab))
    if engine.penalty is not None:  # the drafter's scores get the penalty too, of the drafts as well
        engine.draft_seen.copy_(engine.seen)
    for i in range(width):
        engine.draft_token(engine.draft_index[i], reread and i == 0)
    if quant:
        engine.drafter_cache.view = "int8"
    if engine.tree is not None:  # what this step fed the drafter, checked against the sequence after verification
        engine.fed[:, :1].copy_(engine.last(1))
        engine.fed[:, 1:].copy_(engine.drafts[:, :-1])
        engine.fed_at.copy_(engine.n - 1)
        engine.fed_valid.fill_(True)


def draft_token(engine, index: torch.Tensor, reread: bool = False) -> None:
    """Draft ``i`` (``index = [i]``, int64 on the device) of :func:`draft`: the drafter reads ``draft_input [B, 1]``
    at position ``n - 1 + i`` (``reread``, for ``i = 0``: ``seq[n-2]`` before it, at ``n - 2``) and writes its token
    to ``drafts[:, i]`` (sampling: its distribution to ``q[:, i]``) and to ``draft_input``, the next step's input.
    The index is a tensor so that one compiled function serves every step."""
    tokens, positions = engine.draft_input, (engine.n - 1 + index)[:, None]
    if reread:
        tokens = torch.cat([drafter_input(engine.last(2), engine.draft_vocab), tokens], 1)
        positions = (engine.n - 2)[:, None] + engine.block_offsets[:2]
    logits = static_forward(engine.drafter, tokens, positions, engine.drafter_cache, 1, engine.drafter_keyword)[:, -1]
    if engine.draft_vocab is not None:
        logits = widened(logits, engine.vocab)
    seen = None if engine.penalty is None else engine.draft_seen
    if engine.warpers is None:
        scores = logits if seen is None else penalized(logits, seen, engine.penalty[0])
        token = scores.argmax(-1)[:, None]
    else:
        q = engine.probabilities(logits[:, None], engine.n + index, None if seen is None else seen[:, None])[:, 0]
        engine.q.index_copy_(1, index, q[:, None])  # in place once compiled
        token = draw(q)[:, None]
    engine.drafts.index_copy_(1, index, token)
    engine.draft_input.copy_(token)
    if seen is not None:
        seen.scatter_(1, token, True)


def draft_tree(engine) -> None:
    """A tree round's drafting (:mod:`.draft_tree`, ``draft_tree_size``): the chain ``engine.drafts [B, γ]`` (and,
    sampling, its distributions ``engine.q``), the pool of other nodes (``pool_tokens / pool_scores [B, P]``) and the
    frontiers (``frontier [B, γ-1, W]``), in γ drafter forwards: first the tokens the drafter has not read, from
    ``held`` up to the root ``seq[n-1]`` (the last round's kept path, so no catch-up step runs), then one
    forward of the tree block per further depth. The block's slots are marked empty afterwards (the next round
    feeds the kept path at its positions), and the catch-up's tokens past the root are never seen. Depth d's forward
    reads the block's first d·W nodes (each block holds the one before it: the same slots, on a ring the last ones
    of its scratch, so no node of an earlier block is left outside it)."""
    tree, cache, const = engine.tree, engine.drafter_cache, engine.tree_constants
    gamma, width, first = tree.gamma, tree.width, tree.first
    positions = engine.held[:, None] + engine.block_offsets  # at most γ + 1 tokens: a round moves n by that much
    tokens = engine.seq.gather(1, positions.clamp_max(engine.seq.shape[1] - 1))
    logits = _drafter_logits(engine, tokens, positions, 0)
    cache.forget(positions < engine.n[:, None])
    at = (engine.n - 1 - engine.held).clamp(0, gamma)[:, None, None]
    logq, token = _scored(engine, logits.gather(1, at.expand(-1, 1, logits.shape[-1])), 0)
    engine.held.copy_(engine.n)
    engine.drafts[:, :1].copy_(token[:, None])
    # the pool's nodes are ranked by score wherever they are read, so no top-k of a round sorts its picks
    best = top_k(logq[:, 0].scatter(1, token[:, None], float("-inf")), first, ordered=False)
    engine.pool_tokens[:, :first].copy_(best.indices)
    engine.pool_scores[:, :first].copy_(best.values)
    chain_score = logq[:, 0].gather(1, token[:, None])  # [B, 1]
    for d in range(1, gamma):  # depth d's frontier in the block, then its children (depth d + 1) in the pool
        lo, hi = (0, first) if d == 1 else (first + (d - 2) * width**2, first + (d - 1) * width**2)
        alt = engine.pool_scores[:, lo:hi].topk(width - 1, dim=1, sorted=False)
        f_tokens = torch.cat([engine.drafts[:, d - 1 : d], engine.pool_tokens[:, lo:hi].gather(1, alt.indices)], 1)
        f_scores = torch.cat([chain_score, alt.values], 1)  # [B, W]
        j = (d - 1) * width
        own = const["block_own"][j : j + width]
        if d == 1:
            f_bits = own.expand(f_tokens.shape[0], -1)
        else:  # a frontier node's parent: the frontier slot it came from, one depth up
            via = torch.cat([const["frontier_zeros"][None, :1].expand(f_tokens.shape[0], -1),
                             const["pool_from"][lo + alt.indices]], 1)
            f_bits = own | engine.block_bits.gather(1, (d - 2) * width + via)
        engine.block_tokens[:, j : j + width].copy_(f_tokens)
        engine.block_bits[:, j : j + width].copy_(f_bits)
        engine.frontier[:, d - 1, 1:].copy_(lo + alt.indices)
        filled = j + width  # the block so far: the frontiers of depths 1..d
        logits = _drafter_logits(engine, engine.block_tokens[:, :filled],
                                 (engine.n - 1)[:, None] + const["block_depth"][:filled],
                                 const["block_index"][j:filled], engine.block_bits[:, :filled])
        logq, token = _scored(engine, logits, d)
        engine.drafts[:, d : d + 1].copy_(token[:, None])
        children = logq + f_scores[:, :, None]  # [B, W, V]: the path's log-probability
        on_chain = children[:, 0].scatter(1, token[:, None], float("-inf"))
        best = top_k(torch.cat([on_chain[:, None], children[:, 1:]], 1), width, ordered=False)
        at = first + (d - 1) * width**2
        engine.pool_tokens[:, at : at + width**2].copy_(best.indices.flatten(1))
        engine.pool_scores[:, at : at + width**2].copy_(best.values.flatten(1))
        chain_score = children[:, 0].gather(1, token[:, None])
    if gamma > 1:  # the block is done with: no later step of the drafter sees it
        cache.forget(torch.zeros_like(engine.block_bits, dtype=torch.bool))


TOPK_SLICE = 2048  # entries per slice of top_k's first stage


def top_k(x: torch.Tensor, k: int, ordered: bool = True):
    """``x.topk(k, dim=-1, sorted=ordered)`` over a long last dimension (a vocabulary), in two stages: the top k of
    each slice of TOPK_SLICE entries, then the top k of those. The same values (largest first where ``ordered``,
    else in any order: no sort kernel); among equal values the indices may differ. (One topk over a vocabulary runs
    a thread block per row: tens of µs for the few rows of a tree's frontier; the first stage gives the GPU a block
    per slice.) ``x`` has at least k entries above -inf per row."""
    v = x.shape[-1]
    if v <= 2 * TOPK_SLICE or k > TOPK_SLICE:
        return x.topk(k, dim=-1, sorted=ordered)
    slices = -(-v // TOPK_SLICE)
    local = F.pad(x, (0, slices * TOPK_SLICE - v), value=float("-inf")).unflatten(-1, (slices, TOPK_SLICE)).topk(
        k, dim=-1, sorted=False)
    starts = torch.arange(0, slices * TOPK_SLICE, TOPK_SLICE, device=x.device)[:, None]
    best = local.values.flatten(-2).topk(k, dim=-1, sorted=ordered)
    return torch.return_types.topk((best.values, (local.indices + starts).flatten(-2).gather(-1, best.indices)))


def _drafter_logits(engine, tokens: torch.Tensor, positions: torch.Tensor, keep, bits: torch.Tensor | None = None):
    """The drafter on ``tokens [B, L]`` at ``positions`` (``bits``: a tree block's ancestor bits): logits ``[B, L',
    V]`` of the rows ``keep`` (0: all; an index tensor: those), widened to the verifier's vocabulary."""
    logits = static_forward(engine.drafter, drafter_input(tokens, engine.draft_vocab), positions,
                            engine.drafter_cache, keep, engine.drafter_keyword, tree=bits)
    return logits if engine.draft_vocab is None else widened(logits, engine.vocab)


def _scored(engine, logits: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's log-probabilities ``[B, W, V]`` (float32, floored at SCORE_FLOOR) after ``logits [B, W, V]`` of
    nodes at ``depth``, and the chain's next token ``[B]`` from the first node: the argmax of its scores (greedy, with
    the repetition penalty of the sequence), or a draw from its processed distribution (sampling: kept in
    ``engine.q[:, depth]``)."""
    seen = None if engine.penalty is None else engine.seen[:, None]
    if engine.warpers is None:
        scores = logits if seen is None else penalized(logits, seen, engine.penalty[0])
        token = scores[:, 0].argmax(-1)
        logq = torch.log_softmax(scores.float(), -1)
    else:
        same_index = engine.tree_constants["frontier_zeros"][: logits.shape[1]]  # every node at index n + depth
        q = engine.probabilities(logits, engine.n + depth, seen, same_index)
        engine.q.index_copy_(1, engine.block_offsets[depth : depth + 1], q[:, :1])  # in place once compiled
        token = draw(q[:, 0])
        logq = q.log()
    return logq.clamp_min(SCORE_FLOOR), token


def catch_up(engine) -> None:
    """Feed the drafter ``seq[n-2]``, the last draft of a round that accepted every draft (it proposed it but never
    read it)."""
    static_forward(engine.drafter, drafter_input(engine.last(2), engine.draft_vocab), (engine.n - 2)[:, None],
                   engine.drafter_cache, 1, engine.drafter_keyword)


def catch_up_block(engine, offsets: torch.Tensor | None = None) -> None:
    """After a tree round whose kept path left the chain: feed the drafter ``seq[held .. held+γ]`` at their
    positions, the tokens it has not read (at most γ + 1: a round moves the sequence by at most that much); it then
    holds every position before ``n - 1``. The block's tokens past ``n - 1`` are stale: their slots are marked
    empty (on a ring, a later tree block would see them). ``offsets`` (``arange(L)``): a block of L tokens instead
    (:func:`catch_up_lag`), after which the drafter holds the positions before ``min(held + L, n - 1)``."""
    offsets = engine.block_offsets if offsets is None else offsets
    positions = engine.held[:, None] + offsets
    tokens = engine.seq.gather(1, positions.clamp_max(engine.seq.shape[1] - 1))
    static_forward(engine.drafter, drafter_input(tokens, engine.draft_vocab), positions, engine.drafter_cache, 1,
                   engine.drafter_keyword)
    _caught_up(engine, positions)


def catch_up_copy(engine) -> None:
    """:func:`catch_up_lag` of a self-drafting engine: the drafter's cache receives the verifier's own keys/values of
    the ``LAG_BLOCK`` positions from ``held`` (the same model wrote them in its plain steps: copied, no forward), as
    the companion write of those steps would have left them; slots past ``n - 1`` are marked empty."""
    positions = engine.held[:, None] + engine.lag_offsets
    source, target = engine.verifier_cache, engine.drafter_cache
    slots = source.slots_of(positions).clamp(0, source.capacity - 1)  # (past the sequence: stale, forgotten below)
    target.begin_step(positions)
    for held, layer in zip(source.layers, target.layers):
        rows, at = source.rows.to(held.keys.device), slots.to(held.keys.device)
        target.write(layer, held.keys[rows, :, at].transpose(1, 2), held.values[rows, :, at].transpose(1, 2))
    _caught_up(engine, positions)


def _caught_up(engine, positions: torch.Tensor) -> None:
    """After a catch-up block at ``positions [B, L]`` (from ``held``): its slots past ``n - 1`` marked empty, and the
    drafter holds the positions before ``min(held + L, n - 1)``."""
    engine.drafter_cache.forget(positions < engine.n[:, None])
    engine.held.copy_(torch.minimum(engine.held + positions.shape[1], engine.n - 1))


def catch_up_lag(engine) -> None:
    """After rounds without drafts (adaptive engines, :mod:`.controller`): a separate drafter reads the next
    ``LAG_BLOCK`` tokens from ``held`` (set by the host); the host repeats it until the drafter holds every position
    before ``n - 1``. Its cache has room for the stale tokens a block writes past the sequence."""
    catch_up_block(engine, engine.lag_offsets)
