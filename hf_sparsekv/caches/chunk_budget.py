"""BudgetDraft's sparse drafter cache (§3.4, Alg. 1–2): keep at most ⌊B/s⌋ chunks of the prefix.

After the prefill, the prompt of length P is cut into chunks of ``s = chunk_size`` tokens and the chunks that
:mod:`.chunk_selection` picks are kept in their original order (by default the recent window and the sinks plus
the chunks the last prompt queries attend to most; ``selection="cumulative"`` is the paper's plain cumulative
score). Tokens fed after the prefill are appended (with ``generated_window``, only the most recent of them are
kept). Keys are stored after RoPE, so a kept token keeps its real position.

Scoring needs the queries, which a cache never sees. Under any attention implementation, forward hooks on the
attention modules recompute them from the module's input and hand them over (:mod:`.query_hooks`;
``generate()`` opens them for the call); the ``"sparsekv"`` attention implementation hands them over directly
(:mod:`hf_sparsekv.attention`). Both call :meth:`ChunkBudgetLayer.select`, which calls
:func:`~.chunk_selection.select_chunks`, the selection of every other place that selects.
"""

from __future__ import annotations

import functools

import torch

from .base import CompressedCache, CompressedLayer, is_integer, tensor_nbytes
from .scoring_hook import expect_scores
from .chunk_selection import ChunkSelection, as_selection, select_chunks, select_tokens


class ChunkBudgetLayer(CompressedLayer):
    """One layer: the kept prompt chunks, then the tokens appended after the prefill (at their real positions).

    Storage: ``keys``/``values [1, Hkv, K + A, D]``: K kept prompt tokens (``prefix_stored``), then the A stored
    appended tokens, the first of them at position ``appended_start``. Without ``generated_window`` every appended
    token is stored and attended. With it, a step whose first position is L attends to the kept prompt chunks, the
    appended tokens at positions ``>= cutoff(L) = max(P, s·⌊(L - generated_window)/s⌋)`` (the last
    generated_window to generated_window + s - 1 of them, whole chunks of the sequence) and its own tokens; the
    older appended chunks are evicted once no rollback of up to ``max_rollback`` tokens can need them. What a step
    sees is a function of L alone, so ``crop`` of up to ``max_rollback`` tokens is exact: the state is the one the
    cache would have had without the cropped tokens. Stored tokens never exceed B + generated_window + s - 1 +
    max_rollback + (the step's tokens).
    """

    def __init__(self, budget: int, chunk_size: int, selection: ChunkSelection, generated_window: int | None = None,
                 max_rollback: int = 16) -> None:
        super().__init__()
        self.budget, self.chunk_size, self.selection = budget, chunk_size, selection
        self.generated_window, self.max_rollback = generated_window, max_rollback
        self.awaiting_scores = False
        self.prefix_length = 0  # logical length at selection; crop may not go below it once tokens were dropped
        self.prompt_length = 0  # P: tokens of the first update (the prompt)
        self.prefix_stored = 0  # K: kept prompt tokens at the front of keys/values
        self.appended_start = 0  # position of the first stored appended token
        self.kept_indices: torch.Tensor | None = None  # [B, 1 or Hkv, N] positions of the kept prefix tokens

    def _cutoff(self, length: int) -> int:
        """First appended position a step starting at ``length`` attends to (generated_window set)."""
        s = self.chunk_size
        return max(self.prompt_length, (length - self.generated_window) // s * s)

    def _visible_skip(self) -> int:
        """Stored appended tokens the next step does not attend to (evicted from its view)."""
        if self.generated_window is None or self.seen == 0:
            return 0
        return max(0, self._cutoff(self.seen) - self.appended_start)

    def stored_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2] - self._visible_skip()

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
            self.seen = self.prompt_length = self.prefix_stored = self.appended_start = q
            if q > self.budget:
                self.awaiting_scores = True
            return self.keys, self.values
        skip = self._visible_skip()
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.seen += q
        if skip == 0:
            out = self.keys, self.values
        else:
            k = self.prefix_stored
            out = (torch.cat([self.keys[..., :k, :], self.keys[..., k + skip :, :]], dim=-2),
                   torch.cat([self.values[..., :k, :], self.values[..., k + skip :, :]], dim=-2))
        self._evict()
        return out

    def _evict(self) -> None:
        """Drop the stored appended tokens that no step after a rollback of up to max_rollback tokens attends to."""
        if self.generated_window is None:
            return
        drop = self._cutoff(self.seen - self.max_rollback) - self.appended_start
        if drop <= 0:
            return
        k = self.prefix_stored
        self.keys = torch.cat([self.keys[..., :k, :], self.keys[..., k + drop :, :]], dim=-2)
        self.values = torch.cat([self.values[..., :k, :], self.values[..., k + drop :, :]], dim=-2)
        self.appended_start += drop

    def select(self, query: torch.Tensor, scaling: float) -> None:
        """Keep the chunks :func:`~.chunk_selection.select_chunks` picks from the just-prefilled prompt, given its
        queries ``[B, Hq, P, D]``."""
        self.kept_indices = select_chunks(query, self.keys, scaling, self.budget, self.chunk_size, self.selection)
        self.keys = select_tokens(self.keys, self.kept_indices)
        self.values = select_tokens(self.values, self.kept_indices)
        self.prefix_stored = self.keys.shape[-2]
        self.prefix_length = query.shape[-2]
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
        if self.generated_window is not None and self.seen - n < self.prompt_length:
            raise ValueError("cannot crop a ChunkBudgetCache with generated_window into its prompt")
        if self.generated_window is not None and self._cutoff(self.seen - n) < self.appended_start:
            raise ValueError(
                f"cannot roll ChunkBudgetCache back by {n} tokens: generated tokens that far back were evicted "
                f"(max_rollback={self.max_rollback})"
            )
        keep = self.keys.shape[-2] - n
        self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]
        self.seen -= n

    def reset(self) -> None:
        super().reset()
        self.kept_indices = None
        self.prefix_length = self.prompt_length = self.prefix_stored = self.appended_start = 0
        self.awaiting_scores = False

    def nbytes(self) -> int:
        return tensor_nbytes(self.keys, self.values)


