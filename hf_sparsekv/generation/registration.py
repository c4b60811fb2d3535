"""Wiring into ``generate()``: a guarded patch of ``GenerationMixin.generate``.

Why a patch: it is the only mechanism that makes the stock ``model.generate(...)`` of every causal LM (and
``pipeline("text-generation")``, which calls it) accept ``kv_budget``/``draft_cache`` after one import, without a
wrapper class or a Hub ``custom_generate`` repository. Stock's own prompt lookup (``prompt_lookup_num_tokens``
without ``assistant_model``) runs on our engine too (retrieval drafting), unless it asks for an option the engine
does not serve, which stock's path then serves. Our arguments come as keywords or, in a call with
``assistant_model``, as attributes of the passed or the model's ``generation_config``. The patch is narrow: a call
without them goes to the original method untouched (except that a ``past_key_values``/``cache`` cache which selects from the prompt's queries gets
them through :func:`hf_sparsekv.caches.query_hooks.prompt_queries` for the call, and it holds the model's lock
shared, :mod:`.model_locks`); it is guarded: installed only if ``generate`` still takes the arguments we forward,
and :func:`unregister` puts the original back.
"""

from __future__ import annotations

import functools
import inspect
import warnings

from transformers.generation.utils import GenerationMixin
from transformers.utils import logging

from ..cache_keyword import user_cache
from ..caches import query_hooks
from .model_locks import shared
from .front import speculative_generate

OUR_ARGUMENTS = ("kv_budget", "draft_cache", "draft_weights", "draft_tree_size")
_EXPECTED = ("inputs", "generation_config", "logits_processor", "stopping_criteria", "assistant_model", "streamer")
_original = None
logger = logging.get_logger(__name__)


def _keyword_renames(function) -> dict[str, tuple[str, bool, str]]:
    """``{old: (new, warns, version_message)}`` for the keyword renames transformers' ``deprecate_kwarg`` wrappers
    around ``function`` perform (``generate`` takes ``past_key_values`` as ``cache`` from 5.24 on; none before).
    ``warns``: whether stock warns when the old name is used (it does until the removal version)."""
    renames = {}
    while callable(function):
        try:
            free = inspect.getclosurevars(function).nonlocals
        except (TypeError, ValueError):
            break
        old, new = free.get("old_name"), free.get("new_name")
        if isinstance(old, str) and isinstance(new, str):
            warns = not free.get("is_greater_or_equal_version", False) or free.get("warn_if_greater_or_equal_version", False)
            renames[old] = (new, bool(warns), str(free.get("version_message", "")))
        function = getattr(function, "__wrapped__", None)
    return renames


def _renamed(model, kwargs: dict, renames: dict) -> dict:
    """``kwargs`` with a deprecated keyword under the name stock ``generate()`` expects, and stock's FutureWarning
    where stock gives it, attributed (as stock's) to the line that called ``generate()``, not to this file."""
    for old, (new, warns, version_message) in renames.items():
        if old in kwargs and new not in kwargs:
            kwargs[new] = kwargs.pop(old)
            if warns:
                warnings.warn(f"`{old}` is deprecated {version_message} for `{type(model).__name__}.generate`. Use "
                              f"`{new}` instead.", FutureWarning, stacklevel=3)
    return kwargs


def _prompt_lookup(model, config, kwargs: dict):
    """The call's ``prompt_lookup_num_tokens``: the keyword, else the passed generation config's, else the model's."""
    if "prompt_lookup_num_tokens" in kwargs:
        return kwargs["prompt_lookup_num_tokens"]
    return next((c.prompt_lookup_num_tokens for c in (config, getattr(model, "generation_config", None))
                 if getattr(c, "prompt_lookup_num_tokens", None) is not None), None)


def _plain(original, model, config, args: tuple, kwargs: dict):
    """Stock ``generate()``; a ``past_key_values``/``cache`` cache that selects from the prompt's queries gets them
    through :func:`~hf_sparsekv.caches.query_hooks.prompt_queries` for the call."""
    if not query_hooks.needs_prompt_queries(user_cache(kwargs)):
        return original(model, *args, **kwargs)
    chunked = kwargs.get("prefill_chunk_size") or next(
        (c.prefill_chunk_size for c in (config, getattr(model, "generation_config", None))
         if getattr(c, "prefill_chunk_size", None)), None)
    if chunked:  # the cache would select from the first piece only and keep every later one
        raise NotImplementedError(
            f"prefill_chunk_size={chunked}: a cache that selects from the prompt's queries needs the whole prompt in "
            "one prefill forward; drop prefill_chunk_size"
        )
    with query_hooks.prompt_queries(model):  # e.g. ChunkBudgetCache under eager/SDPA/flash attention
        return original(model, *args, **kwargs)


def register() -> bool:
    """Install the patch (idempotent). Returns False (with a warning) if ``generate`` has an unexpected shape."""
    global _original
    if _original is not None:
        return True
    original = GenerationMixin.generate
    params = inspect.signature(original).parameters
    if not all(name in params for name in _EXPECTED):
        warnings.warn(
            "hf_sparsekv: GenerationMixin.generate has an unexpected signature; kv_budget/draft_cache are not "
            "available in generate() (use hf_sparsekv.generation.speculative_generate directly)",
            stacklevel=2,
        )
        return False
    positional = [name for name in params if name != "self"]
    renames = _keyword_renames(original)

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        named = dict(zip(positional, args))
        ours = {name: kwargs.pop(name) for name in OUR_ARGUMENTS if name in kwargs}
        config = named.get("generation_config", kwargs.get("generation_config"))
        drafting = named.get("assistant_model", kwargs.get("assistant_model")) is not None
        # Keyword (None: off) over the passed generation_config over the model's; configs count only in a call
        # with assistant_model, not in stock assisted generation's inner drafter call, which gets a config copy.
        for name in OUR_ARGUMENTS if drafting else ():
            if name not in ours:
                ours[name] = next((getattr(c, name) for c in (config, getattr(self, "generation_config", None))
                                   if getattr(c, name, None) is not None), None)
        if all(value is None for value in ours.values()):
            kwargs = _renamed(self, kwargs, renames)
            if not drafting and _prompt_lookup(self, config, kwargs) is not None:
                try:  # stock's own prompt lookup, on our engine (retrieval drafting)
                    return speculative_generate(self, **named, **kwargs)
                except NotImplementedError as err:  # an option the engine does not serve: stock's own path
                    logger.info("hf_sparsekv: prompt lookup runs on stock generate(): %s", err)
            with shared(self, named.get("assistant_model", kwargs.get("assistant_model"))):
                return _plain(original, self, config, args, kwargs)
        overlap = set(named) & set(kwargs)
        if overlap:
            raise TypeError(f"generate() got multiple values for {sorted(overlap)}")
        return speculative_generate(self, **named, **kwargs, **ours)

    _original = original
    GenerationMixin.generate = generate
    return True


def unregister() -> None:
    """Restore the stock ``GenerationMixin.generate``."""
    global _original
    if _original is not None:
        GenerationMixin.generate = _original
        _original = None


def is_registered() -> bool:
    return _original is not None
