"""Lanes and the order of calls spanning hosts, on a worker.

:class:`LaneRunner` runs tasks one lane at a time, in submission order, and
different lanes concurrently, on a pool of threads that grows when every
thread is busy (a lane may block, e.g. at a barrier, without stalling
others) and shrinks when threads stay idle.  ``try_inline`` runs a task of
an idle lane in the calling thread instead (no thread hand-off); work
queued on the lane meanwhile goes to the pool afterwards.

:class:`OrderedGate` makes calls that span hosts run one at a time, in the
order they arrived.  The controller sends such calls to every host they
span in one executor-wide order, so every host runs them -- and launches
their cross-host collectives -- in the same order.  :class:`HoldingGate`
keeps the turn of a call that failed on this host until the controller says
every other host is done with it.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading

log = logging.getLogger("jaxcolo.worker")
IDLE_SECONDS = 30.0


class LaneRunner:
    def __init__(self, name: str = "jaxcolo-lane"):
        self._name = name
        self._lock = threading.Lock()
        self._lanes: dict = {}          # lane -> deque of tasks
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._threads = 0
        self._closed = False

    def submit(self, lane, task) -> None:
        """Run ``task()`` after every task submitted earlier on ``lane``."""
        with self._lock:
            q = self._lanes.get(lane)
            if q is not None:           # the lane is running: queue behind
                q.append(task)
                return
            self._lanes[lane] = collections.deque((task,))
            spawn = self._take_thread()
        self._schedule(lane, spawn)

    def try_inline(self, lane, task) -> bool:
        """Run ``task()`` now, in this thread, if ``lane`` has nothing
        queued or running (True); else do nothing (False).  Tasks
        submitted to the lane while it runs queue behind it."""
        with self._lock:
            if lane in self._lanes or self._closed:
                return False
            self._lanes[lane] = collections.deque()
        try:
            task()
        except BaseException:  # tasks report their own errors
            log.exception("lane task failed")
        finally:
            with self._lock:
                if self._lanes[lane]:
                    spawn = self._take_thread()
                else:
                    del self._lanes[lane]
                    spawn = None
            if spawn is not None:
                self._schedule(lane, spawn)
        return True

    def _take_thread(self) -> bool:
        """Reserve a pool thread for one ready lane (under the lock); True
        when a new thread must be started."""
        spawn = self._idle == 0
        if spawn:
            self._threads += 1
        else:
            self._idle -= 1
        return spawn

    def _schedule(self, lane, spawn: bool) -> None:
        self._ready.put(lane)
        if spawn:
            threading.Thread(target=self._loop, daemon=True,
                             name=f"{self._name}-{self._threads}").start()

    def _loop(self) -> None:
        while True:
            try:
                lane = self._ready.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0 and self._ready.empty():
                        self._idle -= 1
                        self._threads -= 1
                        return
                continue
            if lane is None:
                return
            self._drain(lane)
            with self._lock:
                self._idle += 1

    def _drain(self, lane) -> None:
        while True:
            with self._lock:
                q = self._lanes[lane]
                if not q:
                    del self._lanes[lane]
                    return
                task = q.popleft()
            try:
                task()
            except BaseException:  # tasks report their own errors
                log.exception("lane task failed")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            n = self._threads
        for _ in range(n):
            self._ready.put(None)


class OrderedGate:
    """Tickets in arrival order; ``enter(t)`` waits for ticket ``t``'s turn,
    ``leave()`` passes the turn on."""

    def __init__(self):
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._turn = 0
        self._broken = False

    def ticket(self) -> int:
        with self._cond:
            t = self._next_ticket
            self._next_ticket += 1
            return t

    def enter(self, ticket: int) -> None:
        with self._cond:
            while self._turn != ticket and not self._broken:
                self._cond.wait()

    def leave(self) -> None:
        with self._cond:
            self._turn += 1
            self._cond.notify_all()

    def break_(self) -> None:
        """Release every waiter (the session is ending)."""
        with self._cond:
            self._broken = True
            self._cond.notify_all()


class HoldingGate(OrderedGate):
    """An OrderedGate whose turn, after a failed call, stays held until
    ``resume(call_id)``: a multi-host call that failed on this host may
    still run on the others (in collectives the next call must not join).

    ``expect_hold(id)`` before the failure is reported, for a call whose
    turn comes later (the resume may come first); ``end_turn(id, failed)``
    when its turn ends.  With ``holding=False`` failures pass the turn on.
    """

    def __init__(self, holding: bool):
        super().__init__()
        self.holding = holding
        self._held: dict = {}   # id -> "waiting" | "resumed" | "holding"
        self._held_lock = threading.Lock()

    def expect_hold(self, call_id: int) -> None:
        if self.holding:
            with self._held_lock:
                self._held[call_id] = "waiting"

    def end_turn(self, call_id: int, failed: bool) -> None:
        if failed and self.holding:
            with self._held_lock:
                if self._held.pop(call_id, None) != "resumed":
                    self._held[call_id] = "holding"
                    return
        self.leave()

    def holds(self) -> bool:
        """A failed call holds (or will hold) the turn until its resume."""
        with self._held_lock:
            return any(state != "resumed" for state in self._held.values())

    def resume(self, call_id: int) -> bool:
        """Pass on the turn held by ``call_id`` (at once, or when it ends);
        False if this gate holds no such call."""
        with self._held_lock:
            state = self._held.get(call_id)
            if state == "waiting":
                self._held[call_id] = "resumed"
            elif state == "holding":
                del self._held[call_id]
        if state == "holding":
            self.leave()
        return state in ("waiting", "holding")
