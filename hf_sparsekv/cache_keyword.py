"""The keyword under which a model's ``forward`` and ``generate`` take the KV cache.

transformers renamed it from ``past_key_values`` to ``cache`` in 5.24 (the old name still works there, with a
FutureWarning on every call, until its removal). We pass the cache under the name the model declares, so one
code path runs warning-free on 5.17 through the newest 5.x; users may pass either name to ``generate()``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch

OLD, NEW = "past_key_values", "cache"


@functools.lru_cache(maxsize=None)
def _keyword_of(function) -> str:
    params = inspect.signature(function).parameters  # follows the deprecation wrapper's __wrapped__
    return NEW if NEW in params else OLD


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DistributedDataParallel and torch.compile wrappers, whose ``forward(*args, **kwargs)``
    passes every keyword through unchanged."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def cache_keyword(model: torch.nn.Module) -> str:
    """``"cache"`` if ``model.forward`` (of the model inside any DDP or torch.compile wrapper) declares a ``cache``
    parameter, else ``"past_key_values"``. Call it outside code that torch.compile traces (it inspects a signature)
    and pass the name in."""
    forward = _unwrapped(model).forward
    return _keyword_of(getattr(forward, "__func__", forward))


def output_field(output_class) -> str:
    """The field of a ``generate()`` output dataclass that holds the cache (``cache`` from 5.24 on, where
    ``past_key_values`` is a property that warns)."""
    return NEW if NEW in {f.name for f in dataclasses.fields(output_class)} else OLD


def pop_user_cache(kwargs: dict):
    """Remove and return the cache a caller passed to ``generate()`` as ``past_key_values=`` or ``cache=`` (None if
    neither); TypeError if both carry one."""
    old, new = kwargs.pop(OLD, None), kwargs.pop(NEW, None)
    if old is not None and new is not None:
        raise TypeError("generate() got both past_key_values and cache; pass the cache once")
    return new if new is not None else old


def user_cache(kwargs: dict):
    """The cache in ``kwargs`` under either name, without removing it."""
    return kwargs.get(NEW) if kwargs.get(NEW) is not None else kwargs.get(OLD)
