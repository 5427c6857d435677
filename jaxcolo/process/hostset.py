"""Connecting to, losing and restarting a ProcessExecutor's hosts.

:class:`HostSet` is the part of ``ProcessExecutor`` that owns its links
(``self._links``, one :class:`HostLink` per host): starting local workers
and connecting to them, checking who owns which device, handing a call the
live link of a host (waiting for a restart in progress, or reconnecting to a
running worker), and reacting when a link reports its worker lost -- failing
the calls in flight there, retiring the whole cluster's links when local
workers form one, marking the instances that lived there, and restarting.

What a multi-host call that failed on one host does to the others is
``jaxcolo.process.stragglers``.

It uses the executor's ``_lock``, ``_ready`` (cleared while a restart
runs), ``_pending``, ``_instances``/``_lost_instances`` and options; it is
a mixin, not a standalone object.
"""

from __future__ import annotations

import logging
import threading
import time

from jaxcolo.errors import ExecutorError
from jaxcolo.process import launch
from jaxcolo.process.hosts import HostLink
from jaxcolo.process import lifetime
from jaxcolo.process.lifetime import weak
from jaxcolo.process.results import Call

log = logging.getLogger("jaxcolo.executor")


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

    def _link_wait(self, h: int) -> str:
        """What waiting in ``_link(h)`` waits for (named when a call times
        out there before it was sent)."""
        return (f"host {h} to restart" if self._addresses is None
                else f"a new connection to host {h}")

    def _cluster_links(self, hosts, call: Call, limit=None) -> list:
        """The links of every host of a multi-host call, all of one
        generation (a host lost now fails the whole call: no part of it may
        reach a restarted cluster while the other parts went to the old
        one)."""
        try:
            links = []
            for h in hosts:
                call.waits_for = self._link_wait(h)
                links.append((h, self._link(h, limit)))
            call.waits_for = None
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
