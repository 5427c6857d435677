"""The controller's connection to one worker (one host of a ProcessExecutor).

A :class:`HostLink` is one authenticated channel to one worker process,
for the life of that connection: connecting does the Hello exchange
(``jaxcolo.transport``) and a ``setup`` exchange (heartbeat period; a
shared-memory probe -- if the worker reads a token the controller wrote to
``/dev/shm``, both use shared memory for large buffers, else out-of-band
frames).  The worker's messages are decoded and complete pending calls
(``on_reply(call_id, message, get_buffer)``) in whichever thread holds the
link's *reading role*: a caller waiting for its own reply
(:meth:`HostLink.wait_for`) reads the channel itself, so a synchronous call
costs no thread hand-off; the link's background reader takes the role only
when no caller is waiting (replies of submitted calls, heartbeats, EOF).

The link declares the worker lost -- ``on_lost(link, reason)``, once -- at
EOF, on a malformed reply, or when nothing (not even a heartbeat) arrived
for ``lost_timeout`` seconds.
"""

from __future__ import annotations

import collections
import logging
import queue
import secrets
import threading
import time

from jaxcolo.colocated.futures import executor_thread
from jaxcolo_fb import MessageKind as K
from jaxcolo import versions
from jaxcolo.errors import ConnectionLost, ExecutorError, PayloadError
from jaxcolo.process import arrays, messages
from jaxcolo.transport import blobs, channel as ch, handshake, peer_segments, procs
from jaxcolo.transport.interrupts import CRITICAL
from jaxcolo.transport.writer import SendDeadline, acquire_until, \
    seconds_until

log = logging.getLogger("jaxcolo.executor")
READ_POLL = 0.05    # seconds between checks of a reader's stop condition
IDLE_READ = 0.2     # the background reader reads after this long unread
CLOSE_SEND_WAIT = 1.0  # close() skips the shutdown message behind a stuck send
REFUSAL_READ_WAIT = 1.0  # a setup send failed: read why the worker refused
# A silent started worker that used at least this share of the last
# lost_timeout in CPU time is busy, not lost (low: on a loaded machine a
# busy worker gets a small share of a core; a hung one uses next to none).
BUSY_SHARE = 0.1
MAX_BUSY_SAMPLES = 64  # (a lost_timeout of hours: judged over 63 periods)


def _busy(samples) -> bool:
    """Whether the CPU time in ``samples`` ((time, CPU seconds or None),
    oldest first) grew by BUSY_SHARE of the time they span."""
    if len(samples) < 2:  # (no pid: a running worker, not started here)
        return False
    (t0, c0), (t1, c1) = samples[0], samples[-1]
    return c0 is not None and c1 is not None and t1 > t0 and \
        c1 - c0 >= (t1 - t0) * BUSY_SHARE


