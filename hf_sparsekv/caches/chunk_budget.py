"""BudgetDraft's sparse drafter cache (§3.4, Alg. 1–2): keep the top ⌊B/s⌋ chunks of the prefix.

After the prefill, the prompt of length P is cut into chunks of ``s = chunk_size`` tokens, each chunk is scored by
the cumulative attention weight the prompt's queries put on it (summed over query heads, per layer; or per KV
head), and the ⌊B/s⌋ best chunks are kept in their original order. A trailing partial chunk (P mod s tokens,
the most recent ones) is always kept and counts as one of the ⌊B/s⌋. Tokens fed after the prefill are appended.
Keys are stored after RoPE, so a kept token keeps its real position.

Scoring needs the queries, which a cache never sees. Under any attention implementation, forward hooks on the
attention modules recompute them from the module's input and hand them over (:mod:`.query_hooks`;
``generate()`` opens them for the call); the ``"sparsekv"`` attention implementation hands them over directly
(:mod:`hf_sparsekv.attention`). Both call :meth:`ChunkBudgetLayer.select`. The same :func:`top_chunk_indices` is
used by inference and by the BudgetDraft trainer.
"""

from __future__ import annotations

import functools

import torch

from .base import CompressedCache, CompressedLayer, is_integer, tensor_nbytes
from . import scoring_hook


def cumulative_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    scaling: float,
    score_window: int | None = None,
    block_size: int = 512,
) -> torch.Tensor:
    """Attention mass each key receives from causal queries, summed over queries, in float32.

    query: ``[B, Hq, P, D]`` (prompt queries at positions 0..P-1), key: ``[B, Hkv, P, D]``, Hq a multiple of Hkv.
    Only the last ``score_window`` queries vote when it is given. Computed ``block_size`` queries at a time, so
    memory is O(block_size·P), never P×P. Returns ``[B, Hq, P]``.
    """
    b, hq, p, d = query.shape
    hkv = key.shape[1]
    group = hq // hkv
    k = key.float().repeat_interleave(group, dim=1)
    first = 0 if score_window is None else max(0, p - score_window)
    scores = torch.zeros(b, hq, p, dtype=torch.float32, device=query.device)
    key_pos = torch.arange(p, device=query.device)
    for start in range(first, p, block_size):
        stop = min(start + block_size, p)
        logits = torch.matmul(query[:, :, start:stop].float(), k.transpose(-1, -2)) * scaling
        q_pos = torch.arange(start, stop, device=query.device)
        logits.masked_fill_(key_pos[None, :] > q_pos[:, None], float("-inf"))
        scores += torch.softmax(logits, dim=-1).sum(dim=-2)
    return scores


def top_chunk_indices(token_scores: torch.Tensor, budget: int, chunk_size: int) -> torch.Tensor:
    """Token indices of the kept chunks, ascending.

    token_scores: ``[B, G, P]`` (G = 1 for one selection shared by all heads, or one per KV head).
    Returns ``[B, G, N]`` int64 with N = min(P, r + (⌊budget/chunk_size⌋ - [r>0])·chunk_size), r = P mod chunk_size:
    the trailing partial chunk is always kept and the best full chunks fill the rest of ⌊budget/chunk_size⌋.
    """
    b, g, p = token_scores.shape
    n_keep = budget // chunk_size
    n_full = p // chunk_size
    tail = p - n_full * chunk_size
    n_keep_full = min(n_full, n_keep - (1 if tail else 0))
    chunk_scores = token_scores[..., : n_full * chunk_size].reshape(b, g, n_full, chunk_size).sum(-1)
    best = torch.topk(chunk_scores, n_keep_full, dim=-1, sorted=False).indices.sort(dim=-1).values
    offsets = torch.arange(chunk_size, device=token_scores.device)
    idx = (best[..., None] * chunk_size + offsets).flatten(-2)
    tail_idx = torch.arange(n_full * chunk_size, p, device=token_scores.device).expand(b, g, tail)
    return torch.cat([idx, tail_idx], dim=-1)


