"""Hand-over of prompt queries from the attention function to a cache layer that must score its prefix.

A cache's ``update`` cannot see the queries. When a layer needs them it registers itself here; the ``"sparsekv"``
attention function, called right after ``update`` for the same layer, takes the registration and calls
``layer.select(query, scaling)``.
"""

from __future__ import annotations

import contextvars

_expecting: contextvars.ContextVar[tuple[int, object, object] | None] = contextvars.ContextVar("_expecting", default=None)


def expect_scores(layer_idx: int, layer) -> None:
    """``layer`` (whose ``update`` just returned ``layer.keys``) waits for the queries of that very call."""
    _expecting.set((layer_idx, layer, layer.keys))


def take(layer_idx: int, key):
    """The layer waiting for the queries of ``layer_idx`` whose prefill keys are ``key`` (the very tensor its
    ``update`` returned), if any; cleared once taken. A stale registration (another model, another cache) never
    matches."""
    entry = _expecting.get()
    if entry is None or entry[0] != layer_idx or entry[2] is not key:
        return None
    _expecting.set(None)
    return entry[1]


_observer: contextvars.ContextVar[object | None] = contextvars.ContextVar("_observer", default=None)


def observe(fn) -> contextvars.Token:
    """Until :func:`stop_observing` with the returned token, ``fn(module, query, key, scaling)`` is called after every
    attention call that hands its queries over here (:func:`hand_over`), whichever cache the layer belongs to: how a
    self-drafter takes the verifier's prompt queries for a compressed cache filled outside the attention call."""
    return _observer.set(fn)


def stop_observing(token: contextvars.Token) -> None:
    _observer.reset(token)


def hand_over(module, query, key, scaling: float, layer=None) -> None:
    """From an attention function, after it has run on ``query [B, Hq, n, D]`` and ``key`` (what the cache's ``update``
    returned): a layer waiting for these queries (``layer``, if the caller already took it, else :func:`take`)
    selects, then the observer, if any, sees them."""
    layer = layer if layer is not None else take(getattr(module, "layer_idx", -1), key)
    if layer is not None:
        layer.select(query, scaling)
    observer = _observer.get()
    if observer is not None:
        observer(module, query, key, scaling)
