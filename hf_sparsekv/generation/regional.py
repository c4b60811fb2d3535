"""Regional light compilation: a step's decoder layers run one traced layer, traced once for every layer alike.

The light compile stage (:func:`~.graph_steps.light_step_backend`) spends its time in dynamo's bytecode tracing,
which grows with the model's depth and with the number of steps traced (a drafting configuration traces a dozen). Here
a step's own code (embedding, rotary tables, final norm, head, sampling) runs uncompiled, and each decoder layer's
forward goes through one compiled function, :func:`_layer_forward`, that dynamo traces once per kind of layer and
input shape: the layer's parameters and its cache buffers are inputs of the trace, not constants, so the trace of
layer 0 serves layer 1 through N - 1 (dynamo checks that with its guards, and traces again where a layer differs).
The captured CUDA graph then holds the same kernels as a light-compiled whole step, less one fusion across layers (a
residual add and the next layer's norm).

What keeps a layer's trace free of its index: transformers' attention passes ``self.layer_idx`` to the cache's
``update``, and the static caches pick the layer's buffers by that index (a Python int, a constant of the trace).
Inside :func:`_layer_forward` the layer sees :class:`LayerCache` instead, which holds its cache layer already and
ignores the index. The layer's ``forward`` is replaced by :func:`_routed_forward` only while one of the engine's steps
runs on this thread (:func:`regional_layers`, inside the step's warm-up and capture; a captured step's replays run
no Python), and for any other call (another thread, a prefill) it is the layer's own forward.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

from ..caches.static import LAST_WRITTEN, PreallocatedCache

REGIONAL_ENV = "HF_SPARSEKV_REGIONAL"  # "0": light compilation traces each step whole


class LayerCache:
    """What a decoder layer traced by :func:`_layer_forward` sees as ``past_key_values``: one layer of a static cache
    (:class:`~hf_sparsekv.caches.static.StaticLayer`) and the same layer of the cache's companion if it has one (a
    self-drafting step writes both); ``update`` writes there whatever layer index it is given."""

    is_compileable = True

    def __init__(self, cache: PreallocatedCache, index: int):
        self.layer = cache.layers[index]
        self.companion = None if cache.companion is None else cache.companion.layers[index]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = self.layer.owner.write(self.layer, key_states, value_states, self.companion)
        LAST_WRITTEN.layer = self.layer
        return keys, values

    def __getattr__(self, name: str):  # anything else a layer asks of its cache (get_seq_length...): the owner's
        if name in ("layer", "companion"):  # (not set yet: no recursion)
            raise AttributeError(name)
        return getattr(self.layer.owner, name)


def _layer_forward(layer, cache_layer: LayerCache, keyword: str, args: tuple, kwargs: dict):
    return type(layer).forward(layer, *args, **kwargs, **{keyword: cache_layer})


_compiled: dict = {}  # backend -> _layer_forward compiled under it (one per process: dynamo keeps the traces)
_active = threading.local()  # .layers: ids of the layers routed on this thread while regional_layers runs (None: none)


def compiled_layer_forward(backend):
    """:func:`_layer_forward` compiled under ``backend`` (static shapes where they do not vary)."""
    if backend not in _compiled:
        _compiled[backend] = torch.compile(_layer_forward, backend=backend, dynamic=None)
    return _compiled[backend]


def regional_setting() -> bool:
    """``HF_SPARSEKV_REGIONAL``: ``"1"`` or unset: light compilation traces one decoder layer for all (where a model
    allows: :func:`decoder_layers`); ``"0"``: it traces each step whole."""
    value = os.environ.get(REGIONAL_ENV, "1") or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{REGIONAL_ENV} must be '0' or '1', got {value!r}")
    return value == "1"


def decoder_layers(model) -> list | None:
    """``model``'s decoder layers in order, where each is a module of one class whose ``self_attn`` has a
    ``layer_idx`` equal to its place, none with a forward of its own (an instance attribute, as accelerate's hooks
    of a ``device_map`` model set); None where the model has no such list."""
    found = None
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and (found is None or len(module) > len(found)):
            found = module
    if found is None or len({type(m) for m in found}) != 1:
        return None
    layers = list(found)
    for index, layer in enumerate(layers):
        attention = getattr(layer, "self_attn", None)
        if getattr(attention, "layer_idx", None) != index or "forward" in vars(layer):
            return None
    return layers


def _routed_forward(layer, index: int, backend, original):
    def forward(*args, **kwargs):
        keyword = "cache" if "cache" in kwargs else "past_key_values"  # (transformers' name from 5.2x on; before)
        cache = kwargs.get(keyword)
        active = getattr(_active, "layers", None)
        if (active is None or id(layer) not in active or not isinstance(cache, PreallocatedCache)
                or cache.prefilling):
            return original(*args, **kwargs)
        del kwargs[keyword]
        return compiled_layer_forward(backend)(layer, LayerCache(cache, index), keyword, args, kwargs)

    return forward


@contextlib.contextmanager
def regional_layers(models, backend):
    """Inside the block, on this thread, the decoder layers of ``models`` (each a list from :func:`decoder_layers`)
    run through :func:`_layer_forward` compiled under ``backend`` when called on a static cache's step."""
    installed, previous = [], getattr(_active, "layers", None)
    _active.layers = (previous or set()) | {id(layer) for found in models for layer in found}
    try:
        for found in models:
            for index, layer in enumerate(found):
                if "forward" not in vars(layer):
                    layer.forward = _routed_forward(layer, index, backend, layer.forward)
                    installed.append(layer)
        yield
    finally:
        for layer in installed:
            del layer.forward
        _active.layers = previous
