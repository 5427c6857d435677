"""Writing frames to a connection, with deadlines.

:class:`FrameWriter` writes multiprocessing.connection's framing (a ``!i``
length before each frame) itself, so that a send can give up at a
deadline: one still waiting for the connection then (another send holds
it) sends nothing; one still writing (the peer reads slowly, or not at
all) hands the rest to a thread, which holds the connection until the
message is out -- frames are never interleaved or left half-sent.
"""

from __future__ import annotations

import collections
import itertools
import logging
import select
import socket
import struct
import threading
import time
from typing import Callable

from jaxcolo.errors import ConnectionLost, ExecutorError
from jaxcolo.transport.interrupts import CRITICAL

log = logging.getLogger("jaxcolo.transport")

_LENGTH = struct.Struct("!i")
_SMALL = 1 << 14  # a frame up to this size goes with its length in one buffer
_IOV_MAX = 512    # buffers per sendmsg (the system's limit is 1024)
_POLL_STEP_MS = 1000  # a blocked writer checks for close() this often


def seconds_until(deadline: float) -> float:
    """Seconds from now to ``deadline`` (time.monotonic()), as a timeout
    for locks, events and polls: at least 0, at most threading.TIMEOUT_MAX
    (a huge finite timeout is allowed, and must not overflow)."""
    return min(max(0.0, deadline - time.monotonic()), threading.TIMEOUT_MAX)


def acquire_until(lock, deadline: float | None) -> bool:
    """Acquire ``lock`` by ``deadline`` (time.monotonic(); None: however
    long it takes); False if it could not be had by then."""
    if deadline is None:
        return lock.acquire()
    return lock.acquire(timeout=seconds_until(deadline))


class SendDeadline(ExecutorError):
    """A send did not complete by its deadline.  ``started``: False when
    nothing was sent; True when the message was partly written and a thread
    sends the rest (it arrives unless the connection is lost)."""

    def __init__(self, message: str, started: bool):
        super().__init__(message)
        self.started = started


def _framed(frames) -> collections.deque:
    """The buffers that send ``frames``: a length before each (the framing
    of multiprocessing.connection, which the reader follows)."""
    out = collections.deque()
    for frame in frames:
        if isinstance(frame, bytes):
            n = len(frame)
        else:
            frame = memoryview(frame).cast("B")
            n = frame.nbytes
        if n <= _SMALL:  # one buffer: one small write
            out.append(_LENGTH.pack(n) + frame)
        else:
            out.append(_LENGTH.pack(n))
            out.append(frame)
    return out


class FrameWriter:
    """Writes frames to ``sock``; ``closed()`` says whether its connection
    was closed, ``close()`` closes it (when the rest of a message sent on
    after its deadline cannot be written).  ``lock`` is held by whoever
    writes."""

    def __init__(self, sock: socket.socket, closed: Callable[[], bool],
                 close: Callable[[], None]):
        self._sock = sock
        self._closed = closed
        self._close = close
        self.lock = threading.Lock()
        self._wpoll = select.poll()  # (the lock's holder) room to write
        self._wpoll.register(sock.fileno(), select.POLLOUT)

    def send_frames(self, frames, deadline: float | None = None, *,
                    finish: bool = True) -> None:
        """Send frames with nothing in between (a message and the
        out-of-band buffers that follow it): all, or (FrameTooLarge)
        none.  ExecutorError if the connection is lost.

        ``deadline`` (time.monotonic(); None: none): a send still waiting
        for the connection then (another send holds it) raises SendDeadline
        with nothing sent; one still writing (the peer reads slowly, or
        not at all) raises SendDeadline(started=True), and a thread writes
        the rest -- with ``finish=False``, only a send that has not begun
        by then gives up.  Frames are never interleaved or left half-sent:
        the thread holds the connection until done, or until the
        connection is lost (it is then closed)."""
        lock = self.lock
        if not acquire_until(lock, deadline):
            raise SendDeadline("the connection was busy with another send "
                               "until the deadline", started=False)
        handed = False
        try:
            with CRITICAL:  # Ctrl-C: after the frames are out
                if len(frames) == 1 and type(frames[0]) is bytes and \
                        len(frames[0]) <= _SMALL:  # one small write
                    buf = _LENGTH.pack(len(frames[0])) + frames[0]
                    try:
                        n = self._sock.send(buf, socket.MSG_DONTWAIT)
                    except (BlockingIOError, InterruptedError):
                        n = 0
                    if n == len(buf):
                        return  # (the lock is released below)
                    bufs = collections.deque(
                        (memoryview(buf)[n:],) if n else (buf,))
                    first = None if n else buf  # (n bytes went out)
                else:
                    bufs = _framed(frames)
                    first = bufs[0]
                pending = self._write(bufs, deadline if finish else None)
                if pending and pending[0] is first:  # not a byte went out
                    raise SendDeadline("the peer was not reading (earlier "
                                       "messages filled the connection) "
                                       "until the deadline", started=False)
                if pending:
                    self._finish_later(pending)
                    handed = True
        except (OSError, ValueError) as e:
            raise ConnectionLost(f"connection lost: {e}") from None
        finally:
            if not handed:
                lock.release()
        if handed:
            raise SendDeadline("the peer did not take the whole message by "
                               "the deadline; the rest of it is sent in the "
                               "background", started=True)

    def _write(self, pending: collections.deque, deadline: float | None):
        """Write the buffers of ``pending`` (the send lock is held);
        returns what is left at ``deadline`` (empty when all went)."""
        sock = self._sock
        while pending:
            try:
                if len(pending) == 1:
                    n = sock.send(pending[0], socket.MSG_DONTWAIT)
                else:
                    n = sock.sendmsg(itertools.islice(pending, _IOV_MAX), (),
                                     socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                n = 0
            while n:
                head = pending[0]
                if n >= len(head):
                    n -= len(head)
                    pending.popleft()
                else:
                    pending[0] = memoryview(head)[n:]
                    n = 0
            if not pending:
                break
            if self._closed():  # (its fd number may be another file's now)
                raise OSError("the connection was closed")
            if deadline is None:
                wait = _POLL_STEP_MS  # then look at ``closed`` again
            else:
                wait = seconds_until(deadline)
                if not wait:
                    return pending
                wait = min(max(1, int(wait * 1000)), _POLL_STEP_MS)
            events = self._wpoll.poll(wait)
            if events and events[0][1] & select.POLLNVAL:
                raise OSError("the connection was closed")
        return pending

    def _finish_later(self, pending: collections.deque) -> None:
        """A thread writes ``pending`` and then releases the send lock,
        which it now holds (a later send waits for the frames already
        begun); a failed write closes the connection."""
        def finish():
            try:
                self._write(pending, None)
            except (OSError, ValueError) as e:
                if not self._closed():
                    log.warning("the rest of a message sent on after its "
                                "deadline could not be sent (%s): closing "
                                "the connection", e)
                    self._close()
            finally:
                pending.clear()
                self.lock.release()
        threading.Thread(target=finish, daemon=True,
                         name="jaxcolo-send-rest").start()