def select_tokens(states: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Gather ``states [B, H, P, D]`` at ``indices [B, 1 or H, N]`` along the token axis -> ``[B, H, N, D]``."""
    b, h, _, d = states.shape
    idx = indices.expand(b, h, indices.shape[-1]).unsqueeze(-1).expand(-1, -1, -1, d)
    return torch.gather(states, 2, idx)


class ChunkBudgetLayer(CompressedLayer):
    def __init__(self, budget: int, chunk_size: int, per_kv_head: bool, score_window: int | None) -> None:
        super().__init__()
        self.budget, self.chunk_size = budget, chunk_size
        self.per_kv_head, self.score_window = per_kv_head, score_window
        self.awaiting_scores = False
        self.prefix_length = 0  # logical length at selection; crop may not go below it once tokens were dropped
        self.kept_indices: torch.Tensor | None = None  # [B, 1 or Hkv, N] positions of the kept prefix tokens

    def stored_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.awaiting_scores:
            raise RuntimeError(
                "ChunkBudgetCache received its prefill but never the prompt's queries needed to select chunks: use it "
                "through generate() (past_key_values=cache), or run the prefill inside "
                "`with hf_sparsekv.prompt_queries(model):`, or with attn_implementation='sparsekv'"
            )
        q = key_states.shape[-2]
        if self.seen == 0:
            self.keys, self.values = key_states, value_states
            self.seen = q
            if q > self.budget:
                self.awaiting_scores = True
            return self.keys, self.values
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.seen += q
        return self.keys, self.values

    def select(self, query: torch.Tensor, scaling: float) -> None:
        """Keep the top chunks of the just-prefilled prompt, given its queries ``[B, Hq, P, D]``."""
        scores = cumulative_attention(query, self.keys, scaling, self.score_window)
        b, hq, p = scores.shape
        hkv = self.keys.shape[1]
        scores = scores.view(b, hkv, hq // hkv, p).sum(2) if self.per_kv_head else scores.sum(1, keepdim=True)
        self.kept_indices = top_chunk_indices(scores, self.budget, self.chunk_size)
        self.keys = select_tokens(self.keys, self.kept_indices)
        self.values = select_tokens(self.values, self.kept_indices)
        self.prefix_length = p
        self.awaiting_scores = False

    def crop(self, tokens_to_remove: int) -> None:
        n = self._tokens_to_remove(tokens_to_remove)
        if n == 0:
            return
        if self.seen - n < self.prefix_length:
            raise ValueError(
                f"cannot crop ChunkBudgetCache to {self.seen - n} tokens: the prefix of {self.prefix_length} tokens "
                "was already compressed"
            )
        keep = self.stored_length() - n
        self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]
        self.seen -= n

    def reset(self) -> None:
        super().reset()
        self.kept_indices = None
        self.prefix_length = 0
        self.awaiting_scores = False

    def nbytes(self) -> int:
        return tensor_nbytes(self.keys, self.values)


class ChunkBudgetCache(CompressedCache):
    """Sparse chunk-budget cache (BudgetDraft). Batch size 1.

    Args:
        budget: KV budget B in tokens for the prompt; the top ⌊B/chunk_size⌋ chunks are kept.
        chunk_size: chunk length s (paper: 8).
        per_kv_head: select chunks per KV head (scores summed over the query heads of its group) instead of one
            selection per layer summed over all heads (the paper's default).
        score_window: only the last ``score_window`` prompt queries vote (None: all of them, cumulative attention).

    Memory: O(budget + tokens generated) per layer, independent of the prompt length. Works under the model's own
    attention implementation: ``generate(ids, past_key_values=ChunkBudgetCache(B))`` takes the prompt's queries
    through hooks (:mod:`.query_hooks`); a direct forward call needs ``with hf_sparsekv.prompt_queries(model):``
    around the prefill, or ``attn_implementation="sparsekv"``. The prompt must arrive in one forward: the selection
    runs on the first update, and later pieces of a prompt are appended whole (``generate()`` refuses
    ``prefill_chunk_size`` with this cache).
    """

    needs_prompt_queries = True  # see query_hooks.needs_prompt_queries

    def __init__(self, budget: int, chunk_size: int = 8, per_kv_head: bool = False, score_window: int | None = None):
        if not is_integer(chunk_size) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        if not is_integer(budget) or budget < chunk_size:
            raise ValueError(f"budget must be an integer >= chunk_size ({chunk_size}), got {budget!r}")
        if score_window is not None and (not is_integer(score_window) or score_window <= 0):
            raise ValueError(f"score_window must be a positive integer or None, got {score_window!r}")
        budget, chunk_size = int(budget), int(chunk_size)
        score_window = None if score_window is None else int(score_window)
        self.budget, self.chunk_size = budget, chunk_size
        layer = functools.partial(ChunkBudgetLayer, budget, chunk_size, per_kv_head, score_window)
        super().__init__(layer_class_to_replicate=layer)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        if layer.awaiting_scores:
            scoring_hook.expect_scores(layer_idx, layer)
        return keys, values
