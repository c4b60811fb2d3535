"""What a model asks of its attention, found by running it once, and whether the static engine serves exactly that.

The engine's attention (:mod:`hf_sparsekv.static_attention`) builds no mask from transformers: what a query sees comes
from the cache's positions and a few per-layer rules. A model that puts something else into its masks (chunked
attention, a bidirectional block, a bias) or passes an option the engine does not apply would run with different
attention, silently. So before a model first runs on the engine, :func:`served_layers` runs one forward of two tokens
with a probe registered as both its attention and its mask function (no cache, nothing written anywhere):

* the **mask probe** receives every mask the model builds through ``transformers.masking_utils`` (its
  ``mask_function``), evaluates it on a grid of absolute positions and classifies it: plain causal, causal within a
  sliding window of W positions (key position > query position - W), causal within chunks of C positions (key and query
  in the same chunk: Llama 4's chunked attention), or unknown;
* the **attention probe** receives each layer's query, mask and options, and records them.

A layer is served when its mask is one of the three kinds above (a window the engine then applies itself, and where
the attention also receives a ``sliding_window`` option, the same one), its keys/values have the shape the config
gives (the engine's caches are sized from it), and every option its attention receives is one the engine applies:
``scaling``, ``sliding_window``, ``softcap`` (Gemma 2's logit soft-capping), ``s_aux`` / ``sinks`` (GPT-OSS's attention
sinks), ``dropout`` of 0, and arguments that do not change attention (positions, flags that are off). Any other mask,
a mask the model built itself, any other option, a layer that runs attention twice or none, or a stock cache whose
layers hold more than keys and values (linear attention, SSM states) is refused with :class:`AttentionNotServed`,
naming the layer and what it asked for. So a model the check has not seen before is refused rather than guessed.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

PROBE = "sparsekv_probe"
GRID_QUERIES = 96  # query positions sampled per mask (every chunk or window boundary the grid reaches, and others)
# Positions evaluated: twice the longest window or chunk size the config names (any attribute with "window" or "chunk"
# in its name), and at least GRID_MIN (or the model's max_position_embeddings, if shorter).
GRID_MIN = 16384

# Options an attention function may receive that change nothing the engine computes (or that it applies itself).
_NEUTRAL_OPTIONS = {"scaling", "sliding_window", "position_ids", "cache_position", "position_embeddings", "layer_idx",
                    "use_cache", "output_attentions", "is_causal", "dropout", "softcap", "s_aux", "sinks", "cache",
                    "past_key_values", "past_key_value", "head_mask", "attention_type", "num_items_in_batch"}


class AttentionNotServed(NotImplementedError):
    """The model asks for attention the static engine does not compute exactly (names the layer and the option)."""


@dataclass(frozen=True)
class LayerAttention:
    """What decoder layer ``layer_idx`` asks of attention, as the engine applies it: causal, within ``window``
    positions (None: unbounded) and within chunks of ``chunk`` positions (None: none); ``softcap`` of the logits;
    ``sinks``: per-head sink logits in the softmax's denominator."""

    layer_idx: int
    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None
    sinks: bool = False


class _Probe(threading.local):
    masks: dict | None = None  # id(marker) -> (marker, kind): kind ("causal"|"window"|"chunk", size) or a reason
    layers: dict | None = None  # layer_idx -> LayerAttention, or a reason string
    config = None  # the text config
    shape = (None, None)  # (key/value heads, head_dim) the engine's caches will have
    device = None  # the model's (its inputs' and masks' device)


_probe = _Probe()
_known: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _grid(config) -> tuple[torch.Tensor, torch.Tensor]:
    """Query positions ``[Q, 1]`` and key positions ``[1, N]`` to evaluate a mask function on."""
    sizes = [v for k, v in vars(config).items() if isinstance(v, int) and not isinstance(v, bool) and v > 0
             and ("window" in k or "chunk" in k)]
    longest = getattr(config, "max_position_embeddings", None) or GRID_MIN
    n = max(min(longest, GRID_MIN), 2 * max(sizes, default=0) + 2, 64)
    picks = {0, 1, n - 1, n - 2}
    for size in sizes:
        for m in range(size, n, size):
            picks.update(p for p in (m - 1, m, m + 1) if 0 <= p < n)
            if len(picks) > GRID_QUERIES:
                break
    generator = torch.Generator().manual_seed(0)
    picks.update(torch.randint(0, n, (GRID_QUERIES,), generator=generator).tolist())
    queries = torch.tensor(sorted(picks))[:, None]
    return queries, torch.arange(n)[None, :]


