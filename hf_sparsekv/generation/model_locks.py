"""One readers-writer lock per model (:class:`~.rwlock.ReadersWriterLock`), so that generate() may be called from
several threads.

* An engine call (:func:`~.front.speculative_generate`, :func:`~.rounds.graph_greedy_generate`) holds its verifier's
  and its drafter's locks exclusively for the whole call: the engine look-up, the 4-bit copies, the prefill, the
  rounds, the write-back. It switches the models' attention implementation for its length and runs on the one
  engine kept per verifier, so calls on one model take turns.
* A plain call through the patched ``generate()`` (:mod:`.registration`) holds its model's lock (and its
  ``assistant_model``'s) shared: plain calls on one model run together, and wait for an engine call on it.
* Calls on different models never wait for each other. Locks are taken in one order (by ``id``), so a model that
  drafts for one call and verifies in another cannot deadlock the two.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import weakref

from torch import nn

from .rwlock import ReadersWriterLock

_locks: "weakref.WeakKeyDictionary[nn.Module, ReadersWriterLock]" = weakref.WeakKeyDictionary()
_registry = threading.Lock()  # guards _locks


def lock_for(model: nn.Module) -> ReadersWriterLock:
    """``model``'s lock (made on first use, dropped with the model)."""
    with _registry:
        lock = _locks.get(model)
        if lock is None:
            lock = _locks[model] = ReadersWriterLock()
        return lock


def _in_order(models) -> list[nn.Module]:
    """The distinct modules among ``models`` (anything else, None included, is skipped) in the one locking order."""
    return sorted({id(m): m for m in models if isinstance(m, nn.Module)}.values(), key=id)


@contextlib.contextmanager
def _held(models, mode: str):
    """Hold the locks of ``models`` in ``mode`` (``"exclusive"`` or ``"shared"``) inside the block; those taken are
    released in reverse order, also where taking a later one fails."""
    locks = [lock_for(model) for model in _in_order(models)]
    taken = []
    try:
        for lock in locks:
            getattr(lock, "acquire_" + mode)()
            taken.append(lock)
        yield
    finally:
        for lock in reversed(taken):
            getattr(lock, "release_" + mode)()


def exclusive(*models):
    """Hold the locks of ``models`` exclusively inside the block."""
    return _held(models, "exclusive")


def shared(*models):
    """Hold the locks of ``models`` shared inside the block."""
    return _held(models, "shared")


def holding(*names: str):
    """Decorator: the function runs holding exclusively the models passed to it as the arguments ``names`` (each a
    parameter that may be passed by keyword). The models are read from the call's arguments by position or keyword
    (``inspect.Signature.bind_partial``, 14 us a call, only where they may not bind: its error then)."""

    def decorate(function):
        signature = inspect.signature(function)
        parameters = signature.parameters.values()
        kinds = {p.name: p.kind for p in parameters}
        if any(kinds.get(name) not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
               for name in names):
            raise TypeError(f"holding{names}: each must be a parameter of {function.__name__} that takes a keyword")
        positional = [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        if any(p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL) for p in parameters):
            positional = None  # (such a function's calls all go through bind_partial)
        keywords = None if inspect.Parameter.VAR_KEYWORD in kinds.values() else frozenset(kinds)  # None: any
        places = [(name, positional.index(name) if positional and name in positional else None) for name in names]

        def bound(args: tuple, kwargs: dict) -> bool:
            """Whether ``args``/``kwargs`` bind as the call's arguments with each model where ``places`` says."""
            return (positional is not None and len(args) <= len(positional)
                    and kwargs.keys().isdisjoint(positional[: len(args)])
                    and (keywords is None or kwargs.keys() <= keywords))

        @functools.wraps(function)
        def locked(*args, **kwargs):
            if bound(args, kwargs):
                models = [args[i] if i is not None and i < len(args) else kwargs.get(name) for name, i in places]
            else:
                arguments = signature.bind_partial(*args, **kwargs).arguments
                models = [arguments.get(name) for name in names]
            with exclusive(*models):
                return function(*args, **kwargs)

        return locked

    return decorate
