"""Decode attention over a sink + window ring buffer (the static sink+window cache): Triton kernel and its PyTorch
reference, same signature.

``query [B, Hq, L, D]`` (L = 1..16 new tokens, already written to the buffer) against preallocated
``key/value [B, Hkv, S, D]`` whose slots are in no particular order: ``slot_positions [B, S]`` (int64) holds the
logical position stored in each slot, -1 where nothing was written, and ``query_positions [B, L]`` (int64) the
queries' positions. Query i of row b sees the slots among the first ``length[b]`` (int32 ``[B]``) whose position s
has ``0 <= s <= query_positions[b, i]`` and ``s < sink`` or ``s >= query_positions[b, i] - window``; with ``chunk``
(chunked attention, a cache in position order read by its slots' positions: ``sink`` 0), also ``s`` in the query's
chunk (``s // chunk == query_positions[b, i] // chunk``). A query that
sees no slot returns zeros (a finished row of a batch, whose length is cut short). ``tree`` (int64 ``[B, L]``,
optional): the last L of the ``length[b]`` slots are the queries' tree block (a drafter's tree, written after the
ring), which query i sees by the ancestor bits ``tree[b, i]`` alone (bit j: block slot j). Every tensor is read on
the device, so the launch can be captured in a CUDA graph. Returns ``[B, L, Hq, D]`` contiguous.
"""

from __future__ import annotations

import torch

from . import runtime
from .chunk_attention import MAX_QUERIES
from .decode_core import launch_decode


def _check_positions(query, key, length, slot_positions, query_positions) -> None:
    batch, _, n, _ = query.shape
    if tuple(slot_positions.shape) != (batch, key.shape[-2]) or tuple(query_positions.shape) != (batch, n):
        raise ValueError(
            f"slot_positions must be [{batch}, {key.shape[-2]}] and query_positions [{batch}, {n}], got "
            f"{tuple(slot_positions.shape)} and {tuple(query_positions.shape)}"
        )
    if length.shape != (batch,):
        raise ValueError(f"length must hold one length per row ([{batch}]), got shape {tuple(length.shape)}")


def check_ring(query, key, length, slot_positions, query_positions) -> None:
    """What the kernel needs of a ring's positions: :func:`_check_positions`' shapes, int64, contiguous rows."""
    _check_positions(query, key, length, slot_positions, query_positions)
    if slot_positions.dtype != torch.long or query_positions.dtype != torch.long:
        raise ValueError("slot_positions and query_positions must be int64")
    if slot_positions.stride(-1) != 1 or query_positions.stride(-1) != 1:
        raise ValueError("slot_positions and query_positions must be contiguous in their last dimension")


def window_decode_attention(query, key, value, scaling: float, length, slot_positions, query_positions,
                            sink: int, window: int, tree: torch.Tensor | None = None,
                            tickets: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
    """Triton split-KV kernel; see the module docstring. ``tickets``: the merge's counters
    (:func:`~.decode_core.launch_decode`)."""
    if tree is None:
        runtime.check_attention_inputs(query, key, value)
    else:  # a tree block: up to one int64 of ancestor bits per query, any number of query rows
        runtime.check_attention_inputs(query, key, value, max_q=MAX_QUERIES, max_rows=None)
    check_ring(query, key, length, slot_positions, query_positions)
    return launch_decode(query, scaling, key, value, fp_length=length,
                         positions=(slot_positions, query_positions, sink, window, chunk), tree=tree, tickets=tickets)


def window_decode_attention_reference(query, key, value, scaling: float, length, slot_positions, query_positions,
                                      sink: int, window: int, tree: torch.Tensor | None = None,
                                      chunk: int = 0) -> torch.Tensor:
    """PyTorch reference (float32 math)."""
    _check_positions(query, key, length, slot_positions, query_positions)
    batch, hq, n, _ = query.shape
    group = hq // key.shape[1]
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    s = slot_positions[:, None, None, :]
    q = query_positions[:, None, :, None]
    read = torch.arange(key.shape[-2], device=key.device) < length.to(key.device)[:, None]
    low = q - window if not chunk else torch.maximum(q - window, q - q % chunk)
    visible = (s >= 0) & (s <= q) & ((s < sink) | (s >= low))
    if tree is not None:  # block slot j = length - L + j, seen by bit j
        rel = torch.arange(key.shape[-2], device=key.device)[None, :] - (length.to(key.device).long()[:, None] - n)
        ancestor = (tree[:, :, None] >> rel.clamp(0, 62)[:, None, :]) & 1 == 1  # [B, L, S]
        visible = torch.where((rel >= 0)[:, None, None, :], ancestor[:, None], visible)
    visible = visible & read[:, None, None, :]
    logits = torch.matmul(query.float(), k.transpose(-1, -2)) * scaling
    weights = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.matmul(weights, v).transpose(1, 2).to(query.dtype).contiguous()
