"""Decode attention over a small full-precision cache (the chunk-budget and sink+window caches): Triton kernel and
its PyTorch reference, same signature.

``query [1, Hq, L, D]`` (L = 1..MAX_QUERIES new tokens: a decode step, a verified chain or tree block) against
``key/value [1, Hkv, S, D]``, the S tokens the cache stores (kept chunks, then appended tokens; the last L are the
queries' own, causal among themselves). GQA: Hq a multiple of Hkv. dtypes float16/bfloat16/float32, head_dim 32/64/128.
The kernel reads only the S stored tokens, so its time depends on the budget, not on the context length. Key/value may
be strided views (last dim contiguous), e.g. views of preallocated storage. Returns ``[1, L, Hq, D]``.
"""

from __future__ import annotations

import torch

from . import runtime
from .decode_core import launch_decode
from .reference import ancestor_mask, masked_attention_reference

MAX_QUERIES = 63  # a tree block's ancestor bits are one int64 per query


def chunk_decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, length: torch.Tensor | None = None,
    tree: torch.Tensor | None = None, tickets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton split-KV kernel; see the module docstring. With ``length`` (int32 ``[B]`` on the device), ``key/value``
    are preallocated buffers ``[B, Hkv, S, D]`` and only the first ``length[b]`` tokens of row b are stored ones
    (CUDA-graph capture: nothing is read on the host). Without it, batch 1. ``tree`` (int64 ``[L]``, or ``[B, L]``: one
    tree per row): the queries are a tree block, query i of row b seeing its own block key j iff bit j of
    ``tree[b, i]`` is set
    (:func:`~.reference.ancestor_bits`). ``tickets``: the merge's counters (:func:`~.decode_core.launch_decode`)."""
    runtime.check_attention_inputs(query, key, value, max_q=MAX_QUERIES, max_rows=None)
    if key.shape[-2] < query.shape[-2] or value.shape[-2] != key.shape[-2]:
        raise ValueError(
            f"key/value must hold the same number of tokens, at least the {query.shape[-2]} queries; got "
            f"{key.shape[-2]} and {value.shape[-2]}"
        )
    return launch_decode(query, scaling, key, value, fp_length=length, tree=tree, tickets=tickets)


def chunk_decode_attention_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, length: torch.Tensor | None = None,
    tree: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch reference (float32 math), row by row."""
    masks = None if tree is None else ancestor_mask(tree if tree.dim() == 2 else tree[None]).expand(
        query.shape[0], -1, -1)
    if length is None:
        return masked_attention_reference(query, key, value, scaling, None if masks is None else masks[0])
    return torch.cat([
        masked_attention_reference(query[b : b + 1], key[b : b + 1, :, :n], value[b : b + 1, :, :n], scaling,
                                   None if masks is None else masks[b])
        for b, n in enumerate(length.tolist())
    ])
