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
    """Hold the locks of ``models`` in ``mode`` (``"exclusive"`` or ``"shared"``) inside the block."""
    with contextlib.ExitStack() as held:
        for model in _in_order(models):
            held.enter_context(getattr(lock_for(model), mode)())
        yield


def exclusive(*models):
    """Hold the locks of ``models`` exclusively inside the block."""
    return _held(models, "exclusive")


def shared(*models):
    """Hold the locks of ``models`` shared inside the block."""
    return _held(models, "shared")


def holding(*names: str):
    """Decorator: the function runs holding exclusively the models passed to it as the arguments ``names``."""

    def decorate(function):
        signature = inspect.signature(function)

        @functools.wraps(function)
        def locked(*args, **kwargs):
            arguments = signature.bind_partial(*args, **kwargs).arguments
            with exclusive(*(arguments.get(name) for name in names)):
                return function(*args, **kwargs)

        return locked

    return decorate
