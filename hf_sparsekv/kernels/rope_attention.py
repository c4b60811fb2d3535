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

Over a quantized store (:func:`rope_quant_decode_attention`) the buffers are its full-precision buffer and the
programs of the codes' splits rotate the queries as they load them; where the Gluon kernel reads the codes
(:func:`~.decode_core.gluon_takes`) the rotary embedding and the write run before the launch, as PyTorch ops.
"""

from __future__ import annotations

import torch

from . import runtime
from .chunk_attention import MAX_QUERIES, chunk_decode_attention_reference
from .decode_core import gluon_takes, launch_decode
from .quant_attention import quant_decode_attention_reference
from .quant_reference import QuantizedTensor
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


def rope_quant_decode_attention(query, key_new, value_new, cos, sin, key, value, rows, slots, scaling: float,
                                length: torch.Tensor, quant: tuple, quant_length: torch.Tensor, group_size: int,
                                int8: bool, tickets: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`rope_decode_attention` over a quantized store: ``quant = (keys, values)`` its code buffers
    (:class:`~.quant_reference.QuantizedTensor`, ``[B, Hkv, T, ...]``), of which row b reads the first
    ``quant_length[b]`` slots (``int8``: the INT8 view, else the INT4 one) before the first ``length[b]`` slots of
    its buffers ``key/value``, which the step writes (the queries' own last)."""
    runtime.check_attention_inputs(query, key, value, key_new, value_new, max_q=MAX_QUERIES, max_rows=None)
    cos, sin = _angles(cos), _angles(sin)
    batch = query.shape[0]
    if gluon_takes(query, batch * key.shape[1], quant, group_size):  # that kernel loads the queries as they are
        cos, sin = cos[:, None], sin[:, None]
        key[rows, :, slots] = rotary(key_new, cos, sin).transpose(1, 2).to(key.dtype)
        value[rows, :, slots] = value_new.transpose(1, 2).to(value.dtype)
        return launch_decode(rotary(query, cos, sin), scaling, key, value, quant=quant, group_size=group_size,
                             int8=int8, fp_length=length, quant_length=quant_length, tickets=tickets)
    rope = (key_new, value_new, cos.expand(batch, -1, -1), sin.expand(batch, -1, -1), slots.expand(batch, -1),
            rows.reshape(-1))
    return launch_decode(query, scaling, key, value, quant=quant, group_size=group_size, int8=int8, fp_length=length,
                         quant_length=quant_length, tickets=tickets, rope=rope)


def rope_quant_decode_attention_reference(query, key_new, value_new, cos, sin, key, value, rows, slots,
                                          scaling: float, length: torch.Tensor, quant: tuple,
                                          quant_length: torch.Tensor, group_size: int, int8: bool) -> torch.Tensor:
    """The unfused step over a quantized store: the rotary embedding, ``key/value[rows, :, slots] = ...`` in place,
    then per row the float32 reference over its first ``quant_length[b]`` codes (dequantized) and ``length[b]``
    buffer slots (the last of them the queries' own, causal)."""
    cos, sin = _angles(cos)[:, None], _angles(sin)[:, None]
    key[rows, :, slots] = rotary(key_new, cos, sin).transpose(1, 2).to(key.dtype)
    value[rows, :, slots] = value_new.transpose(1, 2).to(value.dtype)
    queries = rotary(query, cos, sin)
    out = []
    for b in range(query.shape[0]):
        t, n = int(quant_length[b]), int(length[b])
        codes = [QuantizedTensor(x.upper[b : b + 1, :, :t], x.lower[b : b + 1, :, :t],
                                 x.scale[b : b + 1, :, : (t // group_size if x is quant[0] else t)],
                                 x.zero[b : b + 1, :, : (t // group_size if x is quant[0] else t)]) if t else None
                 for x in quant]
        out.append(quant_decode_attention_reference(queries[b : b + 1], *codes, key[b : b + 1, :, :n],
                                                    value[b : b + 1, :, :n], group_size, int8, scaling))
    return torch.cat(out)
