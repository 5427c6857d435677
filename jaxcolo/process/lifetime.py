"""A ProcessExecutor dropped without ``close()``.

The executor's long-lived threads (each link's reader and watchdog, the
deadline and destroy threads) call back into it through :func:`weak`
references only, so an executor nobody holds any more is collected; then
:func:`release` -- a ``weakref.finalize`` of the executor, which holds the
executor's resources but not the executor -- shuts its workers and threads
down, as ``close()`` would (submitted calls in flight cannot exist: they
hold the executor until they are done, :func:`hold_until_done`).  At
interpreter exit, :func:`_release_at_exit` releases every executor not yet
released, on the main thread.  The
shutdown steps ``close()`` shares with it live here too
(:func:`shut_down_hosts`, :func:`once`).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from concurrent.futures import Future

from jaxcolo.errors import ExecutorError

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
    workers (replaced on a restart), threads, the SIGINT handler token.
    ``released``: the shutdown was claimed (:func:`claim`) by ``close()``,
    the finalizer or the exit hook; ``done`` is set once it finished."""

    __slots__ = ("links", "workers", "deadlines", "destroys", "sigint",
                 "socket_dir", "released", "lock", "done", "claimer")

    def __init__(self):
        self.links = []
        self.workers = []
        self.deadlines = self.destroys = self.sigint = self.socket_dir = None
        self.released = False
        self.lock = threading.Lock()  # (never held while allocating much)
        self.done = threading.Event()
        self.claimer = None  # the thread ident that claimed the shutdown


# Seconds a shutdown claimed by another thread is waited for (it waits for
# the workers: at most twice WORKER_EXIT_WAIT, then kills them).
RELEASE_WAIT = 30.0


def claim(owned: Owned) -> bool:
    """True for the first caller only: it shuts down what ``owned`` lists,
    then sets ``owned.done`` (``close()``, the finalizer and the exit hook
    may race at exit; the others wait for ``done``)."""
    me = threading.get_ident()
    with owned.lock:
        if owned.released:
            return False
        owned.released = True
        owned.claimer = me
        return True


def wait_released(owned: Owned) -> None:
    """Return once the shutdown another caller claimed has finished (at
    most RELEASE_WAIT seconds); at once on the claiming thread itself (a
    finalizer calling close() inside the claimer's own steps)."""
    if owned.claimer != threading.get_ident():
        owned.done.wait(RELEASE_WAIT)


def adopt(owned: Owned, workers, links) -> bool:
    """Make freshly started ``workers`` and their ``links`` what ``owned``
    lists (a start or restart); False, recording nothing, if ``owned`` was
    released meanwhile (the exit hook ran while a restart started them):
    the caller must shut them down itself."""
    with owned.lock:
        if owned.released:
            return False
        owned.workers, owned.links = workers, links
        return True


# Started workers get this long to exit (together) after their shutdown
# message; then they are killed.
WORKER_EXIT_WAIT = 5.0


def shut_down_hosts(links, workers) -> None:
    """Tell every host to exit, and wait for the workers started here.
    Host 0 runs the jax.distributed coordinator of a local cluster: it
    goes last, once the others have exited (a worker still up when the
    coordinator vanished logged a fatal error and aborted)."""
    links, workers = list(links), list(workers)
    if len(workers) != len(links) or len(links) < 2:
        groups = [(links, workers)]
    else:
        groups = [(links[1:], workers[1:]), (links[:1], workers[:1])]
    for group_links, group_workers in groups:
        for link in group_links:
            link.close(shutdown=True)
        deadline = time.monotonic() + WORKER_EXIT_WAIT  # all at once:
        for w in group_workers:  # then the ones still up are killed
            w.stop(max(0.0, deadline - time.monotonic()))


def once(fn, *args):
    """``fn(*args)`` as a callable that runs it at most once (thread safe)."""
    lock = threading.Lock()
    pending = [True]

    def call() -> None:
        with lock:
            if not pending[0]:
                return
            pending[0] = False
        fn(*args)
    return call


# Executors with submitted calls in flight: id -> [executor, calls].  A
# root, not a cycle: an executor its user dropped finishes the calls
# submitted to it (as a ThreadPoolExecutor does), then is freed.
_SUBMITTED: dict = {}
_SUBMITTED_LOCK = threading.Lock()
_SUBMITTED_NONE = threading.Condition(_SUBMITTED_LOCK)  # _SUBMITTED empty
_EXITING = False  # interpreter exit began: no new submitted calls


def check_not_exiting() -> None:
    """ExecutorError once interpreter exit has begun waiting for the calls
    submitted before it (new ones are refused, so that wait ends)."""
    if _EXITING:
        raise ExecutorError("the interpreter is exiting: no new calls are "
                            "submitted (those submitted before finish)")


def hold_until_done(executor, future) -> None:
    """Keep ``executor`` alive until ``future`` (of a call submitted to it)
    is done and its done-callbacks have run."""
    key = id(executor)
    with _SUBMITTED_LOCK:
        entry = _SUBMITTED.get(key)
        if entry is None:
            _SUBMITTED[key] = [executor, 1]
        else:
            entry[1] += 1

    def done(_) -> None:
        with _SUBMITTED_LOCK:
            entry = _SUBMITTED[key]
            entry[1] -= 1
            if entry[1] == 0:
                del _SUBMITTED[key]
                if not _SUBMITTED:
                    _SUBMITTED_NONE.notify_all()
        # (the executor may be freed here, when entry goes: not under the
        # lock, which its release may need)
    after = getattr(future, "after_callbacks", None)
    if after is not None:  # a CallFuture: once its callbacks have run
        after(done)
    else:
        Future.add_done_callback(future, done)  # inline, where it completes


