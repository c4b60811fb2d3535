"""Hand-over of prompt queries from the attention function to a cache layer that must score its prefix.

A cache's ``update`` cannot see the queries. When a layer needs them it registers itself here; the ``"sparsekv"``
attention function, called right after ``update`` for the same layer, takes the registration and calls
``layer.select(query, scaling)``.
"""

from __future__ import annotations

import contextvars

_expecting: contextvars.ContextVar[tuple[int, object] | None] = contextvars.ContextVar("_expecting", default=None)


def expect_scores(layer_idx: int, layer) -> None:
    _expecting.set((layer_idx, layer))


def take(layer_idx: int, key):
    """The layer waiting for the queries of ``layer_idx`` whose prefill keys are ``key`` (the very tensor its
    ``update`` returned), if any; cleared once taken. A stale registration (another model, another cache) never
    matches."""
    entry = _expecting.get()
    if entry is None or entry[0] != layer_idx or entry[1].keys is not key:
        return None
    _expecting.set(None)
    return entry[1]
