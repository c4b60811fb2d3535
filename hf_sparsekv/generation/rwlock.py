"""A readers-writer lock, reentrant per thread (one per model: :mod:`.model_locks`).

Invariants: while a thread holds it exclusively no other thread holds it at all; any number of threads may hold it
shared at once. A thread that holds it exclusively takes it again in either mode at once (an engine call that
recurses); a thread that holds it shared takes it shared again at once, even while a writer waits (a plain call
whose inner call reads the same model); a thread that holds it shared and asks for it exclusively waits until it is
the only reader. A waiting writer keeps new readers out, so writers are not starved.
"""

from __future__ import annotations

import contextlib
import threading


class ReadersWriterLock:
    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._writer: int | None = None  # the thread that holds it exclusively
        self._depth = 0  # that thread's holds (exclusive, and shared ones taken inside them)
        self._readers: dict[int, int] = {}  # thread -> its shared holds
        self._waiting_writers = 0

    def acquire_shared(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:
                self._depth += 1
                return
            if me not in self._readers:
                self._cond.wait_for(lambda: self._writer is None and not self._waiting_writers)
            self._readers[me] = self._readers.get(me, 0) + 1

    def release_shared(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:
                self._release_depth()
                return
            if self._readers[me] == 1:
                del self._readers[me]
                self._cond.notify_all()
            else:
                self._readers[me] -= 1

    def acquire_exclusive(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:
                self._depth += 1
                return
            self._waiting_writers += 1
            try:
                self._cond.wait_for(lambda: self._writer is None and set(self._readers) <= {me})
            finally:
                self._waiting_writers -= 1
                self._cond.notify_all()  # readers held back by this writer (gone, if interrupted) look again
            self._writer, self._depth = me, 1

    def release_exclusive(self) -> None:
        with self._cond:
            if self._writer != threading.get_ident():
                raise RuntimeError("release_exclusive() by a thread that does not hold the lock exclusively")
            self._release_depth()

    def _release_depth(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._writer = None
            self._cond.notify_all()

    def held(self) -> bool:
        """Whether any thread holds it."""
        with self._cond:
            return self._writer is not None or bool(self._readers)

    @contextlib.contextmanager
    def shared(self):
        self.acquire_shared()
        try:
            yield
        finally:
            self.release_shared()

    @contextlib.contextmanager
    def exclusive(self):
        self.acquire_exclusive()
        try:
            yield
        finally:
            self.release_exclusive()
