"""Connecting to, losing and restarting a ProcessExecutor's hosts.

:class:`HostSet` is the part of ``ProcessExecutor`` that owns its links
(``self._links``, one :class:`HostLink` per host): starting local workers
and connecting to them, checking who owns which device, handing a call the
live link of a host (waiting for a restart in progress, or reconnecting to a
running worker), and reacting when a link reports its worker lost -- failing
the calls in flight there, retiring the whole cluster's links when local
workers form one, marking the instances that lived there, and restarting.

A multi-host call that fails on one host may leave its other hosts waiting
forever in a collective for the host that gave up, and every later
multi-host call behind them.  So such a call's other hosts get
``straggler_timeout`` seconds to finish; hosts still running it then are
lost (local workers: the cluster restarts).  Running workers cannot be
restarted from here: their cluster is marked wedged and later multi-host
calls fail at once until every worker process of the call was replaced.

It uses the executor's ``_lock``, ``_ready`` (cleared while a restart
runs), ``_pending``, ``_instances``/``_lost_instances`` and options; it is
a mixin, not a standalone object.
"""

from __future__ import annotations

import logging
import threading
import time

from jaxcolo import versions
from jaxcolo.errors import ExecutorError
from jaxcolo.process import launch
from jaxcolo.process.messages import MessageKind
from jaxcolo.process.multi_host_faults import WEDGED_ERROR, \
    collectives_broke, send_resumes
from jaxcolo.process.hosts import HostLink
from jaxcolo.process import lifetime
from jaxcolo.process.lifetime import weak
from jaxcolo.process.results import Call

log = logging.getLogger("jaxcolo.executor")
RESUME_SINCE = versions.FEATURE_SINCE["message_resume"]