# Executors not yet released (nor closed): id(owned) -> (finalizer, owned).
# Taking an entry out, under the lock, is what claims a release: the
# finalizer, close() or the exit hook, whichever comes first.  Nothing is
# allocated under the lock (an allocation may start a garbage collection
# that runs a finalizer), and it is reentrant all the same (on Python
# 3.12+ a collection may run at any bytecode boundary).
_LIVE: dict = {}
_LIVE_LOCK = threading.RLock()

# Releases claimed by finalizers on threads other than the main one run
# on one long-lived thread, fed through a SimpleQueue (whose put is safe
# in a finalizer): starting a thread from a finalizer could deadlock in
# the threading module's own locks.  The exit hook drains and joins it.
_QUEUE: queue.SimpleQueue = queue.SimpleQueue()
_RELEASER: list = []  # the releaser thread, once started
_RELEASER_LOCK = threading.Lock()  # (never taken by a finalizer)


def finalizer(executor, owned: Owned) -> weakref.finalize:
    """The finalizer releasing ``owned`` once ``executor`` is collected,
    or at interpreter exit (:func:`_release_at_exit`) if it is not.
    Called by the executor's constructor (never by a finalizer)."""
    with _RELEASER_LOCK:
        if not _RELEASER:
            thread = threading.Thread(target=_run_releases, daemon=True,
                                      name="jaxcolo-release")
            thread.start()
            _RELEASER.append(thread)
    fin = weakref.finalize(executor, release, owned)
    # Not at exit through weakref's own exit hook, which runs before
    # _release_at_exit (registered earlier) and would shut the executor
    # down under the calls submitted to it: _release_at_exit does it.
    fin.atexit = False
    entry = (fin, owned)
    with _LIVE_LOCK:
        _LIVE[id(owned)] = entry
    return fin


def detach(fin: weakref.finalize, owned: Owned) -> None:
    """``executor.close()`` releases ``owned`` itself: the finalizer will
    not."""
    fin.detach()
    with _LIVE_LOCK:
        _LIVE.pop(id(owned), None)


def release(owned: Owned) -> None:
    """The finalizer: ``release_now`` on the main thread (at interpreter
    exit, say), else on the releaser thread -- a collection may run on one
    of the executor's threads while it holds a lock the shutdown needs.
    A release the exit hook (or close()) claimed first is left to it."""
    with _LIVE_LOCK:
        claimed = _LIVE.pop(id(owned), None) is not None
    if not claimed:
        return
    if threading.current_thread() is threading.main_thread():
        release_now(owned)
    else:
        _QUEUE.put(owned)


def _run_releases() -> None:
    """The releaser thread: release what finalizers queued, until None."""
    while True:
        owned = _QUEUE.get()
        if owned is None:
            return
        release_now(owned)
        del owned


def _wait_for_submitted_calls() -> None:
    """Refuse new submitted calls, then wait until every call submitted to
    any executor is done and its callbacks have run (as a
    ThreadPoolExecutor's exit hook waits for its work items); Ctrl-C stops
    waiting (the release then fails the calls left)."""
    global _EXITING
    try:
        with _SUBMITTED_LOCK:
            _EXITING = True
            while _SUBMITTED:
                _SUBMITTED_NONE.wait(1.0)
    except KeyboardInterrupt:
        pass


def _release_at_exit() -> None:
    """At interpreter exit, on the main thread: wait for the calls
    submitted to executors (they finish, their futures' callbacks run),
    then release every executor not yet released -- still held, held only
    for its submitted calls, or about to be freed on a daemon reader thread
    whose call just completed (its release would start after exit stopped
    waiting for threads, and be cut short) -- and wait for the releases
    already queued."""
    global _LIVE
    _wait_for_submitted_calls()
    fresh: dict = {}
    with _LIVE_LOCK:
        claimed, _LIVE = _LIVE, fresh
    for fin, owned in claimed.values():
        fin.detach()
        release_now(owned)
    del claimed
    if _RELEASER:
        _QUEUE.put(None)
        _RELEASER[0].join(60)


atexit.register(_release_at_exit)


def release_now(owned: Owned) -> None:
    """Shut down what ``owned`` lists, unless that was claimed already
    (never raises: a finalizer)."""
    if not claim(owned):  # close() on another thread does it: at exit,
        wait_released(owned)  # the interpreter waits for it
        return
    shut_down(owned, keep_going=True)


def shut_down(owned: Owned, *, keep_going: bool) -> None:
    """Shut down what ``owned`` lists (the caller claimed it), then set
    ``owned.done``.  ``keep_going``: a failing step is logged and the rest
    still run (a finalizer must not raise); else the first failure raises
    (``close()``)."""
    from jaxcolo.transport import interrupts
    try:
        steps = [getattr(owned.destroys, "close", None),
                 getattr(owned.deadlines, "close", None),
                 lambda: shut_down_hosts(owned.links, owned.workers),
                 owned.socket_dir,
                 lambda: interrupts.uninstall(owned.sigint)]
        for step in steps:
            if step is None:
                continue
            if not keep_going:
                step()
                continue
            try:
                step()
            except Exception:  # noqa: BLE001 - the rest must still go
                log.exception("releasing a ProcessExecutor that was not "
                              "closed")
    finally:
        owned.done.set()
