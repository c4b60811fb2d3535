"""The ``"sparsekv_static"`` attention implementation: attention over the preallocated caches of
:mod:`hf_sparsekv.caches.static`, with nothing read on the host, so that a model forward can be captured as a CUDA
graph.

No mask function is registered under this name, so transformers builds no mask (``create_causal_mask`` returns
None); what a query sees comes from the cache (``slot_positions``, ``fp_length``), whose layer ``update`` leaves
in :data:`hf_sparsekv.caches.static.LAST_WRITTEN` (per thread). Routing (``query [B, Hq, L, D]``, B rows of
independent sequences):

* **prefill** (never captured, eager or compiled; the cache is empty): causal attention over the prompt's own keys
  (PyTorch SDPA; with a sliding window, an explicit mask), then the cache stores what its layout keeps (a chunk-budget
  cache selects its chunks from the prompt's queries here), and so does its ``companion`` if it has one (self-drafting:
  the model's own compressed cache, built from the same prefill);
* **decode / verify step** on a cache whose slots are in position order (full, chunk budget), CUDA, no sliding
  window, a shape the kernel takes: the Triton split-KV kernel reading each row's length from ``fp_length`` on the device,
  called as the custom operator ``hf_sparsekv::static_decode`` so that ``torch.compile`` keeps the whole step in
  one graph (a tree block on the full cache: the same kernel with the block's ancestor bits);
* decode / verify step on the sink+window ring (CUDA, no sliding window, a shape the kernel takes): the same kernel
  reading the whole ring and deciding what each query sees from the positions the slots hold
  (``hf_sparsekv::static_window_decode``; a drafter's tree block, written after the ring, by its ancestor bits);
* decode / verify step on the quantized store (self-speculation): the same kernel reading the packed codes in the
  cache's current view and the full-precision buffer, both lengths on the device (``hf_sparsekv::static_quant_decode``);
* otherwise (CPU, sliding window, shapes the kernel does not take): PyTorch SDPA over the whole
  buffer (for the quantized store: every code slot dequantized, then the buffer) with a boolean mask computed from
  device tensors (the reference the kernels are tested against).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .attention import _kernel_shape_ok, quant_kernel_ok
from .caches.static import (
    LAST_WRITTEN, StaticLayer, StaticQuantCache, StaticSinkWindowCache, within_window_and_chunk,
)
from .kernels.chunk_attention import MAX_QUERIES

NAME = "sparsekv_static"
_NO_WINDOW = 1 << 40  # the kernel's window where a layer has chunks but no sliding window


def _prefill_mask(length: int, sliding_window: int | None, device, start: int = 0, chunk: int | None = None,
                  fed: torch.Tensor | None = None) -> torch.Tensor | None:
    """The mask ``[1, 1, length, start + length]`` of a prefill whose queries are at ``start..start+length-1`` over
    the keys of positions ``0..start+length-1`` (``fed``, int64 ``[length]`` increasing: the queries and keys are at
    these positions instead); None for plain causal attention over the tokens fed. ``chunk``: a query sees only keys
    of its own chunk of ``chunk`` positions (chunked attention)."""
    if fed is not None:
        if sliding_window is None and chunk is None:
            return None  # causal among the tokens fed, which are in position order
        q, k = fed.to(device)[:, None], fed.to(device)[None, :]
    elif start == 0 and (sliding_window is None or sliding_window >= length) and (chunk is None or chunk >= length):
        return None  # plain causal: SDPA's is_causal
    else:
        q = torch.arange(start, start + length, device=device)[:, None]
        k = torch.arange(start + length, device=device)[None, :]
    return within_window_and_chunk(k <= q, k, q, sliding_window, chunk)[None, None]


def _reference_attention(module, query, key, value, mask, scale: float, softcap: float | None = None,
                         sinks: torch.Tensor | None = None):
    """Attention over ``key/value [B, Hkv, S, D]`` where ``mask [B or 1, 1, L, S]`` (bool; None: causal, the queries
    being the last L positions) -> ``([B, L, Hq, D], None)``: PyTorch SDPA, or with ``softcap`` (logits become
    ``softcap * tanh(logits / softcap)``, Gemma 2) or ``sinks [Hq]`` (one more logit per head in the softmax's
    denominator, attending to nothing: GPT-OSS) the same in plain operations, the softmax in float32."""
    if softcap is None and sinks is None:
        return sdpa_attention_forward(module, query, key, value, mask, scaling=scale, is_causal=mask is None)
    n, s = query.shape[-2], key.shape[-2]
    if mask is None:
        mask = torch.ones(n, s, dtype=torch.bool, device=query.device).tril(s - n)[None, None]
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    logits = torch.matmul(query, key.transpose(-1, -2)) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float().masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(logits.device, torch.float32).reshape(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
        weights = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
    else:
        weights = torch.softmax(logits, -1)
    out = torch.matmul(weights.to(value.dtype), value)
    return out.transpose(1, 2).contiguous(), None


def _channels_contiguous(query: torch.Tensor) -> torch.Tensor:
    """``query [B, Hq, L, D]`` as the kernel reads it: any head and position strides, channels contiguous. A
    verification's queries arrive as a transposed view of ``[B, L, Hq, D]``; a copy of it to contiguous memory was
    a kernel a layer (bundled pair, H200: 2 µs of a 0.45 ms verify step, 12 times)."""
    return query if query.stride(-1) == 1 else query.contiguous()


@torch.library.custom_op("hf_sparsekv::static_decode", mutates_args=())
def static_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, length: torch.Tensor,
                  scaling: float, tree: torch.Tensor | None = None,
                  tickets: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton decode kernel over preallocated buffers: ``query [B, Hq, L, D]``, ``key/value [B, Hkv, S, D]`` of
    which the first ``length[b]`` (int32 ``[B]``, on the device) slots of row b are read -> ``[B, L, Hq, D]``
    contiguous. ``tree`` (int64 ``[L]``, or ``[B, L]`` one per row): the last L slots read are a tree block, each query
    seeing its ancestors. ``tickets``: the cache's merge counters (zero before and after;
    :func:`~hf_sparsekv.kernels.decode_core.launch_decode`)."""
    from .kernels.chunk_attention import chunk_decode_attention

    return chunk_decode_attention(_channels_contiguous(query), key, value, scaling, length=length, tree=tree,
                                  tickets=tickets)


