"""Wiring into ``generate()``: a guarded patch of ``GenerationMixin.generate``.

Why a patch: it is the only mechanism that makes the stock ``model.generate(...)`` of every causal LM (and
``pipeline("text-generation")``, which calls it) accept ``kv_budget``/``draft_cache`` after one import, without a
wrapper class or a Hub ``custom_generate`` repository. Our arguments come as keywords or, in a call with
``assistant_model``, as attributes of the passed or the model's ``generation_config``.

Which calls reach the engine:

- a call with an argument of ours (``kv_budget``, ``draft_cache``, ``draft_weights``, ``draft_tree_size``);
- ``static_engine=True`` (keyword or generation-config attribute): plain decoding, greedy or sampled, on the engine;
- stock's own speculative calls, by the import alone (:func:`set_routing` turns each off): assisted generation
  (``assistant_model=drafter`` and no argument of ours: the drafter on a full cache, or past its trained positions a
  sink + window cache, :func:`~.draft_modes.routed_draft_cache`; γ chosen by the controller) and
  prompt lookup (``prompt_lookup_num_tokens``: retrieval drafting). What the engine does not serve in them or in
  ``static_engine`` (an encoder-decoder model, universal assisted generation with two tokenizers, a drafter on
  another device or with another vocabulary, an option the engine refuses with ``NotImplementedError``) goes to
  stock's own path, the reason logged at info level (``static_engine``: a one-time warning).

Every other call goes to the original method untouched (except that a ``past_key_values``/``cache`` cache which
selects from the prompt's queries gets them through :func:`hf_sparsekv.caches.query_hooks.prompt_queries` for the
call, and it holds the model's lock shared, :mod:`.model_locks`). A ``generate()`` nested in a call stock serves
(stock assisted generation's inner drafter calls) is always stock's. The patch is guarded: installed only if
``generate`` still takes the arguments we forward, and :func:`unregister` puts the original back.
"""

from __future__ import annotations

import functools
import inspect
import threading
import warnings

import torch
from transformers.generation.utils import GenerationMixin
from transformers.utils import logging

from ..cache_keyword import user_cache
from ..caches import query_hooks
from .common import _text_config
from .model_locks import shared
from .engine import release_engines
from .front import EngineFailure, speculative_generate

OUR_ARGUMENTS = ("kv_budget", "draft_cache", "draft_weights", "draft_tree_size")
_EXPECTED = ("inputs", "generation_config", "logits_processor", "stopping_criteria", "assistant_model", "streamer")
_original = None
_routing = {"assisted": True, "prompt_lookup": True}
_in_stock = threading.local()  # .depth > 0: this thread runs a speculative call on stock's path
logger = logging.get_logger(__name__)


def set_routing(*, assisted: bool | None = None, prompt_lookup: bool | None = None) -> dict[str, bool]:
    """Whether stock's own speculative calls run on the engine after the import: ``assisted``
    (``generate(ids, assistant_model=drafter)`` with no argument of ours) and ``prompt_lookup``
    (``generate(ids, prompt_lookup_num_tokens=N)``); both on by default. None keeps a setting. Returns the settings
    now in force. Calls with an argument of ours, or ``static_engine=True``, are not affected."""
    for name, value in (("assisted", assisted), ("prompt_lookup", prompt_lookup)):
        if value is not None:
            _routing[name] = bool(value)
    return dict(_routing)


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
    return _configured(model, config, "prompt_lookup_num_tokens")


def _configured(model, config, name: str):
    """The generation option ``name`` from the passed ``generation_config``, else the model's (None if neither
    sets it)."""
    return next((getattr(c, name) for c in (config, getattr(model, "generation_config", None))
                 if getattr(c, name, None) is not None), None)


