"""Settling multi-host calls, and what a failed one does to its other hosts.

:class:`MultiHostSettling` is the part of ``ProcessExecutor`` that follows
a multi-host call's parts until the call is *settled* (done, every part
sent, none running), so its thread's next calls may go.

A multi-host call that fails on one host may leave its other hosts waiting
forever in a collective for the host that gave up, and every later
multi-host call behind them.  So such a call's other hosts get
``straggler_timeout`` seconds to finish; hosts still running it then are
lost (local workers: the cluster restarts).  A failed part's host (v7
sessions) holds its next multi-host calls until resumed, once the call is
done everywhere.  Running workers cannot be restarted from here: their
cluster is marked wedged and later multi-host calls fail at once until
every worker process of the call was replaced.

It uses the executor's ``_lock``, ``_pending``, ``_links``, ``_holding``,
``_unheld``, ``_wedged``, ``_deadlines`` and options; it is a mixin, not a
standalone object.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref

from jaxcolo import versions
from jaxcolo.errors import ExecutorError
from jaxcolo.process.messages import MessageKind
from jaxcolo.process.multi_host_faults import WEDGED_ERROR, \
    collectives_broke, send_resumes
from jaxcolo.process.results import Call

log = logging.getLogger("jaxcolo.executor")
RESUME_SINCE = versions.FEATURE_SINCE["message_resume"]


class MultiHostSettling:
    def _multi_host_reply(self, call: Call, call_id: int, link, m) -> None:
        """Host reply ``m`` to part ``call_id`` of multi-host ``call`` was
        taken.  A failed part's host holds its next multi-host calls (v7
        sessions) until resumed; the other hosts get ``straggler_timeout``
        seconds to be done with the call."""
        failed = m.kind == MessageKind.error
        if failed and collectives_broke(m):
            self._lose_out_of_step(call, link, m)
        elif failed and m.error_type == WEDGED_ERROR:  # (running workers)
            with self._lock:
                self._mark_wedged(call, f"{link.describe}: "
                                  f"{(m.error_message or '')[:300]}")
        if failed:
            with self._lock:
                if link.version >= RESUME_SINCE and not call.abandoned:
                    call.held.append((call_id, link))
                    self._holding.add(call)
                elif not call.abandoned:  # a host that cannot hold (v<7):
                    self._unheld.add(call)  # the controller holds for it
            self._watch_stragglers(call)
        self._settle_multi_host(call, sent=False)
        self._check_settled(call)

    def _lose_out_of_step(self, call: Call, link, m) -> None:
        """A part of multi-host ``call`` failed in its collectives (a gloo
        communicator that timed out waiting for a host that gave up): that
        host set up state its peers did not, so their next collectives
        would pair wrongly or hang.  Local workers: the cluster restarts
        (the calls in flight there fail); running workers: their cluster
        is marked wedged."""
        with self._lock:
            if self._closed or call.abandoned:
                return
            call.abandoned = True  # no host of it is resumed
            self._holding.discard(call)
            reason = (f"{call.plan.name} failed in a collective on "
                      f"{link.describe} ({m.error_type}: "
                      f"{(m.error_message or '')[:200]}); the hosts' "
                      "collectives are out of step")
            self._mark_wedged(call, reason)
        log.warning("%s: %s", "the cluster restarts" if self._addresses
                    is None else "the running workers' cluster is wedged",
                    reason)
        if self._addresses is None:
            link.lost(reason)  # its cluster with it

    def _check_settled(self, call: Call) -> None:
        """Settle multi-host ``call`` (its thread's later calls may go,
        ``Call.when_settled``) once it is done, every part was sent and no
        part runs any more -- or, timed out, once every part was sent (a
        timed-out call may still run; its thread does not wait for it)."""
        with self._lock:
            if call.settled or call.sending or not call.future.done():
                return
            if not call.timed_out and any(
                    c in self._pending for c in call.call_ids):
                return
            self._unheld.discard(call)  # (not kept until the next send)
        call.settle()

    def _sent_multi_host(self, call: Call) -> None:
        """The send loop of multi-host ``call`` ended.  Sent to some of its
        hosts only (a failed send, Ctrl-C), with a part still running: that
        host may wait in a collective the others never join, and they have
        no hold, so their next call would join it -- the hosts are lost at
        once (local: a restart; running workers: wedged)."""
        with self._lock:
            running = [(h, link) for cid, (h, link) in
                       zip(call.call_ids, call.links)
                       if cid in self._pending and not link.is_lost]
            partial = (call.sent_parts < len(call.plan.hosts) and running
                       and not call.abandoned)
            if partial:
                call.abandoned = True
                self._holding.discard(call)
                reached = {h for h, _ in call.links}
                lost = [h for h in call.plan.hosts if h not in reached and
                        h < len(self._links) and self._links[h].is_lost]
                reason = (f"{call.plan.name} reached host(s) "
                          f"{[h for h, _ in running]} but not all of its "
                          "hosts" + (f", as host(s) {lost} were lost" if lost
                                     else "") +
                          " (their collectives would pair with the next "
                          "call's)")
                self._mark_wedged(call, reason)
        if partial:
            log.warning("%s", reason)
            with self._lock:
                call.sending = False
            for _, link in running:
                link.lost(reason)
            self._check_settled(call)
            return
        if call.future.done():  # failed: parts still running may wait in
            self._watch_stragglers(call)  # collectives for the others
        self._settle_multi_host(call)
        self._check_settled(call)

    def _wait_for_unheld_failures(self, call: Call) -> None:
        """(Sending multi-host ``call``, under ``_ordered_lock``.)  While a
        multi-host call that failed on a host that cannot hold (a session
        before v7) still runs on another host, that one may wait in a
        collective the failed host never joins: the failed host's next
        multi-host call would pair with it (wrong results) -- so no
        multi-host call is sent until it is done, or its hosts are lost
        (``straggler_timeout``), or ``call`` timed out."""
        while True:
            with self._lock:
                self._unheld = {c for c in self._unheld if not c.settled}
                if not self._unheld or self._closed or call.timed_out or \
                        call.future.done():
                    return
            time.sleep(0.002)

    def _hosts_can_hold(self, hosts) -> bool:
        """Whether every one of ``hosts`` holds its next multi-host calls
        after a part fails there (a session of v7 or later)."""
        links = self._links
        return all(links[h].version >= RESUME_SINCE for h in hosts)

    def _note_multi_host_sent(self, call: Call) -> None:
        """(Under ``_ordered_lock``.)  ``call`` is the last multi-host call
        sent to the hosts it reached (weakly: once it is gone, none of its
        parts is pending)."""
        ref = weakref.ref(call)
        with self._lock:
            for h, _ in call.links:
                self._last_multi_host[h] = ref

    def _wait_for_earlier_multi_host(self, call: Call) -> None:
        """(Sending multi-host ``call`` in a session where one of its hosts
        cannot hold (before v7), under ``_ordered_lock``.)  A host that
        fails a multi-host call before its collectives would run the next
        one sent to it at once, while the others still wait in the failed
        one's collectives: the two would pair (wrong results, then a hang).
        The failure may come only after later calls were sent, so none is
        sent until the multi-host calls sent before it to its hosts are done
        on all of theirs (or their hosts lost, ``straggler_timeout``), or
        ``call`` timed out or failed."""
        while True:
            with self._lock:
                earlier = {}
                for h in call.plan.hosts:
                    ref = self._last_multi_host.get(h)
                    c = None if ref is None else ref()
                    if c is not None:
                        earlier[id(c)] = c
                running = [link for c in earlier.values()
                           for cid, (_, link) in zip(c.call_ids, c.links)
                           if cid in self._pending]
                if not running or self._closed or call.timed_out or \
                        call.future.done():
                    return
            for link in running:  # (their replies: read in the background
                link.kick()       # unless a caller reads them)
            time.sleep(0.002)

    def _settle_multi_host(self, call: Call, sent: bool = True) -> None:
        """Resume the hosts holding for ``call`` once every part of it was
        sent and none is running any more (never for an abandoned call)."""
        with self._lock:
            if sent:
                call.sending = False
            if not call.held or call.sending or call.abandoned or any(
                    c in self._pending for c in call.call_ids):
                return
            resume, call.held = call.held, []
            self._holding.discard(call)
        # not on this (reader) thread: a held link may be busy sending
        with self._lock:
            self._resuming += 1
        try:
            threading.Thread(target=self._send_resumes, args=(resume,),
                             daemon=True, name="jaxcolo-resume").start()
        except RuntimeError:  # no thread (interpreter exit): none to send
            with self._lock:
                self._resuming -= 1

    def _send_resumes(self, resume) -> None:
        try:
            send_resumes(resume)
        finally:
            with self._lock:
                self._resuming -= 1

    def _settle_holds(self, limit: float) -> None:
        """(At close, running workers.)  Give the multi-host calls a host
        holds after (they failed there) up to ``limit`` seconds to be done
        on every host, and their resumes to go out: a worker whose session
        ends holding refuses later controllers' multi-host calls for good
        (jaxcolo.process.wedge).  A call fails for its caller at its first
        host's error, so closing right after one is common."""
        if getattr(self, "_addresses", None) is None or \
                not hasattr(self, "_holding"):
            return  # local workers end with the executor (or not started)
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            with self._lock:
                if not (self._holding or self._resuming):
                    return
            time.sleep(0.005)

    def _watch_stragglers(self, call: Call) -> None:
        """``call`` (multi-host) failed on one of its hosts: lose the hosts
        still running it ``straggler_timeout`` seconds from now."""
        if self._straggler_timeout is None or self._closed or call.watched \
                or call.sending:  # (_sent_multi_host watches it after)
            return
        call.watched = True  # (held weakly: once no part runs, it may go)
        self._deadlines.check(call, self._straggler_timeout)

    def _check_stragglers(self, call: Call) -> None:
        with self._lock:
            if self._closed:
                return
            stuck = [(h, link) for cid, (h, link) in
                     zip(call.call_ids, call.links) if cid in self._pending
                     and not link.is_lost]
            if not stuck:
                return
            call.abandoned = True  # a held host runs no collective again
            self._holding.discard(call)
            hosts = [h for h, _ in stuck]
            reason = (f"host(s) {hosts} still ran {call.plan.name} "
                      f"{self._straggler_timeout}s after it failed or timed "
                      "out (if waiting in a collective for a host that gave "
                      "up, they never finish)")
            self._mark_wedged(call, reason)
        log.warning("%s: %s", "the cluster restarts" if self._addresses
                    is None else "the running workers' cluster is wedged",
                    reason)
        for _, link in stuck:
            link.lost(reason)

    def _mark_wedged(self, call: Call, reason: str) -> None:
        """(Under ``_lock``.)  Running workers: the processes of ``call``
        take no multi-host call any more (until replaced)."""
        if self._addresses is not None:
            for _, link in call.links:
                if link.pid:
                    self._wedged.setdefault((link.address, link.pid), reason)

    def _check_not_wedged(self, links) -> None:
        """ExecutorError if a multi-host call would reach a worker process
        of a wedged cluster (running workers)."""
        for _, link in links:
            reason = self._wedged.get((link.address, link.pid)) \
                if link.pid else None
            if reason is not None:
                raise ExecutorError(
                    f"the running workers' jax.distributed cluster is "
                    f"wedged: {reason}; restart every worker process (a "
                    "ProcessExecutor reconnects), multi-host calls fail "
                    "until then")
