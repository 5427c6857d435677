"""The worker side of a ProcessExecutor: one session per controller.

A :class:`Session` owns an authenticated channel to a controller.  Its
reader thread decodes each frame (a ``message`` payload); a frame that does
not decode is refused -- logged, answered with an ``error`` message of
call id 0, and dropped -- and the session goes on.  Programs arrive once
(``register``) and calls name them by content id.  A call's input shards are
turned into jax.Arrays on this host's devices (``jaxcolo.process.arrays``)
and the call runs on its lane (``jaxcolo.process.lanes``): on the reader
thread itself when the lane is idle (a call that runs longer than
``PROMOTE_AFTER`` gets a new reader thread started beside it, so later
messages are never stuck behind it), else queued behind the lane's work.  It
runs in an
:class:`~jaxcolo.colocated.inline.InlineExecutor` (loading bodies, class
instances, output checks, discovery), and its outputs -- the shards this host
holds -- go back in a ``result``, or its exception in an ``error`` (type,
message, remote traceback, and the exception itself pickled with its
classes by name when possible, see :mod:`jaxcolo.process.remote_errors`, so
the caller re-raises the same type).  A reply too large for a frame fails
its call instead.  Calls spanning hosts pass an ordered gate one at a time;
one that failed here keeps the gate (``HoldingGate``) until the controller's
``resume`` says every other host is done with it.

Device ids: the worker process has installed its device map
(``jaxcolo.codec.mesh.set_device_space``), so every payload it reads or
writes speaks the controller's ids.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import threading
import time

from jaxcolo_fb import BufferWhere, MessageKind as K
from jaxcolo.colocated.inline import InlineExecutor
from jaxcolo.errors import EncodeError, ExecutorError, HostWedgedError, \
    PayloadError
from jaxcolo.process import arrays, messages, packing, templates
from jaxcolo.process import main_types
from jaxcolo.process.lanes import HoldingGate, LaneRunner
from jaxcolo.process.program_table import ProgramTable
from jaxcolo.process.remote_errors import error_message
from jaxcolo.process.wedge import WEDGE
from jaxcolo.versions import FEATURE_SINCE
from jaxcolo.transport import blobs, channel as channel_mod, peer_segments

log = logging.getLogger("jaxcolo.worker")
RESUME_SINCE = FEATURE_SINCE["message_resume"]
PROMOTE_AFTER = 0.005   # seconds a call may hold the reader thread
IDLE_RELEASE = 0.01     # seconds without messages before the reader gives
                        # back the leases of inputs dropped meanwhile


def _reason(e: BaseException) -> str:
    """A refusal's reason: a PayloadError's text, else the exception's repr."""
    return str(e) if isinstance(e, PayloadError) else repr(e)


