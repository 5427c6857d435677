"""Per-call timeouts of a ProcessExecutor.

:class:`Deadlines` keeps a heap of ``[deadline, seq, call, seconds]`` and a
thread that hands each call still running at its deadline to
``on_expired(call, seconds)``.  A call that finishes clears its entry at
once (the heap never keeps a finished call's results alive); cleared entries
are dropped whenever the heap has doubled since the last clean-up, so the
heap stays proportional to the calls in flight.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import numbers
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Callable

log = logging.getLogger("jaxcolo.executor")


def check_timeout(seconds, what: str):
    """``seconds`` as a timeout: None (or inf) for none, else a float > 0;
    ValueError for anything else (NaN, 0, negative, not a number)."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) \
            or not seconds > 0:
        raise ValueError(f"{what} must be a number of seconds > 0 (or None), "
                         f"got {seconds!r}")
    seconds = float(seconds)
    return None if seconds == math.inf else seconds


def _safely(fn, *args) -> None:
    """The deadline thread outlives any one callback's failure (else no
    call would time out any more)."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - logged, the thread goes on
        log.exception("a deadline callback failed")


class Deadlines:
    """Also checks: ``check(obj, seconds)`` hands ``obj`` -- held weakly,
    so a check keeps nothing alive -- to ``on_check(obj)`` after
    ``seconds`` if it still exists."""

    def __init__(self, on_expired: Callable, on_check: Callable = None):
        self._on_expired = on_expired
        self._on_check = on_check
        self._heap: list = []
        self._seq = itertools.count()
        self._compact_at = 1024
        self._cv = threading.Condition(threading.Lock())
        self._closed = False
        threading.Thread(target=self._run, daemon=True,
                         name="jaxcolo-deadlines").start()

    def add(self, call, seconds: float, start: float | None = None, *,
            shown: float | None = None) -> None:
        """Expire ``call`` ``seconds`` after ``start`` (a time.monotonic()
        value; None: now), handing ``on_expired`` ``shown`` (the timeout
        the caller set, when ``seconds`` is what was left of it) or
        ``seconds``."""
        if start is None:
            start = time.monotonic()
        entry = [start + seconds, next(self._seq), call,
                 seconds if shown is None else shown]
        # Future's own method: internal, runs inline in any thread
        Future.add_done_callback(call.future,
                                 lambda _, e=entry: e.__setitem__(2, None))
        with self._cv:
            heap = self._heap
            if len(heap) >= self._compact_at:
                heap[:] = [e for e in heap if e[2] is not None and
                           (e[3] is not None or e[2]() is not None)]
                heapq.heapify(heap)
                self._compact_at = max(1024, 2 * len(heap))
            heapq.heappush(heap, entry)
            self._cv.notify()

    def check(self, obj, seconds: float) -> None:
        entry = [time.monotonic() + seconds, next(self._seq),
                 weakref.ref(obj), None]
        with self._cv:
            heapq.heappush(self._heap, entry)
            self._cv.notify()

    def __len__(self) -> int:
        return len(self._heap)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    def _run(self) -> None:
        heap = self._heap
        call = obj = None
        while True:
            expired, checks = [], []
            with self._cv:
                if self._closed:
                    return
                now = time.monotonic()
                while heap and heap[0][0] <= now:
                    _, _, call, seconds = heapq.heappop(heap)
                    if seconds is None:  # a check: ``call`` is a weakref
                        obj = call()
                        if obj is not None:
                            checks.append(obj)
                    elif call is not None and not call.future.done():
                        expired.append((call, seconds))
                if not expired and not checks:
                    call = obj = None  # nothing is kept while waiting
                    self._cv.wait(min(heap[0][0] - now, threading.TIMEOUT_MAX)
                                  if heap else None)
                    continue
            # never under the lock: failing a call runs its callbacks
            for call, seconds in expired:
                _safely(self._on_expired, call, seconds)
            for obj in checks:
                _safely(self._on_check, obj)
            expired = checks = call = obj = None
