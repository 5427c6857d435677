"""Futures of submitted calls whose done-callbacks never run on a thread an
executor depends on (a link's reader, a lane's runner): a callback may then
wait for the executor's other calls, as with a ThreadPoolExecutor's.

``executor_thread()`` marks such a thread while inside the block;
:class:`CallFuture` completed there runs its callbacks on a thread of its
own.  Shared by both backends (InlineExecutor's lane runners, the
ProcessExecutor's readers and watchdogs).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

from jaxcolo.colocated.executor import FirstRaised

log = logging.getLogger("jaxcolo.executor")
_thread = threading.local()


class executor_thread:
    """``with executor_thread():`` marks the current thread as one the
    executor needs to make progress (a link's reader, its watchdog, the
    deadline thread) while inside the block: futures completed here run
    their callbacks on a thread of their own (see :class:`CallFuture`).
    (A class, not a generator: it is entered for every reply read.)"""

    __slots__ = ("_previous",)

    def __enter__(self) -> None:
        self._previous = getattr(_thread, "internal", False)
        _thread.internal = True

    def __exit__(self, *exc) -> bool:
        _thread.internal = self._previous
        return False


def _run_callback(fn, future) -> None:
    try:
        fn(future)
    except Exception:  # noqa: BLE001 - as concurrent.futures does
        log.exception("exception calling callback for %r", future)


def _run_callbacks(callbacks, future) -> None:
    first = FirstRaised(defer_interrupts=True)
    for fn in callbacks:
        first.run(_run_callback, fn, future)
    first.reraise()


class CallFuture(Future):
    """The Future of a submitted call.

    Done-callbacks never run on a thread the executor itself depends on: a
    callback may make colocated calls (or wait for other calls) without
    stalling the reply reading, heartbeat or timeout machinery.  Callbacks
    fired there run on one thread of their own, one after another in the
    order added; fired from a user thread (``add_done_callback`` on a done
    future, ``close``) they run inline, as with any Future.  A future with
    no callbacks costs no thread.
    """

    def __init__(self):
        super().__init__()
        self._callbacks: list = []
        self._callbacks_lock = threading.Lock()
        self._fired = False
        self._after: list = []      # after_callbacks functions not yet run
        self._running = False      # its callbacks' thread is running

    def add_done_callback(self, fn) -> None:
        with self._callbacks_lock:
            if not self._fired:
                self._callbacks.append(fn)
                return
        _run_callback(fn, self)  # done already: inline, as Future does

    def cancel(self) -> bool:
        """As Future's; the callbacks added run (Future's own list, which
        ``cancel`` runs, is not where they are kept)."""
        with self._condition:
            fire = self._state == "PENDING"
        if not super().cancel():
            return False
        if fire:
            self._fire()
        return True

    # (not a callback of its own: a bound method there would be a
    # reference cycle keeping every result alive until a cyclic collection)
    def set_result(self, result) -> None:
        super().set_result(result)
        self._fire()

    def set_exception(self, exception) -> None:
        super().set_exception(exception)
        self._fire()

    def after_callbacks(self, fn) -> None:
        """Run ``fn(self)`` once the future is done and the done-callbacks
        added before it was done have run (on their thread, or here)."""
        with self._callbacks_lock:
            if not self._fired or self._running:
                self._after.append(fn)
                return
        _run_callback(fn, self)

    def pass_after_callbacks(self, other) -> None:
        """Hand the after_callbacks functions not yet run to future
        ``other`` (one chained to this, completed by it), to run after its
        callbacks instead."""
        with self._callbacks_lock:
            after, self._after = self._after, []
        for fn in after:
            other.after_callbacks(fn)

    def _fire(self) -> None:
        with self._callbacks_lock:
            self._fired = True
            callbacks, self._callbacks = self._callbacks, []
            if callbacks and getattr(_thread, "internal", False):
                self._running = True
        if self._running:
            try:
                threading.Thread(target=self._run_all_on_own_thread,
                                 args=(callbacks,), daemon=True,
                                 name="jaxcolo-future-callbacks").start()
                return
            except RuntimeError:  # no thread to be had: run them here
                log.warning("no thread for a future's callbacks; running "
                            "them on %s", threading.current_thread().name)
        self._run_all(callbacks)

    def _run_all_on_own_thread(self, callbacks) -> None:
        try:
            self._run_all(callbacks)
        except SystemExit:  # a callback's sys.exit ends its thread only
            pass            # (as any thread's: quietly)

    def _run_all(self, callbacks) -> None:
        """The done-callbacks, then every after_callbacks function (all of
        them, whatever one raises)."""
        first = FirstRaised(defer_interrupts=True)
        first.run(_run_callbacks, callbacks, self)
        while True:
            with self._callbacks_lock:
                after, self._after = self._after, []
                if not after:
                    self._running = False
                    break
            first.run(_run_callbacks, after, self)
        first.reraise()