class Session:
    """Serves one controller over ``channel`` until it ends.

    ``on_end()`` is called once when the session ends (EOF, shutdown, or a
    lost connection).
    """

    def __init__(self, channel, *, host_index: int, on_end=None,
                 shm_retain: int | None = None):
        self.channel = channel
        self.version = channel.version
        self.host_index = host_index
        self.where = f"host {host_index} (pid {os.getpid()})"
        self._on_end = on_end
        self.shutdown_requested = False  # else the controller vanished
        self._lanes = LaneRunner(f"jaxcolo-h{host_index}-lane")
        # a multi-host call that failed here holds the gate until the
        # controller's resume (sessions at v7 and later)
        self._gate = HoldingGate(self.version >= RESUME_SINCE)
        self._multi_lock = threading.Lock()
        self._multi_running: set = set()  # multi-host calls running
        self._multi_closed = False       # the session ended: none starts
        self._pool = None                    # our segments, when shm works
        self._shm_retain = blobs.DEFAULT_RETAIN if shm_retain is None \
            else shm_retain
        self._maps = peer_segments.SegmentMaps()     # the controller's segments
        self._released: queue.SimpleQueue = queue.SimpleQueue()
        self._heartbeat = 1.0
        self._set_up = False
        self._ended = threading.Event()
        self.stats = {"calls": 0, "discoveries": 0, "registered": 0,
                      "refused": 0, "errors": 0, "programs_decoded": 0}
        self._programs = ProgramTable(self.stats)
        # a program forgotten while a call of it was queued (timed out on
        # the controller) is run by that call, not kept again
        self._inline = InlineExecutor(keep=self._programs.has,
                                      decode=self._programs.decode_for_run)
        # The reader runs a call of an idle lane itself (no hand-off); a
        # call still running after PROMOTE_AFTER seconds makes a new thread
        # the reader, so a blocking function cannot stall later messages.
        self._reader_lock = threading.Lock()
        self._reader_gen = 0
        self._busy = False           # the reader is running a call
        self._busy_seq = 0
        self._last_busy = 0.0
        self._busy_event = threading.Event()
        self._start_reader()
        threading.Thread(target=self._promote_loop, daemon=True,
                         name=f"jaxcolo-h{host_index}-promote").start()
        threading.Thread(target=self._release_loop, daemon=True,
                         name=f"jaxcolo-h{host_index}-release").start()

    # ------------------------------------------------------------ sending
    def _send(self, m: messages.Message, frames=(), data=None) -> None:
        if data is None:
            data = messages.encode(m, self.version)
        if frames:
            self.channel.send_frames([data, *frames])
        else:
            self.channel.send(data)

    def _send_quietly(self, m, frames=()) -> None:
        try:
            self._send(m, frames)
        except ExecutorError as e:
            log.info("%s: cannot reply (%s)", self.where, e)
            self._end()

    def _send_reply(self, call_id: int, m, frames=(), packer=None,
                    data=None) -> None:
        """Send a call's reply (``data``: ``m`` encoded already); one that
        cannot be framed fails that call (with an ExecutorError saying why)
        and the session goes on."""
        try:
            self._send(m, frames, data)
            return
        except (channel_mod.FrameTooLarge, EncodeError) as e:
            if packer is not None:  # (too large, or not encodable)
                packer.abandon()
            error = ExecutorError(f"{self.where} could not send the reply: "
                                  f"{e}")
        except ExecutorError as e:
            log.info("%s: cannot reply (%s)", self.where, e)
            self._end()
            return
        self._send_quietly(error_message(call_id, error, self.where,
                                         self.version))

    # ------------------------------------------------------------ reading
    def _start_reader(self) -> None:
        """Make a new thread the reader (under ``_reader_lock`` or before
        any reader runs); the previous one exits after its call."""
        self._reader_gen += 1
        threading.Thread(target=self._read_loop, args=(self._reader_gen,),
                         daemon=True,
                         name=f"jaxcolo-h{self.host_index}-reader"
                              f"{self._reader_gen}").start()

    def _promote_loop(self) -> None:
        """Watch the reader's inline calls: tick every PROMOTE_AFTER
        seconds while calls come (sleep when idle); a call that spans a
        whole tick gets a new reader started beside it."""
        seen = None
        while not self._ended.is_set():
            with self._reader_lock:
                idle = (not self._busy and
                        time.monotonic() - self._last_busy > 1.0)
                if idle:
                    self._busy_event.clear()
            if idle:
                seen = None
                self._busy_event.wait(60.0)
                continue
            time.sleep(PROMOTE_AFTER)
            with self._reader_lock:
                if not self._busy:
                    seen = None
                elif seen != self._busy_seq:
                    seen = self._busy_seq
                else:  # the same call for a whole tick: promote
                    seen = None
                    self._busy = False
                    self._start_reader()

    def _run_inline(self, gen: int, lane, task) -> bool:
        """Run ``task`` of ``lane`` on this reader thread if the lane is
        idle.  Returns False when this thread is no longer the reader."""
        with self._reader_lock:
            self._busy = True
            self._busy_seq += 1
            if not self._busy_event.is_set():  # cleared only under the lock
                self._busy_event.set()
        try:
            if not self._lanes.try_inline(lane, task):
                self._lanes.submit(lane, task)
        finally:
            with self._reader_lock:
                if gen == self._reader_gen:
                    self._busy = False
                    self._last_busy = time.monotonic()
                    return True
        return False

    def _read_loop(self, gen: int) -> None:
        if self._read_frames(gen):
            self._end()

    def _read_frames(self, gen: int) -> bool:
        """Read and handle frames until the session ends (True) or a newer
        reader took over (False)."""
        try:
            while not self._ended.is_set():
                # hold nothing of the last call while waiting (its inputs
                # may pin the controller's shared memory)
                m = task = None
                if not self.channel.readable(IDLE_RELEASE, channel_mod.SPIN):
                    if self._maps.in_use():  # idle: inputs dropped since
                        arrays.release_deferred()  # give their leases back
                    self.channel.readable(None)
                frame = self.channel.recv(timeout=None)
                try:
                    m = messages.decode(frame, self.version)
                except Exception as e:  # noqa: BLE001 - PayloadError, or a
                    self._refuse(f"malformed message: {_reason(e)}")  # bug
                    continue
                try:
                    if m.kind in (K.call, K.discover) and not m.ordered:
                        task = self._prepare_call(m)
                        if task is not None and \
                                not self._run_inline(gen, m.lane, task):
                            return False  # a newer reader took over
                    elif not self._dispatch(m):
                        break
                except (ExecutorError, MemoryError):
                    raise  # the connection (or this process) is gone
                except Exception as e:  # noqa: BLE001 - one bad message
                    if m.call_id and m.kind in (K.call, K.discover):
                        self._send_quietly(error_message(
                            m.call_id, e, self.where, self.version))
                    else:
                        self._refuse(f"bad {m.kind_name} message: "
                                     f"{_reason(e)}")
        except ExecutorError as e:
            log.info("%s: controller connection ended: %s", self.where, e)
        except Exception:  # never die silently
            log.exception("%s: session failed", self.where)
        return True

    def _refuse(self, why: str) -> None:
        self.stats["refused"] += 1
        log.warning("%s refused a message from the controller: %s",
                    self.where, why)
        self._send_quietly(messages.Message(
            K.error, error_type="jaxcolo.errors.PayloadError",
            error_message=f"{self.where} refused a message: {why}"))

    def _dispatch(self, m: messages.Message) -> bool:
        kind = m.kind
        if kind == K.call or kind == K.discover:
            self._call(m)
        elif kind == K.register:
            self._register(m)
        elif kind == K.release:
            if self._pool is not None:
                self._pool.release(m.released)
        elif kind == K.forget:  # their functions are gone on the controller
            self._programs.forget(m.forgotten)
            self._inline.forget(m.forgotten)
        elif kind == K.destroy:
            self._lanes.submit(m.lane, lambda iid=m.instance_id, lane=m.lane:
                               self._destroy_instance(iid, lane))
        elif kind == K.setup:
            self._setup(m)
        elif kind == K.stats:
            self._send_quietly(messages.Message(
                K.stats, call_id=m.call_id, stats=self._stats()))
        elif kind == K.shutdown:
            log.info("%s: shutdown requested", self.where)
            self.shutdown_requested = True
            return False
        elif kind == K.ping:
            pass
        elif kind == K.resume:
            if not self._gate.resume(m.call_id):  # e.g. its result became an
                log.info("%s: resume of call %d, not held here",  # error
                         self.where, m.call_id)                    # reply
        else:
            self._refuse(f"unexpected {m.kind_name} message")
        return True

    def _setup(self, m) -> None:
        if self._set_up:  # a second heartbeat thread / segment pool: no
            self._refuse("setup was already done for this session")
            return
        self._set_up = True
        if m.heartbeat_ms:
            self._heartbeat = m.heartbeat_ms / 1000.0
            threading.Thread(target=self._heartbeat_loop, daemon=True,
                             name="jaxcolo-heartbeat").start()
        token = b""
        if m.text and m.token:
            token = blobs.read_probe(m.text, len(m.token))
            if token == m.token and blobs.available():
                self._pool = blobs.SegmentPool(f"w{self.host_index}",
                                               self._shm_retain)
        self._send_quietly(messages.Message(K.setup, token=token,
                                            pid=os.getpid()))

    def _stats(self) -> dict:
        out = dict(self.stats)
        out.update(self._inline.stats())
        out["calls"] = self.stats["calls"]
        out["programs_registered_now"] = len(self._programs)
        if self._pool is not None:
            out.update(self._pool.stats())
        return out

    def _register(self, m) -> None:
        self._programs.register(m.program_id, m.program, m.inflation)

    def _destroy_instance(self, instance_id: int, lane) -> None:
        """Drop the instance and the method programs naming it (nothing
        calls them any more)."""
        self._inline.destroy_instance(instance_id, lane=lane)
        self._programs.drop_instance(instance_id)

    # -------------------------------------------------------------- calls
    def _call(self, m) -> None:
        task = self._prepare_call(m)
        if task is not None:
            self._lanes.submit(m.lane, task)

    def _prepare_call(self, m):
        """The task running call ``m``, or None when it already failed
        (its error was sent)."""
        ticket = self._gate.ticket() if m.ordered else None
        try:
            get = (arrays.message_buffers(m, self.channel, self._maps,
                                         self._released)
                   if m.shards is not None else None)
            entry = self._programs.for_call(m.program_id)
            if m.ordered:
                wedged = WEDGE.reason()
                if wedged is not None:
                    raise HostWedgedError(
                        f"{self.where} refuses multi-host calls: {wedged}; "
                        "restart every worker process of this cluster")
            elif WEDGE.orphans_running() and \
                    len(entry.decoded.devices) > 1:
                raise HostWedgedError(
                    f"{self.where} refuses calls on more than one device: a "
                    "multi-host call of a controller served before still "
                    "runs here (it may wait in a collective for hosts that "
                    "gave up), and XLA runs no other multi-device program "
                    "here until it returns; single-device calls run; "
                    "restart every worker process of this cluster")
            args = self._inputs(m, entry, get)
        except BaseException as e:
            arrays.release_unused(m, self._released)  # buffers it would use
            if ticket is not None:  # its turn passes, or is held
                self._gate.expect_hold(m.call_id)
                self._lanes.submit(m.lane, lambda cid=m.call_id: (
                    self._gate.enter(ticket), self._gate.end_turn(cid, True)))
            self._send_quietly(error_message(m.call_id, e, self.where,
                                             self.version))
            return None
        discover = m.kind == K.discover
        shm = m.shards is not None and BufferWhere.shm in m.shards.where
        box = [args]  # _run takes the inputs out: nothing else keeps them
        del args
        return lambda: self._run(m.call_id, m.lane, entry, box, discover,
                                 ticket, shm)

    def _inputs(self, m, entry, get) -> list:
        layouts = entry.in_layouts
        s = m.shards if m.shards is not None else messages.Shards()
        per_leaf = arrays.buffers_by_device(s, len(layouts), get, "$.shards")
        return [arrays.assemble(lay, per_leaf[i], i, "input")
                for i, lay in enumerate(layouts)]

    def _run(self, call_id, lane, entry, box, discover, ticket,
             shm=False) -> None:
        args = box.pop()
        if ticket is not None:
            self._gate.enter(ticket)
            with self._multi_lock:  # the session ended while it waited:
                if self._multi_closed:  # no collective for a controller
                    return              # that is gone
                self._multi_running.add(call_id)
        packer = outs = data = key = None
        failed = ran = False  # ran: the function returned (collectives met)
        try:
            if discover:
                self.stats["discoveries"] += 1
                outs, specs = self._inline.discover(entry.ref, args, lane=lane)
            else:
                self.stats["calls"] += 1
                # assembled by the program's own layouts: they match
                outs = self._inline.call(entry.ref, args, lane=lane,
                                         checked=True)
                specs = None
            ran = True
            del args
            # every output in the message: its template, without a Packer
            inline = None if discover else packing.inline_shards(outs)
            if inline is not None:
                key = (K.result, self.version, inline[0])
                data = templates.encode_inline(key, call_id, 0, inline[1])
            if data is not None:
                reply, frames = None, ()
            else:
                packer = packing.Packer(self._pool)
                packer.add_all(outs)
                reply = messages.Message(K.result, call_id=call_id,
                                         shards=packer.finish(), specs=specs,
                                         segments=packer.segments)
                frames = packer.frames
        except BaseException as e:  # the function's (or the outputs') error
            failed = True
            self.stats["errors"] += 1
            if packer is not None:
                packer.abandon()
            packer = data = key = None
            reply, frames = error_message(call_id, e, self.where,
                                           self.version), ()
        finally:
            if ticket is not None:
                self._gate.end_turn(call_id, failed)
                with self._multi_lock:
                    self._multi_running.discard(call_id)
                # only the function failing can leave collectives out of
                # step (not its reply, e.g. for a controller that is gone)
                WEDGE.finished(self, call_id, failed and not ran)
        self._send_reply(call_id, reply, frames, packer, data)
        if key is not None and data is None:  # the next such reply: fast
            templates.remember_inline(key, reply, self.version, inline[1])
        if shm:
            outs = packer = reply = frames = None
            # Reading an array that aliases shared memory back to the host
            # (an output that is an input) leaves JAX objects in a reference
            # cycle holding the mapping: the controller's lease would wait
            # for a full collection, which an idle worker rarely runs.  A
            # young-generation pass (microseconds) frees them now.
            gc.collect(1)

    # --------------------------------------------------------- background
    def _release_loop(self) -> None:
        while True:
            ids = blobs.drain_released(self._released)
            if ids is None:
                return
            if self._ended.is_set():
                return
            self._send_quietly(messages.Message(K.release, released=ids))

    def _heartbeat_loop(self) -> None:
        ping = messages.Message(K.ping)
        while not self._ended.wait(self._heartbeat):
            self._send_quietly(ping)
            if self._maps.in_use():  # (inputs dropped by a running call)
                arrays.release_deferred()

    def _end(self) -> None:
        if self._ended.is_set():
            return
        self._ended.set()
        with self._multi_lock:  # before the next controller is served
            self._multi_closed = True
            WEDGE.session_ended(self, set(self._multi_running),
                                self._gate.holds())
        main_types.NAMESPACE.clear()  # the next controller's are its own
        self._busy_event.set()
        self._gate.break_()
        self._released.put(None)
        self._lanes.close()
        self.channel.close()
        if self._pool is not None:
            self._pool.close()
        # the controller's segments are this session's: a controller killed
        # with a call in flight cannot unlink them (one that closed did),
        # nor the ones it made and had not announced yet
        self._maps.unlink_all()
        if not self.shutdown_requested:
            self._maps.unlink_dead_owners()
        self._maps.clear()
        try:
            self._inline.close()
        except Exception:  # instances' __del__ errors must not stop us
            log.exception("%s: closing the session's executor", self.where)
        if self._on_end is not None:
            self._on_end(self)

    def wait(self, timeout=None) -> bool:
        return self._ended.wait(timeout)


def wait_forever(event: threading.Event) -> None:
    while not event.wait(3600):
        time.sleep(0)
