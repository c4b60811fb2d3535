"""The prompt's queries taken from the attention call itself, for the prefills our own loop runs.

A chunk-budget cache selects its chunks from the prompt's queries ``[B, Hq, P, D]`` (after RoPE), which its
``update`` never sees. Where our loop runs a prefill (a separate drafter's, or the verifier's when it seeds its own
self-drafting cache) it runs the model's attention implementation wrapped: ``"sparsekv_queries:<inner>"`` calls the
very function the model would call (SDPA's, or the eager function of the module's own modeling file), then hands
the query it received to the cache layer waiting for it (:mod:`.caches.scoring_hook`). Nothing is recomputed, so
every architecture works whatever its projections (fused ``qkv_proj`` as in Phi-3 and GPT-NeoX, partial rotary as in
StableLM, q/k norms) and the attention output is bit-identical to the unwrapped call.

Covered implementations: ``"eager"`` and ``"sdpa"`` (and ``"sparsekv"``, which hands the queries over itself). A
model on any other implementation (flash-attn, flex, a custom one) keeps it; the caller then falls back to the
recomputing hooks of :mod:`.caches.query_hooks`, which refuse clearly what they cannot reproduce.

The hooks of :mod:`.caches.query_hooks` remain what stock ``generate()`` uses, where we do not choose the attention.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from .attention import NAME as SPARSEKV_ATTENTION
from .caches import scoring_hook
from .caches.query_hooks import attention_modules

PREFIX = "sparsekv_queries:"
WRAPPED = ("sdpa", "eager")


def _inner_function(inner: str, module) -> Callable:
    if inner == "sdpa":
        return sdpa_attention_forward
    return sys.modules[type(module).__module__].eager_attention_forward


def _make_attention(inner: str) -> Callable:
    def queries_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """``inner``'s attention on query ``[B, Hq, q, D]``, key/value ``[B, Hkv, kv, D]``; then the query is handed
        to a cache layer waiting for it (and to an observer, :func:`scoring_hook.observe`)."""
        out = _inner_function(inner, module)(module, query, key, value, attention_mask, scaling=scaling,
                                             dropout=dropout, **kwargs)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        scoring_hook.hand_over(module, query, key, scale)
        return out

    queries_attention.__name__ = f"queries_attention_{inner}"
    return queries_attention


def register() -> None:
    """Register ``"sparsekv_queries:sdpa"`` and ``"sparsekv_queries:eager"`` (attention and the inner's own mask)."""
    for inner in WRAPPED:
        AttentionInterface.register(PREFIX + inner, _make_attention(inner))
        AttentionMaskInterface.register(PREFIX + inner, ALL_MASK_ATTENTION_FUNCTIONS[inner])


def _wrappable(model: torch.nn.Module, modules: list[torch.nn.Module]) -> bool:
    impl = model.config._attn_implementation
    if impl not in WRAPPED or not model._can_set_attn_implementation():
        return False
    # eager: each attention module's own modeling file must define the function its forward falls back to
    return impl == "sdpa" or all(
        callable(getattr(sys.modules.get(type(m).__module__), "eager_attention_forward", None)) for m in modules
    )


@contextlib.contextmanager
def queries_from_attention(model: torch.nn.Module, observer: Callable | None = None) -> Iterator[bool]:
    """Within the block, ``model``'s attention hands each call's query to a cache layer waiting for it, and to
    ``observer(module, query [B, Hq, n, D], key [B, Hkv, kv, D], scaling)`` if given. Yields True when it does
    (implementation ``"sparsekv"``, or ``"eager"``/``"sdpa"`` wrapped for the block and restored after it), False
    when the model's implementation is another one (the caller falls back to :mod:`.caches.query_hooks`)."""
    impl = model.config._attn_implementation
    direct = impl == SPARSEKV_ATTENTION
    wrap = not direct and _wrappable(model, attention_modules(model))
    if wrap:
        model.set_attn_implementation(PREFIX + impl)
        wrap = model.config._attn_implementation == PREFIX + impl
    token = scoring_hook.observe(observer) if observer is not None and (direct or wrap) else None
    try:
        yield direct or wrap
    finally:
        if token is not None:
            scoring_hook.stop_observing(token)
        if wrap:
            model.set_attn_implementation(impl)
