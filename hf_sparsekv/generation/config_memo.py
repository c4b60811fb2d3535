"""Stock's ``GenerationConfig`` of a call, remembered per model.

``model._prepare_generation_config(generation_config, **kwargs)`` (the user's config or kwargs over the model's
``generation_config`` over the library defaults) deep-copies and merges whole configs: 0.25 ms a call on one CPU
core for the bundled pair, 0.9-1.7 ms on an H200's host, the largest part of a ``generate()`` call's front end. Its
result depends only on its inputs' values, so each model keeps the inputs (deep copies) and results of its last
:data:`KEPT` distinct calls (configurations alternating on one model each keep theirs): a call whose inputs equal
one of them gets a copy of its result as deep as a ``copy.deepcopy`` (:func:`_copied`, 6 us where a deep copy took
46 us). Inputs that are not plain values (a tensor among the kwargs, say) always take stock's path.
"""

from __future__ import annotations

import copy
import threading
import weakref

from transformers import GenerationConfig

_PLAIN = (type(None), bool, int, float, str)
_PLAIN_TYPES = frozenset(_PLAIN)  # (a look-up per attribute: most of a config's 70-odd attributes are of these)
KEPT = 8  # distinct calls remembered per model
_memos: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> [(inputs, config, unused)], latest first
_lock = threading.Lock()  # guards _memos (calls on different models may run at once)


def _plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _immutable(value) -> bool:
    """Whether ``value`` is a plain immutable value (a tuple of them included): a copy may share it."""
    if isinstance(value, tuple):
        return all(_immutable(v) for v in value)
    return isinstance(value, _PLAIN)


def _copied(config: GenerationConfig) -> GenerationConfig:
    """``copy.deepcopy(config)`` made faster: a shallow copy whose attributes that are not :func:`_immutable` (a list
    of EOS ids, a dict, a config object) are deep copies, through one memo (attributes that share an object share its
    copy). ``GenerationConfig`` defines no copy hooks (a copy is a new instance with a copy of its ``__dict__``), so
    the copy shares no mutable object with ``config``: a caller that changes it in place
    (``config.eos_token_id.append(...)``) leaves ``config`` as it was. A subclass (which may define hooks) is
    deep-copied."""
    if type(config) is not GenerationConfig:
        return copy.deepcopy(config)
    new, memo = copy.copy(config), {}
    attributes = vars(new)
    for name, value in attributes.items():
        if type(value) not in _PLAIN_TYPES and not _immutable(value):
            attributes[name] = copy.deepcopy(value, memo)
    return new


def _equal(a, b) -> bool:
    """``a == b``, False where a value's comparison is not a plain truth value (a tensor in a config, say)."""
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):
        return False


def _inputs(model, generation_config: GenerationConfig | None, kwargs: dict) -> tuple:
    """What stock's result depends on: the kwargs, both generation configs' attributes, and the model's own config
    (where no generation config is given, stock refuses generation parameters set on it)."""
    return (kwargs, vars(model.generation_config), None if generation_config is None else vars(generation_config),
            vars(model.config))


def prepare_generation_config(model, generation_config: GenerationConfig | None, kwargs: dict
                              ) -> tuple[GenerationConfig, dict]:
    """``model._prepare_generation_config(generation_config, **kwargs)``: a new config and the kwargs it did not use,
    equal to what stock's call returns."""
    if not all(_plain(v) for v in kwargs.values()):
        return model._prepare_generation_config(generation_config, **kwargs)
    inputs = _inputs(model, generation_config, kwargs)
    with _lock:
        kept = list(_memos.get(model, ()))
    for memo in kept:
        if _equal(memo[0], inputs):
            _remember(model, memo)
            return _copied(memo[1]), dict(memo[2])
    config, unused = model._prepare_generation_config(generation_config, **kwargs)  # (unused: plain kwargs, flags)
    try:
        memo = (copy.deepcopy(inputs), copy.deepcopy(config), dict(unused))
    except Exception:  # (an attribute that cannot be copied: the call is served, nothing is remembered)
        return config, unused
    _remember(model, memo)
    return config, unused


def _remember(model, memo: tuple) -> None:
    """``memo`` becomes ``model``'s latest; the least recently used past :data:`KEPT` is dropped."""
    with _lock:
        _memos[model] = [memo, *(m for m in _memos.get(model, ()) if m is not memo)][:KEPT]