class ChunkBudgetCache(CompressedCache):
    """Sparse chunk-budget cache (BudgetDraft). Batch size 1.

    Args:
        budget: KV budget B in tokens for the prompt; at most ⌊B/chunk_size⌋ chunks are kept.
        chunk_size: chunk length s (paper: 8).
        per_kv_head: select chunks per KV head (scores summed over the query heads of its group) instead of one
            selection per layer summed over all heads (the paper's default).
        score_window: with ``selection="cumulative"``: only the last ``score_window`` prompt queries vote (None: all
            of them, the paper's cumulative attention).
        selection: ``"observed"`` (default: recent window and sinks always kept, the rest by the attention of the
            last prompt queries, pooled and normalised), ``"cumulative"`` (the paper's plain score), or a
            :class:`~.chunk_selection.ChunkSelection` with every knob (then without per_kv_head/score_window).
        generated_window: None (default): every token appended after the prefill is kept, so the cache grows by
            one token per generated token. An integer W: only the last W to W + s - 1 appended tokens (whole chunks)
            are attended to and older ones are evicted, so a long generation stays within B + W + s - 1 (+
            ``max_rollback`` stored for exact rollback). As a speculative call's ``draft_cache`` it configures the
            engine's :class:`~.static.StaticChunkWindowCache` (a token-wise window over generated tokens).
        max_rollback: with generated_window: the rollback (``crop``) length that stays exact.

    Memory: O(budget + tokens generated) per layer (O(budget + generated_window) with it), independent of the prompt
    length. Works under the model's own attention implementation: ``generate(ids,
    past_key_values=ChunkBudgetCache(B))`` takes the prompt's queries through hooks (:mod:`.query_hooks`); a
    direct forward call needs ``with hf_sparsekv.prompt_queries(model):`` around the prefill, or
    ``attn_implementation="sparsekv"``. The prompt must arrive in one forward: the selection runs on the first
    update, and later pieces of a prompt are appended whole (``generate()`` refuses ``prefill_chunk_size`` with this
    cache).
    """

    needs_prompt_queries = True  # see query_hooks.needs_prompt_queries

    def __init__(self, budget: int, chunk_size: int = 8, per_kv_head: bool = False, score_window: int | None = None,
                 selection: ChunkSelection | str = "observed", generated_window: int | None = None,
                 max_rollback: int = 16):
        if not is_integer(chunk_size) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        if not is_integer(budget) or budget < chunk_size:
            raise ValueError(f"budget must be an integer >= chunk_size ({chunk_size}), got {budget!r}")
        if score_window is not None and (not is_integer(score_window) or score_window <= 0):
            raise ValueError(f"score_window must be a positive integer or None, got {score_window!r}")
        if generated_window is not None and (not is_integer(generated_window) or generated_window < 1):
            raise ValueError(f"generated_window must be a positive integer or None, got {generated_window!r}")
        if not is_integer(max_rollback) or max_rollback < 0:
            raise ValueError(f"max_rollback must be a non-negative integer, got {max_rollback!r}")
        budget, chunk_size = int(budget), int(chunk_size)
        score_window = None if score_window is None else int(score_window)
        generated_window = None if generated_window is None else int(generated_window)
        self.selection = as_selection(selection, per_kv_head, score_window)
        self.budget, self.chunk_size = budget, chunk_size
        self.generated_window, self.max_rollback = generated_window, int(max_rollback)
        layer = functools.partial(ChunkBudgetLayer, budget, chunk_size, self.selection, generated_window,
                                  self.max_rollback)
        super().__init__(layer_class_to_replicate=layer)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        if layer.awaiting_scores:
            expect_scores(layer_idx, layer)
        return keys, values