@static_decode.register_fake
def _static_decode_shape(query, key, value, length, scaling, tree=None, tickets=None):
    batch, heads, n, dim = query.shape
    return query.new_empty(batch, n, heads, dim)


@torch.library.custom_op("hf_sparsekv::static_rope_decode", mutates_args=("key", "value"))
def static_rope_decode(query: torch.Tensor, key_new: torch.Tensor, value_new: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: torch.Tensor,
                       slots: torch.Tensor, length: torch.Tensor, scaling: float, tree: torch.Tensor | None = None,
                       tickets: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`static_decode` with the step's rotary embedding and cache write in the same launch (what a compiled
    step calls in their place, :mod:`hf_sparsekv.generation.fused_rotary`): ``query`` and ``key_new`` before the
    rotary embedding, ``value_new``, ``cos/sin`` the position embeddings; ``key/value[rows, :, slots]`` are written
    (:mod:`hf_sparsekv.kernels.rope_attention`). Returns ``[B, L, Hq, D]`` contiguous."""
    from .kernels.rope_attention import rope_decode_attention

    return rope_decode_attention(query, key_new, value_new, cos, sin, key, value, rows, slots, scaling, length,
                                 tree, tickets)


@static_rope_decode.register_fake
def _static_rope_decode_shape(query, *args, **kwargs):
    batch, heads, n, dim = query.shape
    return query.new_empty(batch, n, heads, dim)


@torch.library.custom_op("hf_sparsekv::static_rope_window_decode", mutates_args=("key", "value"))
def static_rope_window_decode(query: torch.Tensor, key_new: torch.Tensor, value_new: torch.Tensor, cos: torch.Tensor,
                              sin: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: torch.Tensor,
                              slots: torch.Tensor, length: torch.Tensor, slot_positions: torch.Tensor,
                              query_positions: torch.Tensor, sink: int, window: int, scaling: float,
                              tickets: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
    """:func:`static_window_decode` (no tree) with the step's rotary embedding and ring write in the same launch, as
    :func:`static_rope_decode` is :func:`static_decode`'s."""
    from .kernels.rope_attention import rope_decode_attention

    return rope_decode_attention(query, key_new, value_new, cos, sin, key, value, rows, slots, scaling, length,
                                 tickets=tickets, ring=(slot_positions, query_positions.contiguous(), sink, window,
                                                        chunk))


