"""A static chunk cache's prefill selection as one opaque op (``hf_sparsekv::keep_top_chunks``).

The selection (:func:`~.chunk_selection.select_chunks`) does Python arithmetic on the prompt length: block sizes,
chunk counts, the forced recent and sink chunks, ``topk``'s k. Traced inline by ``torch.compile`` with dynamic
shapes, each of those becomes a guard and nearly every prompt length a new compilation. Behind a custom op the
compiled prefill sees one call that writes the kept keys/values into the row's buffers, and the arithmetic runs on
concrete sizes when the op runs, so one compilation serves prompts of every length. The host knows how many tokens
the op keeps before the forward (:func:`~.chunk_selection.kept_token_count`), so the cache sets the row's slot
positions there, outside the traced forward.
"""

from __future__ import annotations

import torch

from .chunk_selection import ChunkSelection, select_chunks, select_tokens


@torch.library.custom_op("hf_sparsekv::keep_top_chunks", mutates_args=("keys", "values"))
def keep_top_chunks(query: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, row: int, scaling: float, budget: int, chunk_size: int, method: str,
                    observe: int, pool: int, recent: int, recent_cap: float, sink: int, per_kv_head: bool,
                    score_window: int | None) -> None:
    """Write the prompt's kept tokens into slots ``0..N-1`` of row ``row`` of the buffers ``keys``/``values``
    ``[B, Hkv, C, D]``: the chunks that ``ChunkSelection(method, ..., score_window)`` keeps under ``budget`` from the
    prompt's queries ``query [1, Hq, P', D]`` (at least its voting ones) and keys/values ``[1, Hkv, P, D]``, in
    ascending position order (N = :func:`~.chunk_selection.kept_token_count` of P)."""
    selection = ChunkSelection(method, observe, pool, recent, recent_cap, sink, per_kv_head, score_window)
    kept = select_chunks(query, key_states, scaling, budget, chunk_size, selection)
    n = kept.shape[-1]
    keys[row, :, :n].copy_(select_tokens(key_states, kept)[0])
    values[row, :, :n].copy_(select_tokens(value_states, kept)[0])


@keep_top_chunks.register_fake
def _(query, key_states, value_states, keys, values, row, scaling, budget, chunk_size, method, observe, pool, recent,
      recent_cap, sink, per_kv_head, score_window) -> None:
    return None


def keep_selected(selection: ChunkSelection, query: torch.Tensor, key_states: torch.Tensor,
                  value_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row: int, scaling: float,
                  budget: int, chunk_size: int) -> None:
    """:func:`keep_top_chunks` under ``selection``."""
    keep_top_chunks(query, key_states, value_states, keys, values, row, float(scaling), budget, chunk_size,
                    selection.method, selection.observe, selection.pool, selection.recent, selection.recent_cap,
                    selection.sink, selection.per_kv_head, selection.score_window)
