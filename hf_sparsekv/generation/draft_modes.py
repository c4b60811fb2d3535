"""What the engine is built for: ``draft_cache``/``kv_budget`` (a name or a cache instance), the drafter and a
prompt prefix checked and turned into the engine's mode (:class:`~.engine.EngineSpec`).

Every request maps to one mode or raises naming the option: ``"chunk"`` (BudgetDraft's chunk-budget cache, optionally
with a token window over generated tokens), ``"window"`` (sink + sliding window), ``"full"`` (the drafter keeps every
token), ``"int4"`` (self-speculation on the verifier's own quantized store, QuantSpec) and ``"int4-drafter"`` (a
separate drafter on its own quantized store, read in its INT4 view). A cache instance passed as ``draft_cache`` is
never written: its settings configure the engine's static cache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicSlidingWindowLayer

from ..caches import ChunkBudgetCache, HierarchicalQuantCache, SinkWindowCache
from ..caches.base import is_integer
from ..caches.quantized import DEFAULT_GROUP_SIZE
from .common import CHUNK_SIZE, DEFAULT_WINDOW_BUDGET, WINDOW_SINK, _text_config

DRAFT_CACHES = ("chunk", "window", "int4", "full")


def check_budget(kv_budget, draft_cache) -> None:
    """``kv_budget``: a positive integer (Python, NumPy or a 0-d integer tensor), at least one chunk for ``'chunk'``
    (the default), more than the sink tokens for ``'window'``; it applies to those two names only."""
    if kv_budget is None:
        return
    if isinstance(kv_budget, torch.Tensor) and not is_integer(kv_budget):
        raise ValueError(f"kv_budget must be a positive integer; a tensor must be a 0-d integer tensor, got one of "
                         f"shape {tuple(kv_budget.shape)} and dtype {kv_budget.dtype}")
    if not is_integer(kv_budget) or kv_budget < 1:
        raise ValueError(f"kv_budget must be a positive integer, got {kv_budget!r}")
    kv_budget = int(kv_budget)
    if draft_cache == "full" or isinstance(draft_cache, Cache):
        what = "draft_cache='full'" if draft_cache == "full" else "a draft_cache instance"
        raise ValueError(f"kv_budget does not apply to {what} (it sets the budget of 'chunk'/'window' only); drop it")
    if draft_cache == "int4":
        raise ValueError("kv_budget does not apply to draft_cache='int4' (the quantized cache keeps every token)")
    if draft_cache in (None, "chunk") and kv_budget < CHUNK_SIZE:
        raise ValueError(f"kv_budget must be >= the chunk size ({CHUNK_SIZE}) with draft_cache='chunk', got {kv_budget}")
    if draft_cache == "window" and kv_budget <= WINDOW_SINK:
        raise ValueError(f"kv_budget must exceed the {WINDOW_SINK} sink tokens with draft_cache='window', got {kv_budget}")


def _sliding(cache: DynamicCache) -> bool:
    return any(isinstance(layer, DynamicSlidingWindowLayer) for layer in cache.layers)


def draft_mode(model, drafter, draft_cache, kv_budget: int | None, gamma: int) -> tuple[str, int | None, tuple]:
    """``(mode, budget, layout)`` of the engine serving ``draft_cache`` (checked by :func:`check_budget`):
    ``budget`` the chunk/window budget (int4 modes: the group size G), ``layout`` the settings of a cache instance
    (chunk: ``(chunk_size, selection, generated_window)``, window: ``(sink, window)``; empty: the defaults)."""
    own = drafter is model
    if isinstance(draft_cache, Cache):
        if draft_cache.get_seq_length() != 0:
            raise ValueError("draft_cache: a cache instance must be empty (fresh or reset())")
        if isinstance(draft_cache, ChunkBudgetCache):
            layout = (draft_cache.chunk_size, draft_cache.selection, draft_cache.generated_window)
            return "chunk", draft_cache.budget, layout
        if isinstance(draft_cache, SinkWindowCache):
            return "window", draft_cache.sink + draft_cache.window, (draft_cache.sink, draft_cache.window)
        if isinstance(draft_cache, HierarchicalQuantCache):
            _check_group(draft_cache.group_size, gamma)
            return ("int4" if own else "int4-drafter"), draft_cache.group_size, ()
        if type(draft_cache) is DynamicCache and not own and not _sliding(draft_cache):
            return "full", None, ()  # a plain DynamicCache keeps every token: the drafter's full cache
        if own:
            raise NotImplementedError(
                "draft_cache: self-drafting (assistant_model is the model) needs a HierarchicalQuantCache, "
                f"ChunkBudgetCache or SinkWindowCache, got {type(draft_cache).__name__}")
        raise NotImplementedError(
            f"draft_cache: a {type(draft_cache).__name__} instance is not supported; pass a ChunkBudgetCache, "
            "SinkWindowCache, HierarchicalQuantCache or a plain DynamicCache() (the drafter's full cache), or one of "
            f"{DRAFT_CACHES}")
    kind = "chunk" if draft_cache is None else draft_cache
    if kind not in DRAFT_CACHES:
        raise ValueError(f"draft_cache must be one of {DRAFT_CACHES} or a Cache instance, got {draft_cache!r}")
    if kind == "int4":
        _check_group(DEFAULT_GROUP_SIZE, gamma)
        return ("int4" if own else "int4-drafter"), DEFAULT_GROUP_SIZE, ()
    if kind == "chunk":
        if kv_budget is None:
            raise ValueError("draft_cache='chunk' needs kv_budget")
        return "chunk", kv_budget, ()
    if kind == "window":
        return "window", DEFAULT_WINDOW_BUDGET if kv_budget is None else kv_budget, ()
    return "full", None, ()


def routed_draft_cache(drafter, max_length: int) -> str:
    """The drafter's cache in stock's assisted generation routed by the import (``assistant_model=drafter`` and no
    argument of ours): ``"full"``, as stock keeps it, while the sequence of ``max_length`` tokens fits the positions the
    drafter was trained on (its config's ``max_position_embeddings``); past them ``"window"`` (sink + the last
    :data:`~.common.DEFAULT_WINDOW_BUDGET` tokens): a drafter attending across distances it never saw drafts poorly
    (the bundled drafter, trained to 2,048 positions, had 0.53 of its first drafts accepted on a full cache at 16K,
    0.86 on the window, H100). The tokens are the verifier's either way."""
    trained = getattr(_text_config(drafter), "max_position_embeddings", None)
    return "window" if isinstance(trained, int) and max_length > trained else "full"


