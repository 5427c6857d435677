"""Run a function with its work counted and stopped past a limit.

Used for what no cost model of the input can bound (JAX's reasoning about
symbolic constraints).  ``run_counted(fn, limit)`` runs ``fn()`` under a
profile function that counts events (Python calls and returns) and raises
:class:`OutOfBudget` past ``limit``:

* in the calling thread, unless that thread has a profiler of its own
  (cProfile, or a Python-level one): then in a helper thread, so that the
  profiler is neither replaced nor disturbed;
* CPython drops a profile function that raised, and code under a bare
  ``except:`` may swallow the exception and carry on uncounted: a watchdog
  thread then raises OutOfBudget in the working thread again (an
  asynchronous exception, every few milliseconds) until the work ends, and
  its result is refused whatever it is.  The work stops within about the
  limit.  No stop is sent once the work is over, and one sent just before
  lands before ``run_counted`` returns.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time

_INJECT_EVERY = 0.005  # seconds between asynchronous stops of a runaway


class OutOfBudget(BaseException):
    """The counted work went past its limit (a BaseException, so that
    ``except Exception`` on the way out does not catch it)."""


class _Run:
    __slots__ = ("fn", "limit", "events", "tripped", "cancelled", "out",
                 "error", "done", "lock", "ident", "finished")

    def __init__(self, fn, limit: int):
        self.fn = fn
        self.limit = limit
        self.events = 0
        self.tripped = False
        self.cancelled = False  # the caller gave up (e.g. KeyboardInterrupt)
        self.out = None
        self.error = None
        self.done = False
        self.lock = threading.Lock()  # ``done`` vs. an asynchronous stop
        self.ident = None  # the working thread
        self.finished = threading.Event()

    def count(self, frame, event, arg):
        self.events += 1
        if self.events > self.limit or self.cancelled:
            if not self.tripped:
                self.tripped = True
                _WATCHDOG.watch(self)
            raise OutOfBudget

    def work(self) -> None:
        """Run ``fn`` counted in this thread; keeps its result or error."""
        self.ident = threading.get_ident()
        try:
            sys.setprofile(self.count)
            try:
                self.out = self.fn()
            finally:
                sys.setprofile(None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self.error = e
        while True:
            try:
                with self.lock:
                    self.done = True
                _landing()  # a stop sent before ``done`` lands here
                break
            except OutOfBudget:
                continue
        self.finished.set()


def _landing() -> None:
    """A call: the interpreter checks for asynchronous exceptions on entry."""


def _stop(ident: int) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(OutOfBudget))


class _Watchdog:
    """Sends the stop again to runs that tripped and are still working."""

    def __init__(self):
        self._lock = threading.Lock()
        self._runs: set = set()
        self._wake = threading.Event()
        self._thread = None

    def watch(self, run: _Run) -> None:
        with self._lock:
            self._runs.add(run)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="jaxcolo-counted-watchdog",
                    daemon=True)
                self._thread.start()
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            time.sleep(_INJECT_EVERY)  # the first stop may still get out
            with self._lock:
                self._runs = {r for r in self._runs if not r.done}
                runs = list(self._runs)
                if not runs:
                    self._wake.clear()
                    continue
            for run in runs:
                with run.lock:
                    if not run.done and run.ident is not None:
                        _stop(run.ident)


_WATCHDOG = _Watchdog()


def run_counted(fn, limit: int):
    """``(fn(), events it took)``; OutOfBudget once it takes more than
    ``limit`` events (then nothing of it is returned).  An exception that
    interrupts the caller (KeyboardInterrupt) stops the work too."""
    run = _Run(fn, limit)
    if sys.getprofile() is None:
        try:
            run.work()
        except BaseException:
            run.cancelled = True
            raise
    else:  # leave the caller's profiler alone
        thread = threading.Thread(target=run.work, name="jaxcolo-counted",
                                  daemon=True)
        thread.start()
        try:
            run.finished.wait()
        except BaseException:  # interrupted: stop the work, then go
            run.cancelled = True
            with run.lock:
                if not run.done and run.ident is not None:
                    _stop(run.ident)
            raise
    if run.tripped:
        if isinstance(run.error, KeyboardInterrupt):
            raise run.error
        raise OutOfBudget
    if run.error is not None:
        raise run.error
    return run.out, run.events
