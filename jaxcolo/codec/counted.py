"""Run a function with its work counted and stopped past a limit.

Used for what no cost model of the input can bound (JAX's reasoning about
symbolic constraints).  ``run_counted(fn, limit)`` runs ``fn()`` in a helper
thread of its own under a profile function that counts events (Python calls
and returns) and raises :class:`OutOfBudget` past ``limit``:

* in its own thread, so the caller's profiler (cProfile, or a Python-level
  one) is neither replaced nor disturbed;
* CPython drops a profile function that raised, and code under a bare
  ``except:`` may swallow the exception and carry on uncounted: the caller
  then keeps raising OutOfBudget in the helper thread (an asynchronous
  exception, every few milliseconds) until it ends, and the result is
  refused whatever it is.  The work stops within about the limit.
"""

from __future__ import annotations

import ctypes
import sys
import threading

_INJECT_EVERY = 0.005  # seconds between asynchronous stops of a runaway
_POLL = 0.05  # the caller checks this often whether the stop was swallowed


class OutOfBudget(BaseException):
    """The counted work went past its limit (a BaseException, so that
    ``except Exception`` on the way out does not catch it)."""


class _Run:
    __slots__ = ("fn", "limit", "events", "tripped", "out", "error", "done",
                 "lock")

    def __init__(self, fn, limit: int):
        self.fn = fn
        self.limit = limit
        self.events = 0
        self.tripped = False
        self.out = None
        self.error = None
        self.done = False
        self.lock = threading.Lock()  # done vs. an asynchronous stop

    def count(self, frame, event, arg):
        self.events += 1
        if self.events > self.limit:
            self.tripped = True
            raise OutOfBudget

    def __call__(self) -> None:
        try:
            sys.setprofile(self.count)
            try:
                self.out = self.fn()
            finally:
                sys.setprofile(None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self.error = e
        while True:  # no stop is sent once the work is over; one sent
            try:     # before lands at the thread's next bytecodes
                with self.lock:
                    self.done = True
                return
            except OutOfBudget:
                continue


def _stop(thread: threading.Thread) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident), ctypes.py_object(OutOfBudget))


def run_counted(fn, limit: int):
    """``(fn(), events it took)``; OutOfBudget once it takes more than
    ``limit`` events (then nothing of it is returned)."""
    run = _Run(fn, limit)
    thread = threading.Thread(target=run, name="jaxcolo-counted",
                              daemon=True)
    thread.start()
    while True:
        thread.join(_INJECT_EVERY if run.tripped else _POLL)
        if not thread.is_alive():
            break
        if run.tripped:  # the stop was swallowed: send it again
            with run.lock:
                if not run.done:
                    _stop(thread)
    if run.tripped:
        raise OutOfBudget
    if run.error is not None:
        raise run.error
    return run.out, run.events
