"""Program order of a lane's calls across hosts, on the controller.

A lane (one caller thread) runs its calls in program order.  A worker keeps
that order among the calls it gets (``jaxcolo.process.lanes``), but two
hosts know nothing of each other: a call submitted to host 1 after one still
running on host 0 would start at once.  :class:`LaneOrder` holds such a call
back on the controller until the lane's calls in flight are done.

Contract: at any time a lane's calls in flight all run on one and the same
set of hosts (their workers order them).  A call for that host set (or of a
lane with nothing in flight) is sent at once by its caller; any other call
is *deferred*, as is every call behind a deferred one.  Once the lane's
calls in flight are all done (replied, failed or timed out; a multi-host
call that failed on one host is done once no host runs it any more, and
one that timed out once all its parts were sent: ``Call.when_settled``),
a thread sends
the deferred calls, oldest first, for as long as they are for the host set
of the calls it sent (or those are done).  A deferred call holds its own
copies of its arguments (``keep``), taken before its caller goes on: an
input deleted or donated after ``submit`` returned costs it nothing, as a
call sent at once (its inputs copied as they are sent).  It keeps its
deadline (it may time out while it waits; it is then not sent, and its
arguments are let go), and ``close(error)`` fails the calls still deferred.
A synchronous single-host call of a lane with nothing in flight costs one
dict lookup: it is sent at once and not counted (its thread waits for it
before making another call).
"""

from __future__ import annotations

import collections
import logging
import threading
from concurrent.futures import Future
from typing import Callable

from jaxcolo.colocated.executor import FirstRaised
from jaxcolo.colocated.futures import executor_thread

log = logging.getLogger("jaxcolo.executor")


MAX_IDLE_LANES = 1024  # idle lane states kept before a sweep


class _Lane:
    __slots__ = ("hosts", "unfinished", "deferred", "pumping")

    def __init__(self, hosts):
        self.hosts = hosts          # the host set of the calls in flight
        self.unfinished = 0         # calls in flight (counted ones)
        # [call, args, lane_id, limit, copied (Event, or None)]
        self.deferred = collections.deque()
        self.pumping = False        # a thread is sending deferred calls

    def idle(self) -> bool:
        return not (self.unfinished or self.deferred or self.pumping)


class LaneOrder:
    """``dispatch(call, args, lane_id, limit)`` sends a call; it must fail
    the call (not raise) on any error of its own.  ``keep(args)``: copies
    of a deferred call's arguments that later changes to them (deletion,
    donation) do not touch."""

    def __init__(self, dispatch: Callable, keep: Callable | None = None):
        self._dispatch = dispatch
        self._keep = keep
        self._lock = threading.Lock()
        self._lanes: dict = {}
        self._closed = None  # the error deferred calls fail with at close

    def admit(self, call, args, lane_id: int, limit, sync: bool = False
              ) -> bool:
        """True: send ``call`` now (the caller does).  False: it was
        deferred, and will be sent (or failed) by this object.  ``sync``:
        the caller waits for this call's result before its next call, so a
        single-host call admitted at once is not counted."""
        hosts = call.plan.hosts
        # A multi-host call may still run on some hosts after its result
        # (an error from another host): counted even when synchronous.
        counted = not sync or len(hosts) > 1
        lane = self._lanes.get(lane_id)
        if not counted and (lane is None or lane.idle()):
            return True  # (only this lane's own thread makes it busy)
        entry = None
        with self._lock:
            lane = self._lanes.get(lane_id)
            if lane is None:
                lane = self._lanes[lane_id] = _Lane(hosts)
            wait = lane.deferred or lane.pumping or (
                lane.unfinished and lane.hosts != hosts)
            if not wait:
                lane.hosts = hosts
                if counted:
                    lane.unfinished += 1
            elif self._closed is None:  # [4]: set once its copies are in
                entry = [call, args, lane_id, limit,
                         threading.Event() if self._keep else None]
                lane.deferred.append(entry)
        if entry is not None:  # failed while it waits (a timeout): its
            Future.add_done_callback(  # arguments are not kept
                call.future, lambda _: entry.__setitem__(1, None))
            self._keep_copies(entry, args)
            return False
        if wait:  # closed: it would never be sent
            call.fail(self._closed)
            return False
        if counted:
            self._count(call, lane)
        return True

    def _keep_copies(self, entry, args) -> None:
        """Have deferred ``entry`` hold copies of ``args`` (unless it
        failed meanwhile), then let it be sent: the thread sending it waits
        for this (its caller may delete or donate ``args`` as soon as it
        returns).  A copy that fails (an input deleted already) leaves the
        arguments: sending them fails the call."""
        copied = entry[4]
        if copied is None:
            return
        try:
            kept = self._keep(args)
            with self._lock:
                if entry[1] is args:
                    entry[1] = kept
            if entry[0].future.done():
                entry[1] = None
        except Exception as e:  # noqa: BLE001 - the send reports it
            log.debug("deferred call keeps its arguments: %s", e)
        finally:
            copied.set()

    def _count(self, call, lane: _Lane) -> None:
        call.when_settled(lambda: self._finished(lane))

    def _finished(self, lane: _Lane) -> None:
        with self._lock:
            lane.unfinished -= 1
            if lane.unfinished or lane.pumping:
                return
            if not lane.deferred:
                if len(self._lanes) > MAX_IDLE_LANES:
                    self._lanes = {k: v for k, v in self._lanes.items()
                                   if not v.idle()}
                return
            lane.pumping = True
        try:
            threading.Thread(target=self._pump, args=(lane,), daemon=True,
                             name="jaxcolo-lane-order").start()
        except RuntimeError as e:  # no thread: fail what waits
            self._fail_deferred(lane, e)

    def _pump(self, lane: _Lane) -> None:
        """Send the lane's deferred calls in order, while they are for the
        host set of its calls in flight (or none is in flight).  Calls
        admitted meanwhile queue behind them."""
        with executor_thread():  # callbacks of calls failed here: not here
            while True:
                with self._lock:
                    queued = lane.deferred
                    if not queued or (lane.unfinished and
                                      queued[0][0].plan.hosts != lane.hosts):
                        lane.pumping = False
                        return
                    entry = queued.popleft()
                    call, _, lane_id, limit, copied = entry
                    lane.hosts = call.plan.hosts
                    lane.unfinished += 1
                self._count(call, lane)
                # its caller may still copy its arguments: send the copies
                # (a caller interrupted before it could say it is done
                # failed the call: not waited for)
                while copied is not None and not copied.wait(0.05):
                    if call.future.done():
                        break
                with self._lock:
                    args, entry[1] = entry[1], None  # the call holds what
                if args is None or call.future.done():  # it needs now
                    continue  # timed out (or closed) while it waited
                try:
                    self._dispatch(call, args, lane_id, limit)
                except BaseException as e:  # noqa: BLE001 - the call's
                    call.fail(e)
                args = entry = None
                for _, link in call.links:
                    link.kick()  # the caller waits on the future only

    def _fail_deferred(self, lane: _Lane, error) -> None:
        with self._lock:
            calls, lane.deferred = list(lane.deferred), collections.deque()
            lane.pumping = False
        first = FirstRaised(defer_interrupts=True)  # (fail them all)
        for call, *_ in calls:
            first.run(call.fail, error)
        first.reraise()

    def close(self, error) -> None:
        """Fail the calls still deferred (and any deferred later)."""
        with self._lock:
            self._closed = error
            lanes = list(self._lanes.values())
        first = FirstRaised(defer_interrupts=True)
        for lane in lanes:
            first.run(self._fail_deferred, lane, error)
        first.reraise()