def _check_group(group_size: int, gamma: int) -> None:
    if gamma >= group_size:
        raise ValueError(f"num_assistant_tokens must be < group_size ({group_size}) with a quantized draft cache")


def check_prefix(past_key_values, mode: str, self_drafting: bool, prompt_length: int, padded: bool) -> int:
    """Prompt caching: ``past_key_values`` must be a ``DynamicCache`` holding a proper prefix of the prompt (no
    sliding-window layers); its tokens are copied into the verifier's static row and only the rest of the prompt
    is prefilled. Returns the prefix length; anything the engine cannot take raises naming ``past_key_values``."""
    if not isinstance(past_key_values, DynamicCache):
        raise NotImplementedError(
            f"past_key_values must be a DynamicCache holding a prefix of the prompt, got {type(past_key_values).__name__}"
        )
    if _sliding(past_key_values):
        raise NotImplementedError(
            "past_key_values has sliding-window layers, which cannot be rolled back after rejected drafts; build it "
            "as DynamicCache() (no config) to reuse a prefix with kv_budget/draft_cache"
        )
    n = past_key_values.get_seq_length()
    if n >= prompt_length:
        raise ValueError(
            f"past_key_values holds {n} tokens but the prompt has {prompt_length}: it must hold a proper prefix"
        )
    if mode == "int4":
        raise NotImplementedError(
            "past_key_values cannot be combined with self-drafting on a quantized cache (the quantized store is the "
            "verifier's cache)"
        )
    if n > 0 and self_drafting and mode == "chunk":
        raise NotImplementedError(
            "past_key_values holding a prefix cannot seed a self-drafting chunk-budget cache: the chunk selection "
            "needs the queries of the whole prompt (pass a separate assistant_model, or draft_cache='window')"
        )
    if n > 0 and padded:
        raise NotImplementedError("past_key_values holding a prefix is not supported with a padded attention_mask")
    return n
