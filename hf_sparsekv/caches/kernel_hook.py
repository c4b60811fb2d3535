"""Hand-over of a cache layer to the attention function that runs right after its ``update``.

transformers calls ``cache.update(...)`` and then the attention function with what ``update`` returned; the
attention function never sees the cache. A layer of ours registers itself here together with the key tensor its
``update`` returned; the ``"sparsekv"`` attention takes it back for the same ``layer_idx`` and key tensor and reads
the layer's own storage (kept tokens, packed codes) to pick a kernel. A stale registration (another layer, another
model, another cache) never matches, because the key tensor must be the very object ``update`` returned.
"""

from __future__ import annotations

import contextvars

_offered: contextvars.ContextVar[tuple[int, object, object] | None] = contextvars.ContextVar("_offered", default=None)


def offer(layer_idx: int, layer, key) -> None:
    _offered.set((layer_idx, layer, key))


def take(layer_idx: int, key):
    """The layer whose ``update`` for ``layer_idx`` returned ``key``, if any; cleared once taken."""
    entry = _offered.get()
    if entry is None or entry[0] != layer_idx or entry[2] is not key:
        return None
    _offered.set(None)
    return entry[1]
