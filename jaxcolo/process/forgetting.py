"""ProcessExecutor: forgetting the programs no function holds any more.

A program's plan (controller) and registration (each worker) stay while some
:class:`~jaxcolo.colocated.program.ProgramRef` of it lives (see
:mod:`jaxcolo.colocated.program_lifetimes`); at the executor's next call
after the last one is gone, the plan is dropped and each worker whose
session is at version 9 or later gets a ``forget`` message, so it drops the
decoded program and its loaded body (and whatever the body captured).
Workers of older sessions keep them until the session ends.
"""

from __future__ import annotations

import time

from jaxcolo import versions
from jaxcolo.errors import ExecutorError
from jaxcolo.process import messages
from jaxcolo.transport.writer import SendDeadline

FORGET_SINCE = versions.FEATURE_SINCE["message_forget"]


class ProgramForgetting:
    """Mixin of ProcessExecutor (``_links``, ``_lock``, ``_plans``,
    ``_lifetimes``)."""

    _forgets_unsent = False  # some link has forget ids not sent yet

    def _forget_unheld(self, wait: bool = False) -> bool:
        """Forget the programs no ProgramRef holds any more: their plans
        here, and their registrations on hosts whose session knows the
        ``forget`` message (v9).  Every host's register lock is held while
        the ids are decided (under the lifetimes lock) and their forgets
        sent; a forget is sent only if its connection is free now (one
        busy with another send -- a slow or stalled host -- keeps its ids,
        ``link.forget_unsent``, for a later call, so no call waits on
        another host's connection), and a registration takes its id out of
        them under the same lock: a program made again is registered after
        its forget, never before one.  Skipped (tried at a later call)
        while another thread registers, unless ``wait`` (then it waits
        for the locks, taken in order; each holder holds only its own).
        Whether it ran."""
        links = list(self._links)
        taken = []
        try:
            for link in links:
                if not link.register_lock.acquire(blocking=wait):
                    return False
                taken.append(link.register_lock)

            def apply(ids):
                with self._lock:
                    for pid in ids:
                        self._plans.pop(pid, None)
                for link in links:
                    if link.version >= FORGET_SINCE:
                        gone = [p for p in ids if p in link.registered]
                        if gone:
                            link.registered.difference_update(gone)
                            link.forget_unsent.update(gone)
            if self._lifetimes.pending():
                self._lifetimes.take(apply)
            unsent = False
            for link in links:
                if not link.forget_unsent or link.is_lost:
                    continue
                gone = sorted(link.forget_unsent)
                try:
                    link.send(messages.Message(messages.MessageKind.forget,
                                               forgotten=gone),
                              deadline=time.monotonic())
                except SendDeadline as e:
                    if not e.started:  # nothing went out: a later call
                        unsent = True
                        continue
                except ExecutorError:  # lost: its programs went with it
                    pass
                link.forget_unsent.difference_update(gone)
            self._forgets_unsent = unsent
            return True
        finally:
            for lock in taken:
                lock.release()
