"""The ``"sparsekv_static"`` attention implementation: attention over the preallocated caches of
:mod:`hf_sparsekv.caches.static`, with nothing read on the host, so that a model forward can be captured as a CUDA
graph.

No mask function is registered under this name, so transformers builds no mask (``create_causal_mask`` returns
None); what a query sees comes from the cache (``slot_positions``, ``fp_length``), handed over by
:mod:`hf_sparsekv.caches.kernel_hook`. Routing (``query [1, Hq, L, D]``):

* **prefill** (eager, the cache is empty): causal attention over the prompt's own keys (PyTorch SDPA; with a
  sliding window, an explicit mask), then the cache stores what its layout keeps (a chunk-budget cache selects its
  chunks from the prompt's queries here);
* **decode / verify step** on a cache whose slots are in position order (full, chunk budget), CUDA, no sliding
  window, a shape the kernel takes: the Triton split-KV kernel reading its length from ``fp_length`` on the device;
* otherwise (CPU, sink+window ring, sliding window, shapes the kernel does not take): PyTorch SDPA over the whole
  buffer with the cache's boolean mask (the reference the kernel is tested against).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .caches import kernel_hook
from .caches.static import StaticChunkBudgetCache, StaticLayer
from .kernels import runtime

NAME = "sparsekv_static"
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks")


def _prefill_mask(length: int, sliding_window: int | None, device) -> torch.Tensor | None:
    if sliding_window is None or sliding_window >= length:
        return None  # plain causal: SDPA's is_causal
    i = torch.arange(length, device=device)
    return ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window))[None, None]


def _kernel_ok(query: torch.Tensor, n_kv_heads: int) -> bool:
    from .attention import _kernel_shape_ok

    return runtime.enabled(query.device) and _kernel_shape_ok(query, n_kv_heads)


def static_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """query ``[1, Hq, L, D]``; key/value as the static cache's ``update`` returned -> ``([1, L, Hq, D], None)``."""
    layer = kernel_hook.take(getattr(module, "layer_idx", -1), key)
    if not isinstance(layer, StaticLayer):
        raise RuntimeError(
            f"attn_implementation '{NAME}' runs on the static caches of hf_sparsekv.caches.static only (it is set by "
            "the CUDA-graph path of generate() for the duration of a call)"
        )
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"attention option {name!r} is not supported on the static cache path")
    if dropout:
        raise NotImplementedError("attention dropout is not supported on the static cache path")
    cache = layer.owner
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    sliding = kwargs.get("sliding_window")
    if cache.prefilling:
        mask = _prefill_mask(query.shape[-2], sliding, query.device)
        out = sdpa_attention_forward(module, query, key, value, mask, scaling=scale, is_causal=mask is None)
        if isinstance(cache, StaticChunkBudgetCache) and cache.needs_selection():
            cache.select(layer, query, key, value, scale)
        return out
    if cache.contiguous and sliding is None and _kernel_ok(query, key.shape[1]):
        from .kernels.chunk_attention import chunk_decode_attention

        return chunk_decode_attention(query, key, value, scale, length=cache.fp_length), None
    return sdpa_attention_forward(module, query, key, value, cache.step_mask(sliding), scaling=scale, is_causal=False)


def register() -> None:
    AttentionInterface.register(NAME, static_attention)
