"""Which chunks of a prompt a chunk-budget cache keeps (BudgetDraft's TopKChunks, §3.4): the one selection used by
every place that selects (the dynamic :class:`~.chunk_budget.ChunkBudgetCache`, its static form in
:mod:`.static`, self-drafting through the former, and the BudgetDraft trainer's sparse views).

The prompt of length P is cut into chunks of ``s = chunk_size`` tokens aligned at position 0 (the last one partial
when s does not divide P); at most ⌊B/s⌋ chunks are kept (the partial one counts as one), so never more than B
tokens. Two methods, named by :attr:`ChunkSelection.method`:

``"observed"`` (the default): what the next tokens need.
    1. The last ``observe`` prompt queries vote (SnapKV's observation window): each key j gets the attention weight
       those queries put on it, summed over the query heads of the selection group (all heads of the layer, or
       the heads of one KV group with ``per_kv_head``), divided by the number of voting queries that can see j
       (``min(w, P - j)``, w = min(observe, P)), so a key inside the window is not penalised for being seen by
       fewer queries (the causal mask).
    2. The per-token scores are max-pooled over ``pool`` neighbouring tokens (odd; 1 = none), so a chunk next to
       a strongly attended token keeps its neighbourhood (SnapKV's clustering).
    3. A chunk's score is the sum of its pooled token scores.
    4. The last min(``recent``, ⌊``recent_cap``·B⌋) prompt tokens (rounded up to whole chunks, the partial chunk
       included) and the first
       ``sink`` tokens (rounded up to whole chunks) are always kept (StreamingLLM's window and attention sinks;
       when the budget cannot hold both, the recent chunks win); the rest of the ⌊B/s⌋ chunks go to the best
       scores.

``"cumulative"``: the paper's plain score (§3.4: "scoring each chunk by cumulative attention weight"): every
    prompt query votes (or the last ``score_window`` of them), no normalisation, no pooling, no forced chunks
    other than the partial trailing chunk. Kept so that the paper's setting can be reproduced; under a causal
    mask it favours the start of the prompt (issue 36).

The observed defaults were chosen on held-out documents 0, 1 and 3 of the bundled pair at 2K prompts, and
``observe`` then on the real Qwen2.5-Coder-1.5B used drop-in (2K and 4K prompts; 512 voting queries against 128
raised its top-1 agreement with the full cache from 0.67 / 0.89 to 0.81 / 0.98 at B = 512 / 1024 on 2K prompts and
left the bundled pair's within one token of 128; ``benchmarks/chunk_selection.py --variant``; benchmarks/results/HISTORY.md,
"Chunk selection").

Both are computed ``block_size`` queries at a time in float32: memory O(block·P) per layer, never P×P.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import is_integer

METHODS = ("observed", "cumulative")
SCORE_BLOCK = 64  # the fewest queries scored at a time: float32 logits and probabilities of 64·Hq·P each per layer
# (0.5 GiB at 64K and 32 heads); the 512 observed queries take 8 blocks
SCORE_ELEMENTS = 2**25  # more queries to a block while a block's logits (queries·Hq·P) stay within this (128 MiB):
# a short prompt's 512 observed queries in one block (each block is about ten eager kernels a layer at the prefill)
FILL_ELEMENTS = 4 * SCORE_ELEMENTS  # the most logits of several layers scored as one batch (a self-drafter's cache
# filled from the verifier's: 512 MiB and the softmax's as much again; at 8B shape a layer alone reaches it)


def score_block(batch_heads: int, p: int) -> int:
    """The queries :func:`cumulative_attention` scores at a time by default for ``batch_heads`` = B·Hq query heads
    over ``p`` keys: as many as keep a block's logits within :data:`SCORE_ELEMENTS`, at least :data:`SCORE_BLOCK`."""
    return max(SCORE_BLOCK, SCORE_ELEMENTS // (batch_heads * p))


@dataclass(frozen=True)
class ChunkSelection:
    """How a chunk-budget cache scores and keeps prompt chunks (see the module docstring).

    Args:
        method: ``"observed"`` or ``"cumulative"`` (the paper's plain score).
        observe: observed: the last ``observe`` prompt queries vote (default 512).
        pool: observed: max-pool width over token scores (odd, 1 = none; default 7).
        recent: observed: the last min(recent, ⌊recent_cap·B⌋) prompt tokens are always kept, rounded up to
            chunks (default 256: the bundled verifier's greedy output needs a contiguous recent window of that
            order; a shorter one loses agreement on some documents).
        recent_cap: observed: the share of the budget the recent window may take, so that at least a quarter of it
            goes to scored chunks (default 0.75).
        sink: observed: the first ``sink`` prompt tokens are always kept (rounded up to chunks; default 8).
        per_kv_head: one selection per KV head (scores summed over its query heads) instead of one per layer.
        score_window: cumulative: only the last ``score_window`` queries vote (None: all, the paper's setting).
    """

    method: str = "observed"
    observe: int = 512
    pool: int = 7
    recent: int = 256
    recent_cap: float = 0.75
    sink: int = 8
    per_kv_head: bool = False
    score_window: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"selection must be one of {METHODS}, got {self.method!r}")
        for name in ("observe", "pool"):
            value = getattr(self, name)
            if not is_integer(value) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.pool % 2 == 0:
            raise ValueError(f"pool must be odd (a centred window), got {self.pool!r}")
        if not is_integer(self.sink) or self.sink < 0:
            raise ValueError(f"sink must be a non-negative integer, got {self.sink!r}")
        if not is_integer(self.recent) or self.recent < 0:
            raise ValueError(f"recent must be a non-negative integer, got {self.recent!r}")
        if not isinstance(self.recent_cap, (int, float)) or not 0.0 <= self.recent_cap <= 1.0:
            raise ValueError(f"recent_cap must be a share of the budget in [0, 1], got {self.recent_cap!r}")
        if self.score_window is not None and (not is_integer(self.score_window) or self.score_window <= 0):
            raise ValueError(f"score_window must be a positive integer or None, got {self.score_window!r}")
        if self.score_window is not None and self.method != "cumulative":
            raise ValueError("score_window belongs to selection='cumulative'; the observed selection uses observe=")
        for name in ("observe", "pool", "recent", "sink"):
            object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "recent_cap", float(self.recent_cap))
        if self.score_window is not None:
            object.__setattr__(self, "score_window", int(self.score_window))

    def recent_tokens(self, budget: int) -> int:
        """Prompt tokens always kept at the end under ``budget``: min(recent, ⌊recent_cap·budget⌋)."""
        return min(self.recent, int(self.recent_cap * budget))