class HostSet:
    # ----------------------------------------------------------- start-up
    def _connect(self, index, address, pid=None) -> HostLink:
        return HostLink(index, address, self._authkey, self._hello,
                        on_reply=weak(self._on_reply),
                        on_lost=weak(self._on_lost), pid=pid, **self._opts)

    def _start_local(self) -> None:
        workers = launch.start_workers(
            len(self._device_map), self._device_map, self._authkey,
            self._start_timeout, self._worker_args, self._worker_env,
            socket_dir=self._socket_dir)
        links = []
        try:
            for w in workers:
                links.append(self._connect(w.host_index, w.address, w.pid))
            if not lifetime.adopt(self._owned, workers, links):
                raise ExecutorError("the ProcessExecutor was released (at "
                                    "interpreter exit) while its workers "
                                    "started")
            self._workers, self._links = workers, links
            self._check_hosts()
        except BaseException:
            for link in links:
                link.close(shutdown=False)
            for w in reversed(workers):  # host 0, the coordinator, last
                w.kill()
            raise

    def _connect_all(self) -> None:
        """Connect to every running worker (``addresses``); on any failure
        close the links made (a worker serves one controller at a time)."""
        links = []
        try:
            for i, a in enumerate(self._addresses):
                links.append(self._connect(i, a))
            self._links = self._owned.links = links
            self._check_hosts()
        except BaseException:
            for link in links:
                link.close(shutdown=True)
            raise

    def _set_ready_unless_lost(self) -> list:
        """Open for calls unless a link was lost before (its loss, reported
        while not ready, started no restart); returns the lost links."""
        with self._lock:
            lost = [link for link in self._links if link.is_lost]
            if not lost:
                self._ready.set()
            return lost

    def _check_hosts(self) -> None:
        owner = {}
        for link in self._links:
            if link.peer.host_index != link.index and self._addresses is None:
                raise ExecutorError(f"worker at {link.address} says it is host "
                                    f"{link.peer.host_index}, expected "
                                    f"{link.index}")
            for i in link.device_ids:
                if i not in self._by_id:
                    raise ExecutorError(
                        f"{link.describe} owns device id {i}, which this "
                        "controller does not have")
                if i in owner:
                    raise ExecutorError(f"device id {i} is owned by hosts "
                                        f"{owner[i]} and {link.index}")
                owner[i] = link.index
        self._owner = owner
        self._version = min(link.version for link in self._links)

    def _link(self, h: int, limit=None) -> HostLink:
        """Host ``h``'s live link: waits for a restart in progress (local
        workers), reconnects (running workers).  ``limit``: the call's
        (deadline, timeout), if it has one: the wait ends there."""
        link = self._links[h]
        if not link.is_lost and self._ready.is_set():
            return link
        deadline = time.monotonic() + self._start_timeout
        if limit is not None and limit[0] < deadline:
            deadline = limit[0]
        else:
            limit = None
        while True:
            if self._closed:
                raise ExecutorError("ProcessExecutor is closed")
            link = self._links[h]
            ready = self._ready.is_set()
            if not link.is_lost and ready:
                return link
            if link.is_lost and ready:
                if self._addresses is not None:
                    return self._reconnect(h, link)
                if not self._restart:
                    raise ExecutorError(f"{link.describe} was lost (restart "
                                        f"is off): {link.loss_reason}")
                if self._restart_error is not None:
                    raise ExecutorError(
                        f"{link.describe} was lost and could not be "
                        f"restarted: {self._restart_error}")
            # a restart is running, or the loss is being reported
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if limit is not None:
                    raise ExecutorError(
                        f"call timed out after {limit[1]}s waiting for host "
                        f"{h} to restart; it was not sent")
                raise ExecutorError(f"host {h} is still restarting after "
                                    f"{self._start_timeout}s")
            if ready:
                time.sleep(0.005)
            else:
                self._ready.wait(remaining)

    def _cluster_links(self, hosts, call: Call, limit=None) -> list:
        """The links of every host of a multi-host call, all of one
        generation (a host lost now fails the whole call: no part of it may
        reach a restarted cluster while the other parts went to the old
        one)."""
        try:
            links = [(h, self._link(h, limit)) for h in hosts]
            self._check_not_wedged(links)
        except ExecutorError as e:
            call.fail(e)
            return []
        with self._lock:
            stale = [h for h, link in links
                     if link.is_lost or self._links[h] is not link]
        if stale:
            call.fail(ExecutorError(
                f"{call.plan.name}: host(s) {stale} were lost or restarted "
                "while the call was being sent; it was sent to none of its "
                "hosts"))
            return []
        return links

    # -------------------------------------------------------- stragglers
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

    # ------------------------------------------------------------ faults
    def _on_lost(self, link: HostLink, reason: str) -> None:
        with self._lock:
            if self._closed or link.index >= len(self._links) or \
                    self._links[link.index] is not link:
                return
            # a loss while not ready (starting, restarting) is found by
            # _set_ready_unless_lost: it must not start a second restart
            restart = (self._addresses is None and self._restart and
                       self._ready.is_set())
            self._stats["lost"] += 1
            cluster = self._addresses is None and len(self._links) > 1
            lost = [x for x in self._links if cluster or x is link]
            for other in lost:  # no call may start on them any more, and
                if other is not link:  # their own loss is not reported again
                    other.retire(f"its cluster went down with "
                                 f"{link.describe}, lost: {reason}")
            failed = [(cid, e) for cid, e in self._pending.items()
                      if e[2] in lost]
            for cid, (call, _, _) in failed:
                del self._pending[cid]
                if len(call.plan.hosts) > 1 and not call.abandoned:
                    # its other hosts may wait for this one's collectives
                    call.abandoned = True
                    self._holding.discard(call)
                    self._mark_wedged(call, f"{link.describe} was lost "
                                      f"while running {call.plan.name}")
            for call in list(self._holding):
                if any(held in lost for _, held in call.held) and \
                        not call.abandoned:  # its hold ends with the
                    call.abandoned = True    # session: others may join
                    self._mark_wedged(call, f"{link.describe}, holding "
                                      f"after {call.plan.name} failed "
                                      "there, was lost")
                    self._holding.discard(call)
            for iid, hosts in list(self._instances.items()):
                gone = {h for h in hosts if self._links[h] in lost}
                if gone:  # the other hosts' parts still get their destroy
                    self._instances[iid] = hosts - gone
                    self._lost_instances[iid] = f"{link.describe} was lost"
            if restart:
                self._ready.clear()
                self._restart_error = None
        log.warning("%s was lost: %s", link.describe, reason)
        for cid, (call, h, _) in failed:
            where = "" if self._links[h] is link else \
                f" (its cluster restarts: call on host {h} interrupted)"
            call.fail(ExecutorError(
                f"{link.describe} was lost while this call was in flight "
                f"({reason}){where}; the call was not retried"))
            if len(call.plan.hosts) > 1:  # (failed before, elsewhere)
                self._watch_stragglers(call)  # its other hosts' parts
                self._check_settled(call)
        for other in lost:
            if other is not link:
                other.discard()
        if restart:
            threading.Thread(target=self._restart_local, daemon=True,
                             name="jaxcolo-restart").start()

    def _restart_local(self, attempts: int = 3) -> None:
        error = None
        opened = False  # by _set_ready_unless_lost: a new loss may have
        try:            # cleared _ready since, for a restart of its own
            for _ in range(attempts):
                for w in reversed(self._workers):  # the coordinator last:
                    w.kill()  # (the others would log its loss as fatal)
                if self._closed or self._owned.released:
                    return
                try:
                    self._start_local()
                except Exception as e:  # noqa: BLE001 - try again
                    if self._owned.released:  # (its new workers stopped)
                        return
                    error = f"{type(e).__name__}: {e}"
                    log.error("could not restart the workers: %s", error)
                    continue
                lost = self._set_ready_unless_lost()
                if lost and self._owned.released:  # (the exit hook stopped
                    return                         # the new workers)
                if not lost:
                    opened = True
                    with self._lock:
                        self._stats["restarts"] += 1
                    log.warning("restarted %d worker(s)", len(self._links))
                    return
                error = f"{lost[0].describe} was lost as it started"
                log.error("restart failed: %s", error)
                for link in self._links:
                    link.retire(f"the restart failed: {error}")
                    link.discard()
            self._restart_error = error
        finally:
            if not opened:
                self._ready.set()

    def _reconnect(self, h: int, lost: HostLink) -> HostLink:
        """Connect to running worker ``h`` again, once for all callers, and
        without holding the executor's lock (other hosts keep working)."""
        started = time.monotonic()
        with self._reconnect_locks[h]:
            link = self._links[h]
            if link is not lost:
                return link
            failed = self._reconnect_failed.get(h)
            if failed is not None and failed[0] >= started:
                # another caller's attempt failed while this one waited
                raise ExecutorError(failed[1])
            try:
                link = self._connect(h, self._addresses[h])
            except ExecutorError as e:
                message = (f"{lost.describe} was lost and reconnecting "
                           f"failed: {e}")
                self._reconnect_failed[h] = (time.monotonic(), message)
                raise ExecutorError(message) from None
            with self._lock:
                if self._closed:
                    problem = "ProcessExecutor is closed"
                elif link.device_ids != lost.device_ids:
                    problem = (f"{link.describe} came back owning devices "
                               f"{list(link.device_ids)}, not "
                               f"{list(lost.device_ids)}")
                elif link.version < self._version:
                    problem = (f"{link.describe} came back speaking payload "
                               f"version {link.version}, older than this "
                               f"executor's {self._version}")
                else:
                    problem = None
                    self._links[h] = link
        if problem is not None:
            link.close(shutdown=False)
            raise ExecutorError(problem)
        return link
