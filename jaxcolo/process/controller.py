"""``ProcessExecutor``: colocated programs run in worker processes.

Each worker stands for one *host* owning a block of the controller's
devices.  ``ProcessExecutor(num_hosts=H)`` starts H workers on this machine
(``jaxcolo.process.launch``; with H > 1 they form a ``jax.distributed``
cluster); ``ProcessExecutor(addresses=[...], authkey=...)`` connects to
running ``jaxcolo worker`` processes instead.

Contract (see ``jaxcolo.colocated.executor`` for the Executor interface):

* A program is registered once per host connection and named by content id
  afterwards.  A call runs on every host owning one of the program's
  devices; each gets its own input shards and returns its output shards;
  the controller assembles jax.Arrays on its own devices with the specs'
  shardings.  Calls spanning hosts are sent to their hosts in one
  executor-wide order, which every host follows (so their cross-host
  collectives line up); other calls of different lanes run concurrently.
  The parts of a multi-host call all go to hosts of one cluster generation:
  a host lost while it is sent fails the call, and none of it reaches the
  restarted cluster.
* Instances of colocated classes are destroyed on their hosts after their
  calls still in flight (``jaxcolo.process.instances``; a timed-out call
  is not in flight any more).
* Errors: the function's exception is re-raised with its own type (the
  remote traceback in a note).  ``ExecutorError`` when: the executor is
  closed (in-flight calls fail at ``close``), a call times out
  (``call_timeout``, or ``with ex.timeout(s):``, seconds > 0, None or inf
  for none; the call may still run on its host and its result is dropped;
  the timeout covers its sends too, see ``jaxcolo.process.sending``),
  or a worker is lost (EOF, or
  ``lost_timeout`` seconds without a heartbeat).  A lost call is never
  retried.  Local workers are then restarted (the whole cluster when there
  are several hosts); calls wait for the restart; class instances that
  lived on a restarted host raise ExecutorError rather than silently
  starting over.  Start-up, loss and restart: ``jaxcolo.process.hostset``;
  multi-host calls that fail on some host: ``jaxcolo.process.stragglers``.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Hashable, Sequence

import jax

from jaxcolo.colocated.executor import Executor, FirstRaised
from jaxcolo.colocated.futures import executor_thread
from jaxcolo.colocated import program_lifetimes
from jaxcolo.colocated.program import ProgramRef, decode_program
from jaxcolo.colocated.recent import RecentSet
from jaxcolo.errors import ExecutorError, UnknownDeviceError
from jaxcolo.process import messages, remote_errors
from jaxcolo.process.deadlines import Deadlines, check_timeout
from jaxcolo.process.forgetting import ProgramForgetting
from jaxcolo.process.hosts import controller_hello
from jaxcolo.process.hostset import HostSet
from jaxcolo.process.instances import DestroyQueue
from jaxcolo.process.lane_order import LaneOrder
from jaxcolo.process import launch, lifetime, options, packing
from jaxcolo.process.results import Call, Plan
from jaxcolo.process.sending import CallSending
from jaxcolo.process.stragglers import MultiHostSettling
from jaxcolo.transport import blobs, interrupts

_LANE_MASK = (1 << 63) - 1
# close() waits up to this long for multi-host calls that failed on some
# host to be done on the others and resumed (running workers).
CLOSE_SETTLE_TIMEOUT = 5.0


class ProcessExecutor(HostSet, MultiHostSettling, CallSending,
                      ProgramForgetting, Executor):
    """Runs colocated programs in worker processes (see module docstring).

    ``num_hosts``: start this many local workers, each owning an equal
    contiguous block of ``devices`` (default: this process's CPU devices).
    ``addresses``/``authkey``: connect to running workers instead.
    ``call_timeout``: default per-call timeout in seconds (None: none).
    ``lost_timeout``: a worker silent this long is lost.  ``heartbeat``:
    how often workers send a heartbeat (default 1 s, or a quarter of a
    shorter ``lost_timeout``; ``lost_timeout`` must span three).
    ``straggler_timeout``: seconds the hosts of a multi-host call that
    failed on one host (or timed out) get to be done with it before they
    are lost -- they may wait in a collective that never completes (None:
    wait forever).  ``restart``:
    restart lost local workers.  ``min_version``/``max_version``: the
    payload versions this controller speaks (default: all it can).
    ``shm``: use shared memory for large buffers when the worker shares
    this machine's /dev/shm.  ``shm_retain``: bytes of shared-memory pages
    the idle segments of each side of a connection keep for reuse (the
    rest are given back; local workers are started with the same value).
    ``local_transport``: how started workers are reached, ``"unix"``
    (Unix-domain sockets in a private directory; the default, cheapest per
    message) or ``"tcp"`` (loopback).
    """

    def __init__(self, num_hosts: int | None = None, *, addresses=None,
                 authkey: bytes | None = None, devices=None,
                 call_timeout: float | None = None, lost_timeout: float = 10.0,
                 heartbeat: float | None = None, start_timeout: float = 120.0,
                 straggler_timeout: float | None = 60.0,
                 connect_timeout: float = 10.0, restart: bool = True,
                 min_version: int | None = None,
                 max_version: int | None = None, shm: bool = True,
                 shm_retain: int = blobs.DEFAULT_RETAIN,
                 local_transport: str = "unix", worker_args=()):
        addresses = options.check_hosts(num_hosts, addresses, authkey)
        self._devices = list(devices if devices is not None
                             else jax.local_devices(backend="cpu"))
        self._by_id = {d.id: d for d in self._devices}
        self._hello = controller_hello(min_version, max_version)
        self._authkey = authkey or secrets.token_bytes(32)
        self._opts = dict(
            timeout=options.check_seconds(connect_timeout,
                                          "connect_timeout"),
            lost_timeout=options.check_seconds(lost_timeout,
                                               "lost_timeout"),
            heartbeat=options.heartbeat_period(heartbeat, lost_timeout),
            use_shm=shm,
            shm_retain=blobs.check_retain(shm_retain, "shm_retain"))
        self._start_timeout = options.check_seconds(start_timeout,
                                                    "start_timeout")
        self._call_timeout = check_timeout(call_timeout, "call_timeout")
        self._straggler_timeout = check_timeout(straggler_timeout,
                                                "straggler_timeout")
        self._wedged: dict = {}  # running workers: (address, pid) -> why
        self._resuming = 0  # threads sending resumes
        self._holding: set = set()  # multi-host calls hosts hold after
        self._unheld: set = set()  # ... that the controller holds after
        # host -> weakref to the last multi-host call sent there (sessions
        # before v7 send the next one once it is done on all its hosts)
        self._last_multi_host: dict = {}
        self._restart = restart
        self._worker_args = tuple(worker_args)
        if shm_retain != blobs.DEFAULT_RETAIN and not any(
                str(a).startswith("--shm-retain") for a in worker_args):
            self._worker_args += ("--shm-retain", str(shm_retain))
        # jax.config as this thread sees it now, for workers (re)started
        self._worker_env = launch.worker_env() if num_hosts else None
        if local_transport not in ("unix", "tcp"):
            raise ValueError("local_transport is 'unix' or 'tcp'")
        if num_hosts is not None and (num_hosts < 1 or
                                      len(self._devices) % num_hosts):
            raise ValueError(f"{len(self._devices)} devices do not split "
                             f"into {num_hosts} hosts")
        self._socket_dir = None
        # what a finalizer releases if this executor is never closed (from
        # here on: an __init__ failing later releases what it made)
        owned = self._owned = lifetime.Owned()
        if num_hosts is not None and local_transport == "unix":
            self._socket_dir = tempfile.mkdtemp(prefix="jaxcolo-")
            # removed at close(), or by the finalizer
            self._remove_socket_dir = owned.socket_dir = lifetime.once(
                shutil.rmtree, self._socket_dir, True)
        self._release = lifetime.finalizer(self, owned)
        self._lock = threading.RLock()
        self._ordered_lock = threading.Lock()
        self._ready = threading.Event()
        self._closed = False
        self._ids = itertools.count(1)
        self._plans: dict = {}
        # programs no function holds any more are forgotten at a next call
        self._lifetimes = program_lifetimes.Subscription()
        self._instance_plans: dict = {}    # instance id -> program ids
        self._destroyed = RecentSet()      # instance ids sent a destroy
        self._pending: dict = {}           # call id -> (Call, host, link)
        self._instances: dict = {}         # instance id -> set of hosts
        self._lost_instances: dict = {}    # instance id -> reason
        self._lanes: dict = {}
        self._restart_error = None
        self._local = threading.local()
        self._stats = {"calls": 0, "discoveries": 0, "programs_decoded": 0,
                       "restarts": 0, "lost": 0, "timeouts": 0}
        self._workers: list = []
        self._links: list = []
        if num_hosts is not None:
            n = len(self._devices) // num_hosts
            self._device_map = [[d.id for d in self._devices[i * n:(i + 1) * n]]
                                for i in range(num_hosts)]
            self._addresses = None
            try:
                self._start_local()
            except BaseException:
                if self._socket_dir is not None:
                    self._remove_socket_dir()
                raise
        else:
            self._device_map = None
            self._addresses = addresses
            self._reconnect_locks = [threading.Lock() for _ in
                                     self._addresses]
            self._reconnect_failed: dict = {}  # host -> (time, message)
            self._connect_all()
        self._deadlines = Deadlines(lifetime.weak(self._expired),
                                    lifetime.weak(self._check_stragglers))
        self._destroys = DestroyQueue(lifetime.weak(self._send_destroy))
        self._lane_order = LaneOrder(lifetime.weak(self._dispatch),
                                     keep=packing.private_copies)
        # Ctrl-C waits until the main thread is between messages
        self._sigint = interrupts.install()
        owned.deadlines, owned.destroys = self._deadlines, self._destroys
        owned.sigint = self._sigint
        lost = self._set_ready_unless_lost()
        if lost:
            self._ready.set()
            self.close()
            raise ExecutorError(f"{lost[0].describe} was lost while the "
                                "executor started")

    @property
    def payload_version(self) -> int:
        return self._version

    @property
    def num_hosts(self) -> int:
        return len(self._links)

    def __repr__(self):
        return (f"ProcessExecutor({len(self._links)} hosts"
                f"{', closed' if self._closed else ''})")

    def worker_pids(self) -> list:
        return [link.pid for link in self._links]

    def addresses(self) -> list:
        return [link.address for link in self._links]

    # ------------------------------------------------------------ plans
    def _plan(self, program) -> Plan:
        owned = {i: d for i, d in self._by_id.items() if i in self._owner}
        try:
            prog = decode_program(program.payload, owned)
        except UnknownDeviceError as e:  # a device no connected host owns
            raise UnknownDeviceError(
                f"{e.reason}: no host of this executor owns it (its hosts "
                f"own device ids {options.id_ranges(sorted(self._owner))})",
                e.path) from None
        with self._lock:
            self._stats["programs_decoded"] += 1
        # (a copy: the caller's ProgramRef is counted while it lives)
        plan = Plan(ProgramRef(program.id, program.payload), prog,
                    self._owner)
        self._lifetimes.note(program.id)
        with self._lock:
            if plan.instance_id in self._destroyed:
                return plan  # its calls fail; never held again
            held = self._plans.setdefault(program.id, plan)
            if held is plan and plan.instance_id:  # dropped with it
                ids = self._instance_plans.setdefault(plan.instance_id, [])
                if program.id not in ids:  # (planned again after a forget)
                    ids.append(program.id)
        return held

    def _lane(self, lane: Hashable) -> int:
        if type(lane) is int:
            return (lane & _LANE_MASK) or 1
        with self._lock:
            v = self._lanes.get(lane)
            if v is None:
                v = self._lanes[lane] = len(self._lanes) + 1
            return v

    # --------------------------------------------------------- interface
    def call(self, program, args: Sequence, *, lane: Hashable,
             checked: bool = False) -> list:
        return self._wait(self._start(program, args, lane, False, checked,
                                      sync=True))

    def submit(self, program, args: Sequence, *, lane: Hashable,
               checked: bool = False) -> Future:
        lifetime.check_not_exiting()
        call = self._start(program, args, lane, False, checked)
        for _, link in call.links:
            link.kick()  # nobody waits: the links' background readers read
        lifetime.hold_until_done(self, call.future)
        return call.future

    def discover(self, program, args: Sequence, *,
                 lane: Hashable) -> tuple[list, bytes]:
        return self._wait(self._start(program, args, lane, True, sync=True))

    @staticmethod
    def _wait(call: Call):
        """The call's result, read by this thread from each host's link
        (no hand-off) unless another thread is already reading it."""
        for h, link in call.links:
            link.wait_for(lambda h=h: call.has_part(h) or call.future.done())
        return call.wait()

    def destroy_instance(self, instance_id: int, *, lane: Hashable) -> None:
        """Request the instance's destroy and return at once (this runs
        from a finalizer; see ``jaxcolo.process.instances``)."""
        if not self._closed:
            self._destroys.destroy(instance_id, lane)

    def _send_destroy(self, instance_id: int, lane) -> None:
        with self._lock:
            if self._closed:
                return
            hosts = self._instances.pop(instance_id, ())
            self._lost_instances.pop(instance_id, None)
            self._destroyed.add(instance_id)
            dropped = self._instance_plans.pop(instance_id, ())
            for pid in dropped:
                self._plans.pop(pid, None)
        for link in self._links:  # the hosts drop them too
            link.registered.difference_update(dropped)
        msg = messages.Message(messages.MessageKind.destroy,
                               lane=self._lane(lane), instance_id=instance_id)
        for h in sorted(hosts):
            link = self._links[h]
            try:
                link.send(msg)
            except ExecutorError:
                pass  # a lost host has no instances left

    def timeout(self, seconds: float | None):
        """Calls made by this thread inside the block time out after
        ``seconds`` (None: no timeout)."""
        return self._timeout_block(seconds, None)

    def timeout_left(self, seconds: float, stated: float):
        return self._timeout_block(seconds, stated)

    @contextlib.contextmanager
    def _timeout_block(self, seconds, stated):
        """``stated``: the timeout to name in messages (None: ``seconds``)."""
        previous = getattr(self._local, "timeout", False), \
            getattr(self._local, "stated", None)
        self._local.timeout = check_timeout(seconds, "timeout")
        self._local.stated = stated
        try:
            yield self
        finally:
            self._local.timeout, self._local.stated = previous

    def call_timeout(self) -> float | None:
        """This thread's timeout (``timeout()`` block), else call_timeout."""
        timeout = getattr(self._local, "timeout", False)
        return self._call_timeout if timeout is False else timeout

    def _stated_timeout(self, timeout: float | None) -> float | None:
        """The timeout to name in a message about ``timeout`` running out."""
        if timeout is None:
            return None
        return getattr(self._local, "stated", None) or timeout

    def stats(self, timeout: float = 10.0) -> dict:
        """Controller counters, plus each host's (``hosts``) and their sums
        for ``bodies_loaded``, ``instances_created``, ``registered``;
        ``controller_segments``: per host, the controller's shared-memory
        segments for it ({} without shared memory).  A host that does not
        answer within ``timeout`` seconds has only ``error``: why."""
        with self._lock:
            out = dict(self._stats)
        hosts = []
        for link in self._links:
            if self._closed:  # (its links are closed: no errno to show)
                hosts.append({"error": "ProcessExecutor is closed"})
                continue
            try:
                hosts.append(link.request_stats(timeout))
            except ExecutorError as e:
                hosts.append({"error": str(e)})
        out["hosts"] = hosts
        for k in ("bodies_loaded", "instances_created", "registered",
                  "refused"):
            out[k] = sum(h.get(k, 0) for h in hosts)
        out["refused_by_hosts"] = sum(link.refused for link in self._links)
        out["controller_segments"] = [
            link.pool.stats() if link.pool is not None else {}
            for link in self._links]
        return out

    # ------------------------------------------------------------- calls
    def _start(self, program, args, lane, discover: bool,
               checked: bool = False, sync: bool = False) -> Call:
        if self._closed:
            raise ExecutorError("ProcessExecutor is closed")
        if (self._forgets_unsent or self._lifetimes.pending()) and \
                not self._forget_unheld() and \
                self._lifetimes.is_gone(program.id):
            # its id died and came back: never run on the dead one's plan
            # and registrations (their state), skipped while others register
            self._forget_unheld(wait=True)
        plan = self._plans.get(program.id) or self._plan(program)
        if not checked:  # shards are raw bytes: never reinterpret them
            plan.check_args(args)
        if plan.instance_id:
            self._check_instance(plan)
        timeout = self.call_timeout()
        stated = self._stated_timeout(timeout)  # named in messages
        started = time.monotonic()
        limit = None if timeout is None else (started + timeout, stated)
        lane_id = self._lane(lane)
        call = Call(plan, discover, remote_errors.exception_from_reply)
        call.program = program
        if len(plan.hosts) > 1:  # (Future's own method: inline, any thread;
            settle = lifetime.weak(self._check_settled)  # no cycle through
            ref = weakref.ref(call)                      # the call)
            Future.add_done_callback(
                call.future, lambda _: ref() is not None and settle(ref()))
        destroys = self._destroys
        iid = plan.instance_id
        counted = False
        try:
            if iid:  # its destroy waits for it
                destroys.call(iid)
                counted = True
                Future.add_done_callback(call.future,
                                         lambda _: destroys.done(iid))
                counted = False  # the callback counts it down now
            if destroys.due():  # destroys requested before this call
                if not destroys.flush(None if limit is None else limit[0]):
                    call.fail(ExecutorError(
                        f"{plan.name}: call timed out after {stated}s "
                        "waiting for the destroys of instances dropped "
                        "before it to be sent; it was not sent"))
                    return call
            with self._lock:
                self._stats["discoveries" if discover else "calls"] += 1
            if self._lane_order.admit(call, args, lane_id, limit, sync):
                self._dispatch(call, args, lane_id, limit)
        except BaseException as e:  # e.g. KeyboardInterrupt while waiting
            call.fail(e)
            if counted:
                destroys.done(iid)
            raise
        if timeout is not None:  # waits for a restart count too
            self._deadlines.add(call, timeout, started, shown=stated)
        return call

    def _on_reply(self, link, call_id, m, get) -> None:
        with self._lock:
            entry = self._pending.pop(call_id, None)
        if entry is None:
            return False  # timed out, or failed at close: dropped
        call, h, _ = entry
        used = call.part_done(h, link, m, get)
        if len(call.plan.hosts) > 1:
            self._multi_host_reply(call, call_id, link, m)
        return used

    def _check_instance(self, plan) -> None:
        if plan.instance_id in self._destroyed:
            raise ExecutorError(f"{plan.name}: instance {plan.instance_id} "
                                "was already destroyed")
        reason = self._lost_instances.get(plan.instance_id)
        if reason is not None:
            raise ExecutorError(
                f"{plan.name}: the host instance {plan.instance_id} was lost "
                f"({reason}); its state is gone, make a new instance")

    def _expired(self, call: Call, seconds: float) -> None:
        """``call`` is still running at its deadline (deadline thread)."""
        with self._lock:
            if call.future.done():
                return
            call.timed_out = True
            self._stats["timeouts"] += 1
            multi = len(call.plan.hosts) > 1
            if not multi:  # multi-host: late replies still tell which
                for cid in call.call_ids:  # hosts are done with it
                    self._pending.pop(cid, None)
        with executor_thread():
            call.fail(ExecutorError(
                f"{call.plan.name}: call timed out after {seconds}s on "
                f"host(s) {list(call.plan.hosts)}; it may still run there, "
                "its result will be dropped (a host runs a thread's calls in "
                "program order: this one may wait there behind the thread's "
                "earlier calls, such as one that timed out and still runs)"
                if call.call_ids else
                f"{call.plan.name}: call timed out after {seconds}s waiting "
                f"for {call.waits_for}; it was not sent"
                if call.waits_for else
                f"{call.plan.name}: call timed out after {seconds}s before "
                "it was sent (it waited for this thread's earlier calls on "
                "other hosts); it was not sent"))
        if multi:  # still running straggler_timeout later: stuck
            self._watch_stragglers(call)

    # ------------------------------------------------------------- close
    def close(self) -> None:
        if not self._closed:
            self._settle_holds(CLOSE_SETTLE_TIMEOUT)
        with self._lock:
            closing = not self._closed
            if closing:
                self._closed = True
                pending, self._pending = self._pending, {}
                # the shutdown is this close()'s unless the exit hook (on
                # the main thread, while this runs on another) took it
                mine = lifetime.claim(self._owned)
        if not closing:  # closed, or being closed on another thread
            lifetime.wait_released(self._owned)
            return
        # Every call fails whatever its callbacks raise; a callback's
        # sys.exit is raised once closed, Ctrl-C once the calls failed.
        first = FirstRaised(defer_interrupts=True)
        try:
            for call, h, link in pending.values():
                first.run(call.fail, ExecutorError(
                    f"ProcessExecutor closed while this call was in flight "
                    f"on {link.describe}"))
            first.run(self._lane_order.close, ExecutorError(
                "ProcessExecutor closed while this call waited for its "
                "thread's earlier calls on other hosts"))
            first.reraise_interrupt()
            self._ready.wait(self._start_timeout)
            if mine:  # (what the finalizer would release: the same)
                lifetime.shut_down(self._owned, keep_going=False)
            else:
                lifetime.wait_released(self._owned)
            self._lifetimes.close()
            self._ready.set()
        finally:
            if mine:  # (also when interrupted before its steps)
                self._owned.done.set()
            # released here, not by the finalizer; only now, so that the
            # exit hook finds an executor being closed and waits for it
            release = getattr(self, "_release", None)
            if release is not None:
                lifetime.detach(release, self._owned)
        first.reraise()  # what a done-callback raised, once closed

