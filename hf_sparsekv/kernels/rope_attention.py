"""A decode or verify step's rotary embedding, cache write and attention in one launch of the split-KV kernel, and
its PyTorch reference (the three as the model and the static cache compute them, one after another).

In a decoder layer the queries and keys leave their projections, get the rotary embedding, the keys and values are
written to the cache, then attention reads the cache: in a compiled step the rotary embedding and the write are a
kernel of their own (bundled verifier, H200: about 1.5 µs and a launch gap, 12 times a step). Here the split kernel
rotates the queries as it loads them, the programs of its first split write the step's keys (rotated) and values,
and where those slots are the queries' own block (a live row of a cache in position order) every program folds the
new keys in from registers rather than from the buffer being written.

Shapes: ``query [B, Hq, L, D]`` before the rotary embedding; ``key_new/value_new [B, Hkv, L, D]`` the projections'
keys (before it) and values; ``cos/sin`` transformers' position embeddings, ``[B, L, D]`` or ``[B, 1, L, D]``;
``key/value [B, Hkv, S, D]`` the cache's buffers, written in place at row ``rows[b]`` (int64 ``[B, 1]``, distinct),
slots ``slots[b]`` (int64 ``[B, L]``); ``length [B]`` int32 the slots each row's attention reads (the last L of them
the queries' own). ``ring = (slot_positions, query_positions, sink, window[, chunk])``: the buffers are a sink+window ring
(:mod:`.window_attention`), ``slot_positions`` already holding the step's positions at its slots. Returns
``[B, L, Hq, D]``.
"""

from __future__ import annotations

import torch

from . import runtime
from .chunk_attention import MAX_QUERIES, chunk_decode_attention_reference
from .decode_core import launch_decode
from .window_attention import check_ring, window_decode_attention_reference


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` for ``x [B, H, L, D]`` and ``cos/sin [B, 1, L, D]``, in float32
    and rounded once to ``x``'s dtype (as a compiled step computes it)."""
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos.float() + rotated * sin.float()).to(x.dtype)


def _angles(t: torch.Tensor) -> torch.Tensor:
    return t[:, 0] if t.dim() == 4 else t


def rope_decode_attention(query, key_new, value_new, cos, sin, key, value, rows, slots, scaling: float,
                          length: torch.Tensor, tree: torch.Tensor | None = None, tickets: torch.Tensor | None = None,
                          ring: tuple | None = None) -> torch.Tensor:
    """The Triton kernel; see the module docstring (``tree``, ``tickets``: as
    :func:`~.chunk_attention.chunk_decode_attention`'s; no ``tree`` with ``ring``)."""
    runtime.check_attention_inputs(query, key, value, key_new, value_new, max_q=MAX_QUERIES, max_rows=None)
    if ring is not None:
        check_ring(query, key, length, *ring[:2])
    cos, sin = _angles(cos), _angles(sin)
    rope = (key_new, value_new, cos.expand(query.shape[0], -1, -1), sin.expand(query.shape[0], -1, -1),
            slots.expand(query.shape[0], -1), rows.reshape(-1))
    return launch_decode(query, scaling, key, value, fp_length=length, tree=tree, tickets=tickets, rope=rope,
                         positions=ring)


def rope_decode_attention_reference(query, key_new, value_new, cos, sin, key, value, rows, slots, scaling: float,
                                    length: torch.Tensor, tree: torch.Tensor | None = None,
                                    ring: tuple | None = None) -> torch.Tensor:
    """The unfused step: the rotary embedding (:func:`rotary`), ``key/value[rows, :, slots] = ...`` in place, then
    the float32 reference attention over the first ``length[b]`` slots of each row (on a ring, by its positions)."""
    cos, sin = _angles(cos)[:, None], _angles(sin)[:, None]
    keys = rotary(key_new, cos, sin)
    key[rows, :, slots] = keys.transpose(1, 2).to(key.dtype)
    value[rows, :, slots] = value_new.transpose(1, 2).to(value.dtype)
    queries = rotary(query, cos, sin)
    if ring is not None:
        return window_decode_attention_reference(queries, key, value, scaling, length, *ring[:4],
                                                 chunk=ring[4] if len(ring) > 4 else 0)
    return chunk_decode_attention_reference(queries, key, value, scaling, length=length, tree=tree)
