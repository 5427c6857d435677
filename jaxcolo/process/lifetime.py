"""A ProcessExecutor dropped without ``close()``.

The executor's long-lived threads (each link's reader and watchdog, the
deadline and destroy threads) call back into it through :func:`weak`
references only, so an executor nobody holds any more is collected; then
:func:`release` -- a ``weakref.finalize`` of the executor, which holds the
executor's resources but not the executor -- shuts its workers and threads
down, as ``close()`` would (calls in flight cannot exist: their futures
hold the executor until they are done, ``CallFuture.keep``).  The same
finalizer runs at interpreter exit for an executor still open then.
"""

from __future__ import annotations

import logging
import weakref

log = logging.getLogger("jaxcolo.executor")


def weak(method):
    """``method`` (bound) called through a weak reference to its object;
    once the object is gone, calls do nothing and return None."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)
    return call


class Owned:
    """What an executor owns, for its finalizer: the current links and
    workers (replaced on a restart), threads, the SIGINT handler token."""

    __slots__ = ("links", "workers", "deadlines", "destroys", "sigint",
                 "socket_dir")

    def __init__(self):
        self.links = []
        self.workers = []
        self.deadlines = self.destroys = self.sigint = self.socket_dir = None


def release(owned: Owned) -> None:
    """The finalizer: ``release_now`` on the main thread (at interpreter
    exit, say), else on a thread of its own -- a collection may run on one
    of the executor's threads while it holds a lock the shutdown needs."""
    import threading
    if threading.current_thread() is threading.main_thread():
        release_now(owned)
    else:
        threading.Thread(target=release_now, args=(owned,),
                         name="jaxcolo-release").start()


def release_now(owned: Owned) -> None:
    """Shut down what ``owned`` lists (never raises: a finalizer)."""
    from jaxcolo.transport import interrupts
    steps = [getattr(owned.destroys, "close", None),
             getattr(owned.deadlines, "close", None)]
    steps += [lambda link=link: link.close(shutdown=True)
              for link in owned.links]
    steps += [w.stop for w in owned.workers]
    steps += [owned.socket_dir, lambda: interrupts.uninstall(owned.sigint)]
    for step in steps:
        if step is None:
            continue
        try:
            step()
        except Exception:  # noqa: BLE001 - the rest must still go
            log.exception("releasing a ProcessExecutor that was not closed")