class HostLink:
    def __init__(self, index: int, address: str, authkey: bytes, hello, *,
                 timeout: float, lost_timeout: float, heartbeat: float,
                 use_shm: bool, shm_retain: int, on_reply, on_lost,
                 pid: int | None = None):
        self.index = index
        self.address = address
        self.channel = ch.connect(address, authkey, hello, timeout=timeout,
                                  need=versions.FEATURE_SINCE["message"])
        self.version = self.channel.version
        self.peer = self.channel.peer
        self.device_ids = tuple(self.peer.device_ids)
        self.pid = pid
        self._started_pid = pid  # a worker this process started (local)
        self.pool = None
        self.maps = peer_segments.SegmentMaps()
        self.registered: set = set()
        self.register_lock = threading.Lock()
        # program ids to forget on the worker, not sent yet (the connection
        # was busy); a registration takes its id out (under register_lock)
        self.forget_unsent: set = set()
        self.refused = 0
        self._on_reply = on_reply
        self._on_lost = on_lost
        self._lost_timeout = lost_timeout
        self._lost = False
        self.loss_reason: str | None = None  # why it was lost, once it is
        self._lost_lock = threading.Lock()
        self._released: queue.SimpleQueue = queue.SimpleQueue()
        self._stats_waiters: dict = {}
        self._shm_retain = shm_retain
        self.last_seen = time.monotonic()
        self._role = threading.Condition()   # guards the reading role
        self._reading = False                # some thread holds the role
        self._reader_waits = False           # ... and it is a waiter
        self._waiters = 0                    # threads in wait_for
        self._kick = threading.Event()       # wake the background reader
        self._expected = 0                   # replies to calls sent
        try:
            self._setup(use_shm, heartbeat, timeout)
        except BaseException:
            self.channel.close()
            raise
        self.describe = (f"host {index} ({address}"
                         f"{', pid %d' % self.pid if self.pid else ''})")
        threading.Thread(target=self._background_read, daemon=True,
                         name=f"jaxcolo-host{index}-reader").start()
        threading.Thread(target=self._release_loop, daemon=True,
                         name=f"jaxcolo-host{index}-release").start()
        threading.Thread(target=self._watch, daemon=True,
                         name=f"jaxcolo-host{index}-watch").start()

    def _watch(self) -> None:
        """Lose the worker after ``lost_timeout`` s without a frame (it
        sends heartbeats when idle; the frames of a long reply count).

        Silence is no loss while frames wait unread (this process was too
        busy to read them: C code holding the GIL stops its readers and this
        watchdog alike), nor, for a worker this process started, while the
        worker keeps using CPU time (a function holding the worker's GIL
        stops its heartbeats, not its work)."""
        period = min(1.0, self._lost_timeout / 4)
        pid = self._started_pid
        # (time, CPU seconds) over the last lost_timeout: a busy worker is
        # judged by its CPU share over that span, not one period's (on a
        # loaded machine a single period can get it little CPU)
        samples = collections.deque(maxlen=min(
            int(self._lost_timeout / period) + 1, MAX_BUSY_SAMPLES))
        if pid is not None:
            samples.append((time.monotonic(), procs.cpu_seconds(pid)))
        while not self._lost:
            time.sleep(period)
            if pid is not None:
                samples.append((time.monotonic(), procs.cpu_seconds(pid)))
            silent = min(time.monotonic() - self.last_seen,
                         self.channel.silent_for())
            if silent <= self._lost_timeout or self._lost:
                continue
            if self.channel.input_waiting():
                self.kick()  # (read by a caller, else in the background)
                continue
            if _busy(samples):
                continue  # working, GIL held: no heartbeats, no reply yet
            self.lost(f"no message for {silent:.1f}s (heartbeats "
                      "stopped)")
            return

    def _setup(self, use_shm: bool, heartbeat: float, timeout: float) -> None:
        token = secrets.token_bytes(16)
        name, cleanup = (blobs.probe_segment(token)
                         if use_shm and blobs.available() else (None, None))
        try:
            try:
                self.send(messages.Message(
                    K.setup, heartbeat_ms=max(1, int(heartbeat * 1000)),
                    text=name, token=token if name else None))
            except ConnectionLost:  # a worker that refused this
                reply = self._refusal_waiting()  # controller wrote why and
                if reply is None:                # closed: the send can find
                    raise                        # it closed (unix: EPIPE)
            else:
                reply = messages.decode(self.channel.recv(timeout),
                                        self.version)
        finally:
            if cleanup is not None:
                cleanup()
        if reply.kind != K.setup:
            raise ExecutorError(
                f"the worker at {self.address} (host {self.index} here) "
                f"answered setup with {reply.kind_name}: "
                f"{reply.error_message}")
        self.pid = self.pid or reply.pid or None
        if name and reply.token == token:
            self.pool = blobs.SegmentPool(f"c{self.index}",
                                          self._shm_retain)

    def _refusal_waiting(self):
        """The error message a worker wrote before closing, if it waits
        unread (else None)."""
        try:
            reply = messages.decode(self.channel.recv(REFUSAL_READ_WAIT),
                                    self.version)
        except (ExecutorError, PayloadError):
            return None
        return reply if reply.kind == K.error else None

    # ------------------------------------------------------------ sending
    def send(self, m: messages.Message, frames=(),
             deadline: float | None = None) -> None:
        """Send ``m`` and the frames after it; past ``deadline`` see
        FrameWriter.send_frames (SendDeadline)."""
        data = messages.encode(m, self.version)
        self.channel.send_frames((data, *frames), deadline)

    def send_encoded(self, data: bytes, frames=(),
                     deadline: float | None = None) -> None:
        """``send`` of a message already encoded (at this link's version)."""
        self.channel.send_frames((data, *frames), deadline)

    def ensure_registered(self, program, deadline: float | None = None) -> None:
        """Register ``program`` with the worker unless it was.  Past
        ``deadline``: SendDeadline(started=False), nothing sent, or the
        registration goes out in the background (it counts as done)."""
        if program.id in self.registered:
            return
        lock = self.register_lock
        if not acquire_until(lock, deadline):
            raise SendDeadline("another thread was registering programs "
                               "until the deadline", started=False)
        try:
            if program.id not in self.registered:
                self.forget_unsent.discard(program.id)  # made again
                try:
                    self.send(messages.Message(
                        K.register, program_id=program.id,
                        program=program.payload), deadline=deadline)
                except SendDeadline as e:
                    if e.started:  # it arrives before anything sent later
                        self.registered.add(program.id)
                    raise
                self.registered.add(program.id)
        finally:
            lock.release()

    def request_stats(self, timeout: float) -> dict:
        """The worker's counters; ExecutorError saying why if it does not
        reply within ``timeout`` seconds or the link is (or gets) lost."""
        if self._lost:
            raise ExecutorError(f"{self.describe} was lost: "
                                f"{self.loss_reason}")
        ev = threading.Event()
        key = secrets.randbits(62) or 1
        box = self._stats_waiters[key] = [ev, None]
        try:
            deadline = time.monotonic() + timeout
            try:
                self.send(messages.Message(K.stats, call_id=key),
                          deadline=deadline)  # (a send going: SendDeadline)
            except ConnectionLost as e:  # gone: as a call's send, lost
                self.lost(f"{e} (sending a stats request)")
                raise ExecutorError(f"{self.describe} was lost: "
                                    f"{self.loss_reason}") from None
            self.kick()
            if not ev.wait(seconds_until(deadline)):
                raise ExecutorError(f"{self.describe}: no stats reply")
            if box[1] is None:  # woken by the link's teardown
                raise ExecutorError(f"{self.describe} was lost before it "
                                    "replied with its stats")
            return box[1]
        finally:
            self._stats_waiters.pop(key, None)

    # ------------------------------------------------------------ reading
    def wait_for(self, done) -> None:
        """Return once ``done()`` is true (a reply arrived, or the call
        failed), reading this link's messages meanwhile whenever no other
        thread is reading them."""
        role = self._role
        try:
            with role:
                self._waiters += 1
                try:
                    while not done():
                        if self._reading or self._lost:
                            role.wait(READ_POLL)
                            continue
                        self._reading = self._reader_waits = True
                        role.release()
                        try:
                            self._read_until(done)
                        finally:
                            role.acquire()
                            self._reading = self._reader_waits = False
                            if self._waiters > 1:
                                role.notify_all()
                finally:
                    self._waiters -= 1
        finally:  # also when interrupted: a reply may still come
            if not self._waiters and self._expected > 0:
                self.kick()  # replies nobody waits for: the background reads

    def expect_reply(self, n: int = 1) -> None:
        """A call was sent: its reply (result or error) will come (-1: a
        call expected was not sent after all)."""
        with self._role:
            self._expected += n

    def kick(self) -> None:
        """Have the background reader read if no caller is waiting (a
        submitted call's or a stats request's reply is expected)."""
        if not self._waiters and not self._reading:
            self._kick.set()

    def _background_read(self) -> None:
        """Read while no caller waits: at once when kicked, else after
        ``IDLE_READ`` seconds without a read (heartbeats, EOF)."""
        role = self._role
        while not self._lost:
            kicked = self._kick.wait(IDLE_READ)
            self._kick.clear()
            self._release_dropped()
            if not kicked and time.monotonic() - self.last_seen < IDLE_READ:
                continue
            with role:
                if self._reading or self._waiters or self._lost:
                    continue
                self._reading = True
            try:
                self._read_until(lambda: self._waiters > 0)
            finally:
                with role:
                    self._reading = False
                    if self._waiters:
                        role.notify_all()

    def _read_until(self, done) -> None:
        """Holding the reading role: handle messages until ``done()`` or
        the link is lost (which is then reported).  What a SIGINT handler
        raises (in a wait, or where a message's critical section ends)
        reaches the caller, and is never taken for the link failing."""
        with executor_thread():
            while not self._lost and not done():
                if not self.channel.readable(READ_POLL, ch.SPIN):
                    self._release_dropped()  # (quiet: READ_POLL seconds)
                    continue
                with CRITICAL:  # a reply is never half-taken
                    reason = self._take_message()
                    if reason is not None:
                        self.lost(reason)
                        return

    def _release_dropped(self) -> None:
        """Give back the worker's leases of results dropped since (XLA
        queues its references to their views; see release_deferred)."""
        if self.maps.in_use():
            arrays.release_deferred()

    def _take_message(self) -> str | None:
        """Read and handle one message; why the link is lost if that
        failed."""
        try:
            self._handle(self.channel.recv())
        except ExecutorError as e:
            return str(e)
        except PayloadError as e:
            return f"malformed message from the worker: {e}"
        except Exception as e:  # noqa: BLE001 - report, never hang callers
            log.exception("%s: reader failed", self.describe)
            return f"reader failed: {e!r}"
        return None

    def release_unused(self, m) -> None:
        """Return the worker's shared-memory leases of a reply whose buffers
        will never be viewed."""
        arrays.release_unused(m, self._released)

    def _handle(self, frame) -> None:
        self.last_seen = time.monotonic()
        m = messages.decode(frame, self.version)
        kind = m.kind
        if kind == K.result or (kind == K.error and m.call_id):
            get = (arrays.message_buffers(m, self.channel, self.maps,
                                         self._released)
                   if m.shards is not None else None)
            if not self._on_reply(self, m.call_id, m, get):
                self.release_unused(m)  # dropped: its leases go back now
            with self._role:
                self._expected -= 1
                if self._waiters > self._reader_waits:
                    self._role.notify_all()  # a caller may wait for it
        elif kind == K.error:
            self.refused += 1
            log.warning("%s", m.error_message)
        elif kind == K.release:
            if self.pool is not None:
                self.pool.release(m.released)
        elif kind == K.stats:
            box = self._stats_waiters.get(m.call_id)
            if box is not None:
                box[1] = m.stats or {}
                box[0].set()
        elif kind != K.ping:
            log.warning("%s sent an unexpected %s message",
                        self.describe, m.kind_name)

    def _release_loop(self) -> None:
        while True:
            ids = blobs.drain_released(self._released)
            if ids is None:
                return
            if self._lost:
                return
            try:
                self.send(messages.Message(K.release, released=ids))
            except ExecutorError:
                return

    # ------------------------------------------------------------- ending
    @property
    def is_lost(self) -> bool:
        return self._lost

    def lost(self, reason: str) -> None:
        """Declare the worker lost (once): close, clean up, tell the
        executor."""
        with self._lost_lock:
            if self._lost:
                return
            self.loss_reason = reason  # (before it is seen lost)
            self._lost = True
        self._teardown()
        with executor_thread():
            self._on_lost(self, reason)
        with self._role:
            self._role.notify_all()

    def retire(self, reason: str) -> None:
        """Mark the link lost without reporting it (its cluster was lost
        through another host, ``reason``): no call starts on it any more."""
        with self._lost_lock:
            if not self._lost:
                self.loss_reason = reason
            self._lost = True

    def discard(self) -> None:
        """Close a retired link and clean up after its worker, which is
        about to be killed with its cluster."""
        self._teardown()
        with self._role:
            self._role.notify_all()

    def _teardown(self) -> None:
        self.channel.close()
        self._released.put(None)
        if self.pool is not None:
            self.pool.close()
        self.maps.unlink_all()  # a killed worker cannot unlink its own
        if self._started_pid:  # nor the ones it had not announced yet
            blobs.unlink_process_segments(self._started_pid)
        self.maps.clear()
        for box in list(self._stats_waiters.values()):
            box[0].set()
        self._kick.set()

    def close(self, shutdown: bool = True) -> None:
        if shutdown and not self._lost:
            try:  # not behind a send the worker stopped reading
                self.channel.send_if_idle(messages.encode(messages.Message(
                    K.shutdown), self.version), CLOSE_SEND_WAIT)
            except ExecutorError:
                pass
        with self._lost_lock:
            if not self._lost:
                self.loss_reason = "the executor closed its connection"
            self._lost = True
        self.channel.close()
        self._released.put(None)
        for box in list(self._stats_waiters.values()):
            box[0].set()  # (no reply comes any more)
        self._kick.set()
        with self._role:
            self._role.notify_all()
        if self.pool is not None:
            self.pool.close()
        self.maps.clear()


def controller_hello(min_version=None, max_version=None):
    return handshake.local_hello("controller", min_version=min_version,
                                 max_version=max_version)
