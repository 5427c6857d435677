"""When a ProcessExecutor sends the destroy of a class instance.

A destroy is requested by a finalizer (``destroy_instance``), which may run
in any thread at any allocation -- even inside a send on the very link the
destroy must go to, holding that link's send lock.  So a request only
appends to a deque (atomic, takes no lock) and rings a doorbell
(``SimpleQueue.put``, safe in finalizers); the destroy is sent later, by

* the next call any thread starts on the executor (``flush``, before that
  call is sent: a thread that drops an instance and then calls finds the
  destroy sent first, in program order), or
* the destroy thread, woken by the doorbell.

A destroy also waits until no call of its instance is in flight: a call
another thread submitted may still be queued or running on the host.  The
calls are counted by ``call``/``done`` events queued in order with the
destroys.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from typing import Callable, Hashable

from jaxcolo.transport.writer import acquire_until

log = logging.getLogger("jaxcolo.executor")

class DestroyQueue:
    """``send(instance_id, lane)`` is called for each destroy when due,
    never from a finalizer and never twice at once."""

    def __init__(self, send: Callable[[int, Hashable], None]):
        self._send = send
        self._events: collections.deque = collections.deque()
        self._doorbell: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._inflight: dict = {}  # instance id -> calls in flight
        self._waiting: dict = {}   # instance id -> lane of its destroy
        self._closed = False
        threading.Thread(target=self._run, daemon=True,
                         name="jaxcolo-destroys").start()

    # Requests (any thread; the first two never from a finalizer).
    def call(self, instance_id: int) -> None:
        self._events.append(("call", instance_id, None))

    def done(self, instance_id: int) -> None:
        self._events.append(("done", instance_id, None))
        if self._waiting:  # a destroy may be due now
            self._doorbell.put(True)

    def destroy(self, instance_id: int, lane: Hashable) -> None:
        self._events.append(("destroy", instance_id, lane))
        self._doorbell.put(True)

    def due(self) -> bool:
        """Events are queued, or being handled by another thread (a call
        starting now must ``flush`` to follow the destroys before it)."""
        return bool(self._events) or self._lock.locked()

    def flush(self, deadline: float | None = None) -> bool:
        """Handle every event queued so far; send the destroys due.  False
        (nothing done) if another thread handling them holds on past
        ``deadline`` (time.monotonic(); e.g. its send waits for a worker
        that stopped reading)."""
        if not acquire_until(self._lock, deadline):
            return False
        try:
            self._handle_events()
        finally:
            self._lock.release()
        return True

    def _handle_events(self) -> None:
        """(Under the lock.)"""
        events = self._events
        while events and not self._closed:
            # taken off only once handled: an exception (an interrupt
            # in a send) leaves it for the next flush
            what, iid, lane = events[0]
            if what == "call":
                self._inflight[iid] = self._inflight.get(iid, 0) + 1
            elif what == "done":
                n = self._inflight.pop(iid, 1) - 1
                if n:
                    self._inflight[iid] = n
                elif iid in self._waiting:
                    self._send_logged(iid, self._waiting[iid])
                    del self._waiting[iid]
            elif self._inflight.get(iid):
                self._waiting[iid] = lane
            else:
                self._send_logged(iid, lane)
            events.popleft()

    def _send_logged(self, iid: int, lane) -> None:
        try:
            self._send(iid, lane)
        except Exception:  # noqa: BLE001 - the next ones still go
            log.exception("could not send the destroy of instance %d", iid)

    def close(self) -> None:
        self._closed = True
        self._doorbell.put(False)

    def _run(self) -> None:
        while self._doorbell.get() and not self._closed:
            self.flush()