@static_rope_window_decode.register_fake
def _static_rope_window_decode_shape(query, *args, **kwargs):
    batch, heads, n, dim = query.shape
    return query.new_empty(batch, n, heads, dim)


@torch.library.custom_op("hf_sparsekv::static_window_decode", mutates_args=())
def static_window_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, length: torch.Tensor,
                         slot_positions: torch.Tensor, query_positions: torch.Tensor, sink: int, window: int,
                         scaling: float, tree: torch.Tensor | None = None,
                         tickets: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
    """The Triton decode kernel over a sink+window ring: ``query [B, Hq, L, D]`` at ``query_positions [B, L]``,
    ``key/value [B, Hkv, S, D]`` holding ``slot_positions [B, S]`` (see :mod:`hf_sparsekv.kernels.window_attention`)
    -> ``[B, L, Hq, D]`` contiguous. ``tree`` (int64 ``[B, L]``): the last L slots read are the queries' tree block
    (a drafter's tree after the ring), seen by the ancestor bits. ``tickets``: as :func:`static_decode`'s. Also a
    cache in position order whose layer has a sliding window or chunks (``sink`` 0, ``chunk``: chunked attention)."""
    from .kernels.window_attention import window_decode_attention

    return window_decode_attention(_channels_contiguous(query), key, value, scaling, length, slot_positions,
                                   query_positions.contiguous(), sink, window, tree, tickets, chunk)


@static_window_decode.register_fake
def _static_window_decode_shape(query, *args):
    batch, heads, n, dim = query.shape
    return query.new_empty(batch, n, heads, dim)