def as_selection(selection: "ChunkSelection | str", per_kv_head: bool = False,
                 score_window: int | None = None) -> ChunkSelection:
    """A :class:`ChunkSelection` from an instance or a method name (with the older keyword arguments)."""
    if isinstance(selection, ChunkSelection):
        if per_kv_head or score_window is not None:
            raise ValueError("pass per_kv_head/score_window inside the ChunkSelection, not beside it")
        return selection
    return ChunkSelection(method=selection, per_kv_head=bool(per_kv_head), score_window=score_window)


def cumulative_attention(query: torch.Tensor, key: torch.Tensor, scaling: float, score_window: int | None = None,
                         block_size: int | None = None) -> torch.Tensor:
    """Attention mass each key receives from causal queries, summed over queries, in float32.

    query: ``[B, Hq, P', D]``, the queries of the prompt's last P' <= P positions (P - P'..P-1; all of them: P' = P),
    key: ``[B, Hkv, P, D]``, Hq a multiple of Hkv. Only the last ``score_window`` queries vote when it is given (at
    most P' of them: the queries given must cover the window). Computed ``block_size`` queries at a time, so
    memory is O(block_size·P), never P×P: each KV head's keys are read once by its group of query heads (no copy
    repeated per query head), the causal mask touches only the keys a block's queries can hide (from the block's
    first position on), and one fused softmax normalises each row. ``block_size`` (default:
    :func:`score_block` of B·Hq). Each batch row's scores depend on the blocks, not on the other rows: rows scored
    together in blocks of one row's default size get what each gets alone. Returns ``[B, Hq, P]``.
    """
    b, hq, given, d = query.shape
    p = key.shape[-2]
    offset = p - given  # the position of query row 0
    if block_size is None:
        block_size = score_block(b * hq, p)
    kv_heads = key.shape[1]
    group = hq // kv_heads
    k = key.float().transpose(-1, -2)  # [B, Hkv, D, P]
    first = 0 if score_window is None else max(0, p - score_window)
    if offset < 0 or first < offset:
        raise ValueError(f"queries of the last {given} of {p} positions cannot vote for a window from {first} on")
    scores = torch.zeros(b, hq, p, dtype=torch.float32, device=query.device)
    key_pos = torch.arange(p, device=query.device)
    for start in range(first, p, block_size):
        stop = min(start + block_size, p)
        rows = stop - start
        q = (query[:, :, start - offset : stop - offset].float() * scaling).reshape(b, kv_heads, group * rows, d)
        logits = torch.matmul(q, k).view(b, hq, rows, p)
        hidden = key_pos[None, start:] > key_pos[start:stop, None]  # query t sees keys 0..t
        logits[..., start:].masked_fill_(hidden, float("-inf"))  # every query sees key 0: no row is all -inf
        scores += torch.softmax(logits, dim=-1).sum(dim=-2)
    return scores