def _stock_reason(model, assistant, kwargs: dict) -> str | None:
    """Why a call routed by the import (stock's assisted generation with ``assistant``, prompt lookup without one,
    or ``static_engine``) must stay on stock's path (None: the engine may serve it): an encoder-decoder model,
    universal assisted generation, a drafter on another device or with another vocabulary size."""
    if getattr(model.config, "is_encoder_decoder", False):
        return f"{type(model).__name__} is an encoder-decoder model; the engine serves decoder-only causal LMs"
    if assistant is None:
        return None
    if kwargs.get("assistant_tokenizer") is not None:
        return "assistant_tokenizer= (universal assisted generation, two vocabularies) is served by stock only"
    if assistant is model or not isinstance(assistant, torch.nn.Module) or getattr(assistant, "config", None) is None:
        return None  # self-drafting on a full cache; a wrong type is refused, naming it
    if getattr(assistant, "device", None) != getattr(model, "device", None):
        return f"the assistant is on {assistant.device} and the model on {model.device}"
    sizes = [_text_config(m).vocab_size for m in (model, assistant)]  # as front._check_models (and stock) compare
    if sizes[0] != sizes[1]:
        return f"the assistant's vocabulary ({sizes[1]}) differs from the model's ({sizes[0]})"
    return None


class _stock_scope:
    """While stock serves a speculative call, a ``generate()`` it nests (its drafter's) is stock's as well."""

    def __init__(self, active: bool):
        self.active = active

    def __enter__(self):
        if self.active:
            _in_stock.depth = getattr(_in_stock, "depth", 0) + 1

    def __exit__(self, *exc):
        if self.active:
            _in_stock.depth -= 1


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


PATCH_ENV = "HF_SPARSEKV_PATCH"  # "0": the import installs no patch (models opt in: enable(), the mixin)
_STOCK = GenerationMixin.generate  # stock's method, as transformers defines it (before any patch)
_PARAMS = inspect.signature(_STOCK).parameters
_POSITIONAL = [name for name in _PARAMS if name != "self"]
_RENAMES = _keyword_renames(_STOCK)


def _usable() -> bool:
    """Whether stock ``generate`` takes the arguments the front door forwards (a warning where it does not)."""
    if all(name in _PARAMS for name in _EXPECTED):
        return True
    warnings.warn(
        "hf_sparsekv: GenerationMixin.generate has an unexpected signature; kv_budget/draft_cache are not "
        "available in generate() (use hf_sparsekv.generation.speculative_generate directly)",
        stacklevel=3,
    )
    return False


def front_door(self, *args, **kwargs):
    """``generate()`` with the engine's arguments and routing (see the module docstring); every other call is stock's
    ``GenerationMixin.generate``. The one implementation behind the patch, :class:`SpeculativeGenerationMixin` and
    :func:`enable`."""
    original = _STOCK
    named = dict(zip(_POSITIONAL, args))
    ours = {name: kwargs.pop(name) for name in OUR_ARGUMENTS if name in kwargs}
    config = named.get("generation_config", kwargs.get("generation_config"))
    assistant = named.get("assistant_model", kwargs.get("assistant_model"))
    drafting = assistant is not None
    nested = getattr(_in_stock, "depth", 0) > 0  # stock assisted generation's inner drafter call
    # Keyword (None: off) over the passed generation_config over the model's; configs count only in a call
    # with assistant_model, not in stock assisted generation's inner drafter call, which gets a config copy.
    for name in OUR_ARGUMENTS if drafting else ():
        if name not in ours:
            ours[name] = _configured(self, config, name)
    engine = kwargs.pop("static_engine", None)
    engine = bool(_configured(self, config, "static_engine") if engine is None else engine) and not nested
    if any(value is not None for value in ours.values()):
        overlap = set(named) & set(kwargs)
        if overlap:
            raise TypeError(f"generate() got multiple values for {sorted(overlap)}")
        return speculative_generate(self, **named, **kwargs, **ours)
    kwargs = _renamed(self, kwargs, _RENAMES)
    if not nested:
        lookup = _prompt_lookup(self, config, kwargs) is not None
        route = _routing["assisted"] if drafting else _routing["prompt_lookup"] if lookup else False
        reason = _stock_reason(self, assistant, kwargs) if drafting or lookup or engine else None
        if (route or engine) and reason is None:
            try:  # stock's own speculative calls (or plain decoding asked for) on our engine
                return speculative_generate(self, **named, **kwargs, draft_cache="full" if drafting else None,
                                            static_engine=engine, stock_fallback=True)
            except EngineFailure as err:  # the engine failed where stock's path may not: a bug to report
                release_engines(self)  # (its memory, before stock's path allocates)
                logger.warning_once(f"hf_sparsekv: the engine failed on this call ({err}); stock generate() "
                                    "serves it. Please report this with the model's name.")
                reason = None
            except NotImplementedError as err:  # an option the engine does not serve: stock's own path
                reason = str(err)
        if reason is not None and engine:  # asked for by name: say so where a user looks
            logger.warning_once(f"hf_sparsekv: static_engine=True: this call runs on stock generate(): {reason}")
        elif reason is not None:
            what = "assisted generation" if drafting else "prompt lookup"
            logger.info("hf_sparsekv: %s runs on stock generate(): %s", what, reason)
    with shared(self, assistant), _stock_scope(drafting):
        return _plain(original, self, config, args, kwargs)