@torch.library.custom_op("hf_sparsekv::static_quant_decode", mutates_args=())
def static_quant_decode(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_upper: torch.Tensor, key_lower: torch.Tensor,
    key_scale: torch.Tensor, key_zero: torch.Tensor, value_upper: torch.Tensor, value_lower: torch.Tensor,
    value_scale: torch.Tensor, value_zero: torch.Tensor, fp_length: torch.Tensor, quant_length: torch.Tensor,
    group_size: int, int8: bool, scaling: float, tickets: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton decode kernel over a :class:`StaticQuantCache` layer: per row b, the first ``quant_length[b]`` code
    slots (in the INT8 or INT4 view) then the first ``fp_length[b]`` buffer slots -> ``[B, L, Hq, D]`` contiguous.
    ``tickets``: as :func:`static_decode`'s."""
    from .kernels.decode_core import launch_decode
    from .kernels.quant_reference import QuantizedTensor

    quant = (QuantizedTensor(key_upper, key_lower, key_scale, key_zero),
             QuantizedTensor(value_upper, value_lower, value_scale, value_zero))
    return launch_decode(_channels_contiguous(query), scaling, key, value, quant=quant, group_size=group_size,
                         int8=int8, fp_length=fp_length, quant_length=quant_length, tickets=tickets)


@static_quant_decode.register_fake
def _static_quant_decode_shape(query, *args):
    batch, heads, n, dim = query.shape
    return query.new_empty(batch, n, heads, dim)


def _quant_attention(module, query, layer, cache: StaticQuantCache, scale: float, rules: tuple):
    sliding, chunk, softcap, sinks = rules
    if (cache.kernels and all(r is None for r in rules) and _kernel_shape_ok(query, layer.keys.shape[1])
            and quant_kernel_ok(cache.group_size, layer.keys.dtype)):
        qk, qv, device = layer.qkeys, layer.qvalues, query.device
        out = static_quant_decode(query, layer.keys, layer.values, qk.upper, qk.lower, qk.scale, qk.zero, qv.upper,
                                  qv.lower, qv.scale, qv.zero, cache.local("fp_length", device),
                                  cache.local("quant_length", device), cache.group_size, cache.view == "int8", scale,
                                  cache.tickets(device))
        return out, None
    keys, values, mask = cache.reference_attention_inputs(layer, sliding, chunk)
    return _reference_attention(module, query, keys, values, mask, scale, softcap, sinks)


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
    """query ``[B, Hq, L, D]`` (a prefill: ``[1, Hq, P, D]``); key/value as the static cache's ``update`` returned ->
    ``([B, L, Hq, D], None)``."""
    layer = LAST_WRITTEN.layer
    LAST_WRITTEN.layer = None
    # (the index check stays out of traced code: a traced layer serves every layer alike, generation.regional)
    if not isinstance(layer, StaticLayer) or (not torch.compiler.is_compiling()
                                              and layer.layer_idx != getattr(module, "layer_idx", -1)):
        raise RuntimeError(
            f"attn_implementation '{NAME}' runs on the static caches of hf_sparsekv.caches.static only (it is set by "
            "the CUDA-graph path of generate() for the duration of a call)"
        )
    if dropout:
        raise NotImplementedError("attention dropout is not supported on the static cache path")
    cache = layer.owner
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    sliding = layer.attention_window if layer.attention_window is not None else kwargs.get("sliding_window")
    chunk, softcap = layer.attention_chunk, kwargs.get("softcap")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if cache.prefilling:
        mask = _prefill_mask(query.shape[-2], sliding, query.device, cache.prefill_start, chunk, cache.prefill_fed)
        out = _reference_attention(module, query, key, value, mask, scale, softcap, sinks)
        if cache.prompt_queries is not None:
            cache.prompt_queries(layer.layer_idx, query, scale)
        for target in (cache, cache.companion):  # the companion: a self-drafting cache built from this prefill
            if target is not None and target.needs_selection():  # chunk layouts
                target.select(target.layers[layer.layer_idx], query, key, value, scale)
        return out
    if isinstance(cache, StaticQuantCache):
        return _quant_attention(module, query, layer, cache, scale, (sliding, chunk, softcap, sinks))
    device = query.device  # a layer of a model dispatched over several devices reads the cache's tensors there
    if cache.kernels and softcap is None and sinks is None and (sliding is not None or chunk is not None):
        if cache.contiguous and cache.tree is None and _kernel_shape_ok(query, key.shape[1]):  # (by positions)
            window = _NO_WINDOW if sliding is None else sliding - 1  # (s > q - sliding: s >= q - window)
            return static_window_decode(query, key, value, cache.local("fp_length", device),
                                        cache.local("slot_positions", device), cache.local("positions", device), 0,
                                        window, scale, None, cache.tickets(device), chunk or 0), None
    elif cache.kernels and softcap is None and sinks is None:
        tree = None if cache.tree is None else cache.local("tree", device)
        if cache.contiguous and _kernel_shape_ok(query, key.shape[1], MAX_QUERIES, None):  # up to a tree block
            return static_decode(query, key, value, cache.local("fp_length", device), scale, tree,
                                 cache.tickets(device)), None
        if isinstance(cache, StaticSinkWindowCache) and _kernel_shape_ok(
                query, key.shape[1], *(() if tree is None else (MAX_QUERIES, None))):
            return static_window_decode(query, key, value, cache.local("fp_length", device),
                                        cache.local("slot_positions", device), cache.local("positions", device),
                                        cache.sink, cache.window, scale, tree, cache.tickets(device)), None
    return _reference_attention(module, query, key, value, cache.step_mask(sliding, device, chunk), scale, softcap,
                                sinks)


def register() -> None:
    AttentionInterface.register(NAME, static_attention)