def _grouped(scores: torch.Tensor, kv_heads: int, per_kv_head: bool) -> torch.Tensor:
    """``[B, Hq, P]`` -> ``[B, G, P]``: summed over each KV group's query heads (G = Hkv) or over all heads (G = 1)."""
    b, hq, p = scores.shape
    return scores.view(b, kv_heads, hq // kv_heads, p).sum(2) if per_kv_head else scores.sum(1, keepdim=True)


def token_scores(query: torch.Tensor, key: torch.Tensor, scaling: float, selection: ChunkSelection,
                 block_size: int | None = None) -> torch.Tensor:
    """Per-token scores ``[B, G, P]`` float32 (G = Hkv with ``per_kv_head``, else 1) under ``selection``;
    query ``[B, Hq, P', D]`` (the last P' positions' queries, at least those that vote: :func:`voting_queries`),
    key ``[B, Hkv, P, D]`` (post-RoPE, positions 0..P-1); ``block_size`` as :func:`cumulative_attention`'s."""
    p = key.shape[-2]
    if selection.method == "cumulative":
        raw = cumulative_attention(query, key, scaling, selection.score_window, block_size)
        return _grouped(raw, key.shape[1], selection.per_kv_head)
    w = min(selection.observe, p)
    raw = cumulative_attention(query, key, scaling, w, block_size)
    seen_by = torch.clamp(p - torch.arange(p, device=query.device), max=w).float()  # voting queries that see key j
    scores = _grouped(raw / seen_by, key.shape[1], selection.per_kv_head)
    if selection.pool > 1:
        scores = F.max_pool1d(scores, selection.pool, stride=1, padding=selection.pool // 2)
    return scores


def voting_queries(selection: ChunkSelection, p: int) -> int:
    """How many of a ``p``-token prompt's last queries vote under ``selection`` (all of them: ``p``)."""
    if selection.method == "cumulative":
        return p if selection.score_window is None else min(selection.score_window, p)
    return min(selection.observe, p)


def kept_token_count(p: int, budget: int, chunk_size: int) -> int:
    """Prompt tokens a chunk-budget cache keeps of a ``p``-token prompt: all of them within the budget, else the
    trailing partial chunk and as many full chunks as the budget holds beside it (N of :func:`top_chunk_indices`)."""
    if p <= budget:
        return p
    n_full, tail = divmod(p, chunk_size)
    return tail + min(n_full, budget // chunk_size - (1 if tail else 0)) * chunk_size


def top_chunk_indices(scores: torch.Tensor, budget: int, chunk_size: int, recent: int = 0,
                      sink: int = 0) -> torch.Tensor:
    """Token indices of the kept chunks, ascending, from per-token ``scores [B, G, P]``.

    Returns ``[B, G, N]`` int64, N = min(P, r + (⌊budget/s⌋ - [r>0])·s), r = P mod s: the trailing partial chunk,
    the full chunks covering the last ``recent`` tokens and those covering the first ``sink`` tokens (as many as
    fit, recent first) are always kept; the best-scoring full chunks (by summed token score) fill the rest.
    """
    b, g, p = scores.shape
    n_full = p // chunk_size
    tail = p - n_full * chunk_size
    n_keep_full = min(n_full, budget // chunk_size - (1 if tail else 0))
    chunk = scores[..., : n_full * chunk_size].reshape(b, g, n_full, chunk_size).sum(-1)
    n_recent = min(n_keep_full, -(-max(0, recent - tail) // chunk_size))
    n_sink = min(n_keep_full - n_recent, -(-sink // chunk_size), n_full - n_recent)
    if n_recent or n_sink:
        chunk = chunk.clone()
        chunk[..., n_full - n_recent :] = float("inf")
        chunk[..., :n_sink] = float("inf")
    best = torch.topk(chunk, n_keep_full, dim=-1, sorted=False).indices.sort(dim=-1).values
    offsets = torch.arange(chunk_size, device=scores.device)
    idx = (best[..., None] * chunk_size + offsets).flatten(-2)
    tail_idx = torch.arange(n_full * chunk_size, p, device=scores.device).expand(b, g, tail)
    return torch.cat([idx, tail_idx], dim=-1)


def select_chunks(query: torch.Tensor, key: torch.Tensor, scaling: float, budget: int, chunk_size: int,
                  selection: ChunkSelection, block_size: int | None = None) -> torch.Tensor:
    """The kept token indices ``[B, G, N]`` (ascending, N <= budget) of a prompt whose queries are
    ``[B, Hq, P, D]`` (or only its last :func:`voting_queries`) and keys ``[B, Hkv, P, D]``; ``block_size`` as
    :func:`cumulative_attention`'s."""
    scores = token_scores(query, key, scaling, selection, block_size)
    if selection.method == "cumulative":
        return top_chunk_indices(scores, budget, chunk_size)
    return top_chunk_indices(scores, budget, chunk_size, selection.recent_tokens(budget), selection.sink)


def select_tokens(states: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Gather ``states [B, H, P, D]`` at ``indices [B, 1 or H, N]`` along the token axis -> ``[B, H, N, D]``."""
    b, h, _, d = states.shape
    idx = indices.expand(b, h, indices.shape[-1]).unsqueeze(-1).expand(-1, -1, -1, d)
    return torch.gather(states, 2, idx)
