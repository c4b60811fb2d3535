"""The ``"sparsekv"`` attention implementation registered with transformers: routes each layer's attention to the
kernel that fits its cache and device.

Routing (``query [1, Hq, L, D]``, what the cache's ``update`` returned as key/value):

* **Chunk-budget / sink+window layer**, decode or verify step (L <= 16, past tokens stored): Triton split-KV decode
  attention over the stored tokens (:mod:`.kernels.chunk_attention`).
* **Hierarchical quantized layer**: Triton attention reading the packed codes in the cache's current view plus the
  full-precision buffer (:mod:`.kernels.quant_attention`); that layer's ``update`` returns placeholders once this
  function has seen it, so no dequantized copy of the store is ever made.
* **Any other cache** (e.g. the verifier's ``DynamicCache``), 2 <= L <= 16 new tokens, float16/bfloat16: LongSpec's
  hybrid verification attention (:mod:`.kernels.verify_attention`).
* Everything else (prefill, L = 1 on a dense cache, float32 dense, unsupported shapes): PyTorch SDPA, as before.

Kernels run where :func:`hf_sparsekv.kernels.runtime.enabled` says so (CUDA with Triton, unless switched off); on
CPU the path is the PyTorch reference (SDPA; the quantized layer dequantizes). Kernels assume the standard mask
(every stored past token visible, causal among the new ones). The mask function registered beside this attention
tags the masks it builds for that case; with any other mask (padding, sliding window that cuts, custom 4D masks,
soft-capping) the reference path runs, reading the quantized layer's storage if needed: never a silent wrong result.

When a cache layer asked for the prompt's queries (chunk scoring, see :mod:`hf_sparsekv.caches.chunk_budget`),
they are handed over here as well.
"""

from __future__ import annotations

import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, causal_mask_function

from .caches import kernel_hook, scoring_hook
from .caches.chunk_budget import ChunkBudgetLayer
from .caches.quantized import HierarchicalQuantLayer
from .caches.sink_window import SinkWindowLayer
from .kernels import runtime

NAME = "sparsekv"
MAX_KERNEL_QUERIES = 16
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks")

_standard_masks: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
_sdpa_mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]


def sparsekv_mask(*args, **kwargs):
    """SDPA's mask; a mask built for the standard case (plain causal, no padding, the keys end at the last query) is
    remembered, so that the attention knows the kernels may ignore it."""
    mask = _sdpa_mask(*args, **kwargs)
    if isinstance(mask, torch.Tensor) and _standard_case(kwargs):
        _standard_masks[id(mask)] = mask
    return mask


def _standard_case(kwargs) -> bool:
    try:
        q_length, kv_length = int(kwargs["q_length"]), int(kwargs["kv_length"])
        q_offset, kv_offset = int(kwargs.get("q_offset", 0)), int(kwargs.get("kv_offset", 0))
    except (KeyError, TypeError):
        return False
    if kwargs.get("mask_function") is not causal_mask_function or kwargs.get("local_size") is not None:
        return False
    if kv_offset + kv_length != q_offset + q_length:
        return False
    padding = kwargs.get("attention_mask")
    return padding is None or bool(padding.all())


def _standard_mask(mask) -> bool:
    return mask is None or _standard_masks.get(id(mask)) is mask


def _kernel_heads_ok(query: torch.Tensor, n_kv_heads: int) -> bool:
    """Dtype, head_dim and GQA ratio the kernels take (any query length, any number of rows: a caller over a cache of
    one row checks the batch itself)."""
    _, hq, _, d = query.shape
    return (
        query.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and d in (32, 64, 128)
        and hq % n_kv_heads == 0
        and hq // n_kv_heads <= 128
    )


def _kernel_shape_ok(query: torch.Tensor, n_kv_heads: int, max_queries: int = MAX_KERNEL_QUERIES,
                     max_rows: int | None = 128) -> bool:
    length = query.shape[-2]
    hq = query.shape[1]
    return (
        _kernel_heads_ok(query, n_kv_heads)
        and 1 <= length <= max_queries
        and (max_rows is None or (hq // n_kv_heads) * length <= max_rows)
    )


def _kernels_apply(query, n_kv_heads, attention_mask, dropout, kwargs) -> bool:
    return (
        runtime.enabled(query.device)
        and query.shape[0] == 1  # the eager caches hold one row
        and dropout == 0.0
        and not any(kwargs.get(name) is not None for name in _UNSUPPORTED_KWARGS)
        and _kernel_shape_ok(query, n_kv_heads)
        and _standard_mask(attention_mask)
    )


def quant_kernel_ok(group_size: int, dtype: torch.dtype) -> bool:
    """Whether the quantized decode kernel takes a store of this group size and dtype."""
    return group_size % 16 == 0 and dtype in (torch.float16, torch.bfloat16, torch.float32)


def _quantized_attention(module, query, layer, attention_mask, scaling, dropout, kwargs):
    """Attention over a quantized layer whose update returned placeholders."""
    if _kernels_apply(query, layer.keys.shape[1], attention_mask, dropout, kwargs) and quant_kernel_ok(layer.group_size, layer.dtype):
        from .kernels.quant_attention import quant_decode_attention

        out = quant_decode_attention(
            query, layer.qkeys, layer.qvalues, layer.keys, layer.values, layer.group_size,
            layer.owner.view == "int8", scaling,
        )
        return out, None
    key, value = layer.materialized()  # reference path for what the kernel does not cover
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def sparsekv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """query ``[B, Hq, q, D]``, key/value ``[B, Hkv, kv, D]`` (as returned by the cache) -> ``([B, q, Hq, D], None)``."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer_idx = getattr(module, "layer_idx", -1)
    layer = kernel_hook.take(layer_idx, key)
    if key.is_meta:
        if not isinstance(layer, HierarchicalQuantLayer):
            raise RuntimeError("sparsekv attention received placeholder keys without the quantized cache layer")
        return _quantized_attention(module, query, layer, attention_mask, scale, dropout, kwargs)
    scoring = scoring_hook.take(layer_idx, key)
    length, stored = query.shape[-2], key.shape[-2]
    out = None
    if scoring is None and stored > length and _kernels_apply(query, key.shape[1], attention_mask, dropout, kwargs):
        if isinstance(layer, (ChunkBudgetLayer, SinkWindowLayer)):
            from .kernels.chunk_attention import chunk_decode_attention

            out = chunk_decode_attention(query, key, value, scale), None
        elif layer is None and length >= 2 and query.dtype in (torch.float16, torch.bfloat16):
            from .kernels.verify_attention import verify_attention

            out = verify_attention(query, key, value, scale), None
    if out is None:
        out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    scoring_hook.hand_over(module, query, key, scale, scoring)
    if (
        isinstance(layer, HierarchicalQuantLayer)
        and runtime.enabled(query.device)
        and quant_kernel_ok(layer.group_size, layer.dtype)
        and query.shape[0] == 1
        and _kernel_heads_ok(query, key.shape[1])
    ):
        layer.kernel_attention = True  # from the next update on, the kernel reads the codes (no dequantized copy)
    return out


def register() -> None:
    AttentionInterface.register(NAME, sparsekv_attention)
    AttentionMaskInterface.register(NAME, sparsekv_mask)