functools.update_wrapper(front_door, _STOCK)  # stock's docstring and signature (inspect follows __wrapped__)
front_door.__module__, front_door.__qualname__ = __name__, "front_door"  # (pickle finds it here: enable's partial)


class SpeculativeGenerationMixin:
    """A mixin whose ``generate()`` is the engine's front door (:func:`front_door`: ``kv_budget=``, ``draft_cache=``,
    ``static_engine=True``, stock's assisted and prompt-lookup calls routed onto the engine, everything else stock's),
    whether or not the import-time patch is installed. Put it first among the bases::

        class MyLlama(SpeculativeGenerationMixin, LlamaForCausalLM): ...

    or attach it to one loaded model with :func:`enable`."""

    generate = front_door


def register() -> bool:
    """Install the patch (idempotent): :class:`SpeculativeGenerationMixin`'s ``generate`` on ``GenerationMixin``
    itself, so every model's ``generate()`` is the front door. Returns False (with a warning) if ``generate`` has an
    unexpected shape."""
    global _original
    if _original is not None:
        return True
    if not _usable():
        return False
    _original = GenerationMixin.generate
    GenerationMixin.generate = front_door
    return True


def unregister() -> None:
    """Restore the stock ``GenerationMixin.generate`` (models given the front door by :func:`enable`, and classes
    built on :class:`SpeculativeGenerationMixin`, keep it)."""
    global _original
    if _original is not None:
        GenerationMixin.generate = _original
        _original = None


def enable(model):
    """Give ``model`` (this instance only: not its class, not other instances) the front door as its ``generate``;
    returns ``model``. ``save_pretrained`` writes what it writes of a stock model (a ``from_pretrained`` gives a stock
    model), ``copy.deepcopy`` and ``torch.save``/``torch.load`` keep it on the copy, :func:`disable` takes it off."""
    if not isinstance(model, GenerationMixin):
        raise TypeError(f"enable() takes a transformers model with generate(), got {type(model).__name__}")
    if not _usable():
        raise RuntimeError("hf_sparsekv: this transformers' generate() cannot be wrapped (see the warning)")
    model.__dict__["generate"] = functools.partial(front_door, model)  # (picklable: a module-level function)
    return model


def disable(model):
    """Undo :func:`enable` on ``model`` (its ``generate`` is its class's again); returns ``model``."""
    attached = model.__dict__.get("generate")
    if isinstance(attached, functools.partial) and attached.func is front_door:
        del model.__dict__["generate"]
    return model


def is_enabled(model) -> bool:
    """Whether ``model.generate`` is the front door (the patch, :func:`enable` or the mixin)."""
    method = getattr(type(model), "generate", None)
    attached = model.__dict__.get("generate")
    if attached is not None:
        return isinstance(attached, functools.partial) and attached.func is front_door
    return method is front_door


def is_registered() -> bool:
    return _original is not None