def classify_mask(mask_function, config, device="cpu") -> tuple:
    """``("causal", None)``, ``("window", W)``, ``("chunk", C)`` for the pattern ``mask_function(b, h, q, kv)`` gives
    at absolute positions (row 0, head 0; evaluated on ``device``, where its tensors are), or ``("unknown",
    reason)``."""
    queries, keys = (t.to(device) for t in _grid(config))
    zero = torch.zeros((), dtype=torch.long, device=device)
    try:
        seen = torch.as_tensor(mask_function(zero, zero, queries, keys), device=device)
        seen = seen.expand(queries.shape[0], keys.shape[1])
    except Exception as error:  # a mask function that is not index-based: not one we know
        return "unknown", f"a mask function that could not be evaluated ({type(error).__name__}: {error})"
    seen = seen.bool()
    q = queries[:, 0]
    if (seen & (keys > queries)).any():
        return "unknown", "a mask that lets a query see later positions (not causal)"
    # visible keys of each query must be one run lo..q
    lo = torch.where(seen, keys.expand_as(seen), keys.shape[1]).min(1).values
    if not bool((seen.sum(1) == (q - lo + 1).clamp(min=0)).all()) or bool((lo > q).any()):
        return "unknown", "a mask whose visible positions are not one run ending at the query"
    if bool((lo == 0).all()):
        return "causal", None
    far = int(q[-1] - lo[-1] + 1)  # a window's width
    if bool((lo == (q - far + 1).clamp(min=0)).all()):
        return "window", far
    starts = lo[lo > 0]
    chunk = int(starts.min())
    if bool((lo == q - q % chunk).all()):
        return "chunk", chunk
    return "unknown", "a mask that is neither causal, a sliding window nor chunked"


def _probe_mask(*args, **kwargs):
    if args or "mask_function" not in kwargs:
        kind = ("unknown", "a mask built without a mask_function")
    else:
        kind = classify_mask(kwargs["mask_function"], _probe.config, _probe.device)
    shape = [kwargs.get(k) for k in ("batch_size", "q_length", "kv_length")]
    # a mask of the shape the model expects (some check it), all True
    marker = torch.ones(*((shape[0], 1, shape[1], shape[2]) if all(isinstance(n, int) for n in shape) else (1,)),
                        dtype=torch.bool)
    _probe.masks[id(marker)] = (marker, kind)
    return marker


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    index = getattr(module, "layer_idx", None)
    entry = _probe.masks.get(id(attention_mask)) if attention_mask is not None else None
    kv_heads, head_dim = _probe.shape
    if not isinstance(index, int):
        record = "an attention module without a layer_idx"
    elif entry is None or entry[0] is not attention_mask:
        record = "a mask the model builds itself (or none), not through transformers' mask functions"
    elif tuple(key.shape[1:2]) + tuple(key.shape[3:]) != (kv_heads, head_dim) or value.shape != key.shape:
        record = (f"keys/values of {key.shape[1]} heads of {key.shape[-1]} and {value.shape[-1]} channels where its "
                  f"config gives {kv_heads} of {head_dim}")
    else:
        record = _layer_record(index, entry[1], dropout, kwargs)
    if isinstance(index, int):
        _probe.layers[index] = record if index not in _probe.layers else "attention run more than once a layer"
    batch, heads, length, _ = query.shape
    return value.new_zeros(batch, length, heads, value.shape[-1]), None


def _layer_record(index: int, kind: tuple, dropout, kwargs: dict):
    name, size = kind
    if name == "unknown":
        return size
    if dropout:
        return "attention dropout"
    for option, value in kwargs.items():
        if option not in _NEUTRAL_OPTIONS and value is not None and value is not False:
            return f"the attention option {option!r}"
    if kwargs.get("is_causal") is False:
        return "the attention option 'is_causal=False'"
    sliding = kwargs.get("sliding_window")
    window = size if name == "window" else None
    if sliding is not None and int(sliding) != window:  # (a window in the mask alone: the engine applies it)
        return (f"a sliding-window mask of {window} positions with the sliding_window option {sliding}"
                if window is not None else f"the sliding_window option {sliding} on a mask without a window")
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    return LayerAttention(index, window, size if name == "chunk" else None,
                          None if softcap is None else float(softcap), sinks is not None)


