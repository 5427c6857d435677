"""Program order of a lane's calls across hosts, on the controller.

A lane (one caller thread) runs its calls in program order.  A worker keeps
that order among the calls it gets (``jaxcolo.process.lanes``), but two
hosts know nothing of each other: a call submitted to host 1 after one still
running on host 0 would start at once.  :class:`LaneOrder` holds such a call
back on the controller until the lane's calls in flight are done.

Contract: at any time a lane's calls in flight all run on one and the same
set of hosts (their workers order them).  A call for that host set (or of a
lane with nothing in flight) is sent at once by its caller; any other call
is *deferred*, as is every call behind a deferred one.  When the lane's
calls in flight are all done (replied, failed or timed out), a thread sends
the deferred calls of the next host set, oldest first.  A deferred call
keeps its deadline (it may time out while it waits; it is then not sent),
and ``close(error)`` fails the calls still deferred.  Synchronous calls
never wait here: their caller saw the previous call finish.
"""

from __future__ import annotations

import collections
import logging
import threading
from concurrent.futures import Future
from typing import Callable

log = logging.getLogger("jaxcolo.executor")


class _Lane:
    __slots__ = ("hosts", "unfinished", "deferred", "pumping")

    def __init__(self, hosts):
        self.hosts = hosts          # the host set of the calls in flight
        self.unfinished = 0         # calls in flight
        self.deferred = collections.deque()  # (call, args, lane_id, limit)
        self.pumping = False        # a thread is sending deferred calls


class LaneOrder:
    """``dispatch(call, args, lane_id, limit)`` sends a call; it must fail
    the call (not raise) on any error of its own."""

    def __init__(self, dispatch: Callable):
        self._dispatch = dispatch
        self._lock = threading.Lock()
        self._lanes: dict = {}
        self._closed = None  # the error deferred calls fail with at close

    def admit(self, call, args, lane_id: int, limit) -> bool:
        """True: send ``call`` now (the caller does).  False: it was
        deferred, and will be sent (or failed) by this object."""
        hosts = call.plan.hosts
        with self._lock:
            lane = self._lanes.get(lane_id)
            if lane is None:
                lane = self._lanes[lane_id] = _Lane(hosts)
            wait = lane.deferred or (lane.unfinished and lane.hosts != hosts)
            if not wait:
                lane.hosts = hosts
                lane.unfinished += 1
            elif self._closed is None:
                lane.deferred.append((call, args, lane_id, limit))
                return False
        if wait:  # closed: it would never be sent
            call.fail(self._closed)
            return False
        self._count(call, lane_id, lane)
        return True

    def _count(self, call, lane_id: int, lane: _Lane) -> None:
        # Future's own method: runs inline in the thread completing it
        Future.add_done_callback(
            call.future, lambda _: self._finished(lane_id, lane))

    def _finished(self, lane_id: int, lane: _Lane) -> None:
        with self._lock:
            lane.unfinished -= 1
            if lane.unfinished:
                return
            if not lane.deferred:
                if self._lanes.get(lane_id) is lane:
                    del self._lanes[lane_id]  # idle: forgotten
                return
            if lane.pumping:
                return
            lane.pumping = True
        try:
            threading.Thread(target=self._pump, args=(lane,), daemon=True,
                             name="jaxcolo-lane-order").start()
        except RuntimeError as e:  # no thread: fail what waits
            self._fail_deferred(lane, e)

    def _pump(self, lane: _Lane) -> None:
        """Send the lane's deferred calls of its next host set, in order."""
        while True:
            with self._lock:
                if lane.unfinished or not lane.deferred:
                    lane.pumping = False
                    return
                hosts = lane.deferred[0][0].plan.hosts
                batch = []
                while lane.deferred and \
                        lane.deferred[0][0].plan.hosts == hosts:
                    batch.append(lane.deferred.popleft())
                lane.hosts = hosts
                lane.unfinished += len(batch)
            for call, args, lane_id, limit in batch:
                self._count(call, lane_id, lane)
                if call.future.done():  # timed out while it waited
                    continue
                try:
                    self._dispatch(call, args, lane_id, limit)
                except BaseException as e:  # noqa: BLE001 - the call's
                    call.fail(e)
                for _, link in call.links:
                    link.kick()  # the caller waits on the future only

    def _fail_deferred(self, lane: _Lane, error) -> None:
        with self._lock:
            calls, lane.deferred = list(lane.deferred), collections.deque()
            lane.pumping = False
        for call, *_ in calls:
            call.fail(error)

    def close(self, error) -> None:
        """Fail the calls still deferred (and any deferred later)."""
        with self._lock:
            self._closed = error
            lanes = list(self._lanes.values())
        for lane in lanes:
            self._fail_deferred(lane, error)
