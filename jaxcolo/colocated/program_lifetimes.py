"""Which programs are still wanted, so executors can forget the others.

A colocated function's specialisations hold their programs
(:class:`~jaxcolo.colocated.program.ProgramRef`), and so does a call in
flight.  Executors keep what they derive from a program (its decoded specs,
its loaded body with whatever the body captured) under the program's content
id.  Once no ProgramRef of an id is alive any more -- the function was
dropped, or ``jax.clear_caches()`` dropped its specialisations -- nothing
can call that program again, and each executor forgets it at its next call.
Payloads are content-addressed, so two functions may hold the same id: it
is forgotten when the last one goes, and an id that comes back (an equal
function made later) is registered again, afresh (its body loaded anew:
what the dead one's body captured and changed is not carried over).

:func:`hold` counts a ProgramRef while it lives.  Its finalizer only
appends the id to a queue (it may run in any thread, at any allocation,
even inside this module's own critical section); the counting happens in
:meth:`Subscription.take`, under the lock, called by executors where they
choose.
"""

from __future__ import annotations

import collections
import threading
import weakref

_LOCK = threading.Lock()
_LIVE: dict[bytes, int] = {}      # program id -> ProgramRefs alive
_DIED: collections.deque = collections.deque()  # ids of refs collected
_SUBSCRIBERS: "weakref.WeakSet[Subscription]" = weakref.WeakSet()


def hold(ref):
    """Count ``ref`` (a ProgramRef) until it is collected; returns it.
    Deaths queued before are counted first: an equal function made after
    the last one of its id died is a new program to the executors (they
    forget the dead one's, its loaded body and state with it), never the
    dead one's continued."""
    with _LOCK:
        _count_deaths()
        _LIVE[ref.id] = _LIVE.get(ref.id, 0) + 1
    weakref.finalize(ref, _DIED.append, ref.id)
    return ref


def _count_deaths() -> None:
    """(Under _LOCK.)  Apply the queued deaths; an id whose last ref died
    goes to every subscriber."""
    while _DIED:
        pid = _DIED.popleft()
        n = _LIVE.get(pid, 0) - 1
        if n > 0:
            _LIVE[pid] = n
            continue
        _LIVE.pop(pid, None)
        for sub in list(_SUBSCRIBERS):
            if pid in sub._known:  # only executors that hold something
                sub._known.discard(pid)  # of it are told
                sub._gone.append(pid)


class Subscription:
    """An executor's view: the ids nothing holds any more, once each."""

    __slots__ = ("_gone", "_known", "__weakref__")

    def __init__(self):
        self._gone: collections.deque = collections.deque()
        self._known: set = set()  # ids this executor keeps something of
        with _LOCK:
            _SUBSCRIBERS.add(self)

    def note(self, program_id: bytes) -> None:
        """The executor now keeps something of ``program_id`` (called while
        a ProgramRef of it is alive: the caller's)."""
        self._known.add(program_id)

    def unnote(self, program_ids) -> None:
        """The executor keeps nothing of these any more (forgotten when told
        to, e.g. a worker's programs, whose refs are not counted here)."""
        self._known.difference_update(program_ids)

    def pending(self) -> bool:
        """Cheap check (no lock): may ``take`` return something?"""
        return bool(_DIED or self._gone)

    def take(self, apply=None) -> list:
        """The ids to forget now: every ref of them died since this
        executor noted them -- also those made again since (what it keeps
        is the dead ones': an equal function made later starts afresh, as
        JAX's does; it is registered again).  ``apply(ids)``, if given,
        runs under the lock."""
        with _LOCK:
            _count_deaths()
            ids = list(self._gone)
            self._gone.clear()
            if ids and apply is not None:
                apply(ids)
        return ids

    def is_gone(self, program_id: bytes) -> bool:
        """Whether ``take`` would return ``program_id`` now (every ref of
        it died since this executor noted it)."""
        with _LOCK:
            _count_deaths()
            return program_id in self._gone

    def close(self) -> None:
        """Stop collecting ids (a closed executor)."""
        with _LOCK:
            _SUBSCRIBERS.discard(self)
            self._gone.clear()
            self._known.clear()