def _configs(model) -> list:
    """Every config of ``model`` whose ``_attn_implementation`` a forward may read (sub-models', sub-configs')."""
    found, stack = {}, [m.config for m in model.modules() if getattr(m, "config", None) is not None
                        and hasattr(m.config, "_attn_implementation")]
    while stack:
        config = stack.pop()
        if id(config) not in found:
            found[id(config)] = config
            stack.extend(c for c in (getattr(config, k, None) for k in getattr(config, "sub_configs", {}))
                         if c is not None)
    return list(found.values())


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def probe(model) -> dict | str:
    """Run ``model`` once on two tokens with the probe as its attention and mask function -> ``{layer_idx:
    LayerAttention or the reason it is not served}``, or the reason no layer is."""
    from .common import _attention_shape

    configs = _configs(model)
    before = [c._attn_implementation for c in configs]
    device = next(model.parameters()).device
    try:
        shape = _attention_shape(model)[1:]
    except (AttributeError, TypeError) as error:
        return f"no attention shape in its config ({error})"
    _probe.masks, _probe.layers, _probe.config, _probe.shape = {}, {}, _text_config(model), shape
    _probe.device = device
    try:
        for c in configs:
            c._attn_implementation_internal = PROBE
        with torch.no_grad():  # (forward itself: hooks a caller put on the model see no probe)
            model.forward(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device), use_cache=False)
        return dict(_probe.layers)
    except Exception as error:  # noqa: BLE001 (a forward that needs more than attention's output shape)
        return f"a forward that fails under the attention probe ({type(error).__name__}: {error})"
    finally:
        for c, value in zip(configs, before):
            c._attn_implementation_internal = value
        _probe.masks, _probe.layers, _probe.config = None, None, None


def served_layers(model) -> tuple[LayerAttention, ...]:
    """Each decoder layer's attention as the engine applies it (layer order), probed on ``model``'s first call and
    kept; raises :class:`AttentionNotServed` naming the first layer whose attention the engine does not compute
    exactly. The caller holds ``model``'s lock exclusively (the probe switches its attention implementation)."""
    with _lock:
        known = _known.get(model)
    if known is None:
        found = _state_beyond_keys(model) or probe(model)
        layers = _text_config(model).num_hidden_layers
        if isinstance(found, str):
            known = found
        elif sorted(found) != list(range(layers)):
            missing = sorted(set(range(layers)) - set(found))
            known = f"layers without attention through transformers' attention interface ({missing} of {layers})"
        else:
            known = tuple(found[i] for i in range(layers))
        with _lock:
            _known[model] = known
    if isinstance(known, str):
        _refuse(model, known)
    for index, layer in enumerate(known):
        if not isinstance(layer, LayerAttention):
            _refuse(model, f"layer {index}: {layer}")
    return known


def _refuse(model, what: str):
    raise AttentionNotServed(f"the static engine does not compute the attention of {type(model).__name__} exactly "
                             f"({what}); generate() without the engine's options serves it")


def _state_beyond_keys(model) -> str | None:
    """Why stock's cache for ``model`` holds more than each layer's keys and values (linear attention, convolution or
    SSM states), or None."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    try:
        cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    except Exception as error:  # noqa: BLE001 (a config stock's own cache cannot be made for)
        return f"a config stock's DynamicCache cannot be made for ({type(error).__name__})"
    kinds = {type(layer).__name__ for layer in cache.layers
             if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)}
    return f"cache layers other than keys and values ({', '.join(sorted(kinds))})" if kinds else None


def forget(model) -> None:
    """Drop what :func:`served_layers` found for ``model`` (after changing its config, say)."""
    with _lock:
        _known.pop(model, None)


def register() -> None:
    AttentionInterface.register(PROBE, _probe_attention)
    AttentionMaskInterface.register(PROBE, _probe_mask)
