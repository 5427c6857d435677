"""InlineExecutor: runs colocated programs in this process, through payloads.

It is what ``jax.experimental.colocated_python`` does on CPU (run the function
in-process), but every program arrives as payload bytes and is decoded by the
jaxcolo codec; the body is unpickled only when the program first runs.
Decoded programs are cached by content id and loaded function bodies by the
hash of their bytes, so a warm call decodes and unpickles nothing.

Lanes (see ``jaxcolo.colocated.executor``): a call on an idle lane runs right
away in the calling thread; while a lane has submitted work queued or
running, its later work queues behind it and runs, in order, on a thread
owned by that lane.  Lanes do not wait for each other.
"""

from __future__ import annotations

import collections
import copy
import logging
import threading
import traceback
from concurrent.futures import Future
from typing import Hashable, Sequence

import jax
from jax._src import tree_util as jtu
from jax._src.config import default_device as _default_device

from jaxcolo.codec import spec_tree
from jaxcolo.codec.mesh import make_resolver
from jaxcolo.colocated import program_lifetimes, specs as specs_mod
from jaxcolo.colocated.body import loads_body
from jaxcolo.colocated.executor import Executor, FirstRaised
from jaxcolo.colocated.futures import CallFuture, executor_thread
from jaxcolo.colocated.program import decode_program
from jaxcolo.colocated.recent import RecentSet
from jaxcolo.errors import ExecutorError, PayloadError


# _Loaded.default_device when it is this process's default device anyway
_PROCESS_DEFAULT = object()


class _Loaded:
    """A decoded program and what running it needs."""

    __slots__ = ("program", "n_in", "check_args", "in_treedef", "out_treedef",
                 "out_leaves", "body_key",
                 "fn", "lock", "seen_avals",
                 "seen_shardings", "default_device")

    def __init__(self, program):
        self.program = program
        # Arrays the body makes land on its first device of this process
        # (as in a worker of its own, whatever the process default)
        here = jax.process_index()
        self.default_device = next(
            (d for d in program.devices if d.process_index == here), None)
        if self.default_device is jax.local_devices()[0]:
            self.default_device = _PROCESS_DEFAULT  # unless one is set
        in_leaves, self.in_treedef = jtu.tree_flatten(program.in_specs)
        self.n_in = len(in_leaves)
        self.check_args = specs_mod.ArgCheck(program.name, in_leaves)
        if program.has_out_specs:
            leaves, self.out_treedef = jtu.tree_flatten(program.out_specs)
            self.out_leaves = tuple(leaves)
            self.seen_avals = [None] * len(leaves)
            self.seen_shardings = [s.sharding for s in leaves]
        else:
            self.out_treedef = self.out_leaves = None
        self.body_key = None  # the program's content id (set by _load)
        self.fn = None
        self.lock = threading.Lock()


class _Instance:
    __slots__ = ("lock", "obj", "error", "ready")

    def __init__(self):
        self.lock = threading.Lock()
        self.obj = self.error = None
        self.ready = False

    def fail(self, e: Exception) -> None:
        """Keep ``e``, raised by ``__init__``: its traceback as a note, not
        as frames (they lead back to the first call's callers, and through
        them to the instance's wrapper, which then never destroyed it)."""
        tb = e.__traceback__.tb_next  # __init__'s frames, not this call's
        try:
            e.add_note("Traceback of __init__ (it ran at the instance's "
                       "first call):\n" + "".join(traceback.format_tb(tb)))
        except Exception:  # noqa: BLE001 - __notes__ not a list
            pass
        seen, chained = set(), e
        while chained is not None and id(chained) not in seen:
            seen.add(id(chained))  # causes' frames lead back there too
            chained.__traceback__ = None
            chained = chained.__cause__ or chained.__context__
        self.error = e

    def failed(self) -> BaseException:
        """A copy of the error ``__init__`` raised, to raise (a raise adds
        its callers' frames to the exception: the stored one would keep
        them)."""
        e = self.error
        try:  # (not copy.copy: that calls __init__(*args) again, which an
            cls = type(e)  # __init__ formatting its argument garbled)
            fresh = cls.__new__(cls, *e.args)
            fresh.args = e.args
            fresh.__dict__.update(getattr(e, "__dict__", {}))
        except Exception:  # noqa: BLE001 - a __new__ wanting other args
            return e.with_traceback(None)  # (keeps one call's frames)
        fresh.__cause__ = e.__cause__
        fresh.__suppress_context__ = e.__suppress_context__
        notes = getattr(e, "__notes__", None)
        if isinstance(notes, list):  # its own: callers add notes to it
            fresh.__notes__ = list(notes)
        return fresh


class _Lane:
    __slots__ = ("queue", "pending", "running")

    def __init__(self):
        self.queue = collections.deque()
        self.pending = 0      # items queued or running
        self.running = False  # a runner thread is draining the queue


log = logging.getLogger("jaxcolo.executor")


def _fail_unrun(fut) -> None:
    if fut.set_running_or_notify_cancel():
        fut.set_exception(ExecutorError(
            "InlineExecutor closed before this call ran"))


def _complete(setter, value) -> None:
    """Complete a future; what its done-callbacks raise past the Future's
    own handling (a BaseException: ``sys.exit`` in a callback) is logged,
    as by a ThreadPoolExecutor's worker, not let kill the lane's thread
    (the lane stayed marked running: its later calls never ran)."""
    try:
        setter(value)
    except BaseException:  # noqa: BLE001
        log.exception("a done-callback raised")


class InlineExecutor(Executor):
    """Runs programs in the calling process (the default executor).

    ``devices``: the devices this executor hosts (default: every device of
    this process).  Program and captured device ids resolve against them; an
    id outside them is a PayloadError naming the id.  ``keep(program_id)``:
    may what is loaded for a program be kept (a worker: is it still
    registered)?  None: always.  ``decode(program, resolver)``: how a
    program is decoded to run (a worker: as it was registered).
    """

    def __init__(self, devices=None, keep=None, decode=None):
        self._keep = keep
        self._decode = decode or (
            lambda program, resolver: decode_program(program.payload,
                                                     resolver))
        self._resolver = make_resolver(
            None if devices is None else {d.id: d for d in devices})
        self._lock = threading.RLock()  # RLock: destroy may run from GC
        self._programs: dict[bytes, _Loaded] = {}
        self._bodies: dict[bytes, object] = {}
        self._instances: dict[int, _Instance] = {}
        self._destroyed = RecentSet()  # instance ids (the newest)
        self._queued_methods: dict[int, int] = {}  # instance id -> calls
        self._instance_programs: dict[int, list] = {}  # id -> program ids
        self._destroy_after: set[int] = set()
        self._lanes: dict[Hashable, _Lane] = {}
        self._closed = False
        self._stats = collections.Counter()
        self._calls = 0  # a plain int: the warm path stays cheap
        # programs no function holds any more are forgotten at a next call
        self._lifetimes = program_lifetimes.Subscription()

    def stats(self) -> dict:
        """Counters: programs_decoded, programs_forgotten, bodies_loaded,
        instances_created, instances_destroyed, calls, discoveries, queued;
        programs_loaded_now."""
        return dict(self._stats, calls=self._calls,
                    programs_loaded_now=len(self._programs))

    def __repr__(self):
        return (f"InlineExecutor({len(self._programs)} programs, "
                f"{len(self._instances)} instances"
                f"{', closed' if self._closed else ''})")

    # ------------------------------------------------------------ interface
    def call(self, program, args: Sequence, *, lane: Hashable,
             checked: bool = False) -> list:
        if self._closed:
            raise ExecutorError("InlineExecutor is closed")
        loaded = self._loaded(program)
        self._calls += 1
        ln = self._lanes.get(lane)
        if ln is None or not ln.pending:
            return self._run(loaded, args, checked)
        return self._enqueue(lane, self._run, loaded, args, checked,
                             program=program).result()

    def submit(self, program, args: Sequence, *, lane: Hashable,
               checked: bool = False) -> Future:
        if self._closed:
            raise ExecutorError("InlineExecutor is closed")
        loaded = self._loaded(program)
        self._calls += 1  # (the queued call holds its ProgramRef: counted
        return self._enqueue(lane, self._run, loaded, args, checked,  # alive)
                             program=program)

    def discover(self, program, args: Sequence, *,
                 lane: Hashable) -> tuple[list, bytes]:
        if self._closed:
            raise ExecutorError("InlineExecutor is closed")
        loaded = self._loaded(program)
        self._stats["discoveries"] += 1
        ln = self._lanes.get(lane)
        if ln is None or not ln.pending:
            return self._discover(loaded, args)
        return self._enqueue(lane, self._discover, loaded, args,
                             program=program).result()

    def destroy_instance(self, instance_id: int, *, lane: Hashable) -> None:
        """Destroy the instance once no queued call of it is left, in any
        lane (a call submitted by one thread may be queued while another
        thread drops the last reference)."""
        with self._lock:
            if self._closed:
                return
            if self._queued_methods.get(instance_id):
                self._destroy_after.add(instance_id)
                return
        self._destroy(instance_id)

    def close(self) -> None:
        queued = []
        with self._lock:
            self._closed = True
            for ln in self._lanes.values():
                while ln.queue:
                    queued.append(ln.queue.popleft()[0])
                    ln.pending -= 1
            self._destroy_after.clear()
            instances, self._instances = self._instances, {}
            self._destroyed.update(instances)
            self._programs.clear()
            self._instance_programs.clear()
            self._bodies.clear()
        self._lifetimes.close()
        del instances  # host instances are destroyed here
        # Failed outside the lock (their callbacks may call in), every one
        # of them whatever a callback raises (sys.exit: raised after).
        first = FirstRaised(defer_interrupts=True)
        for fut in queued:
            first.run(_fail_unrun, fut)
        first.reraise()

    # ------------------------------------------------------------- loading
    def _loaded(self, program) -> _Loaded:
        if self._lifetimes.pending():
            ids = self._lifetimes.take()
            if ids:
                self.forget(ids)
        return self._programs.get(program.id) or self._load(program)

    def forget(self, program_ids) -> None:
        """Drop what was loaded for these programs (decoded specs, loaded
        bodies); a later call of one of them loads it again.  Calls running
        it are not affected; host instances live on (a method program is
        loaded again at the instance's next call)."""
        with self._lock:
            for pid in program_ids:
                if self._programs.pop(pid, None) is not None:
                    self._stats["programs_forgotten"] += 1
                self._bodies.pop(pid, None)
        self._lifetimes.unnote(program_ids)

    def _load(self, program) -> _Loaded:
        loaded = self._decode(program, self._resolver)
        entry = _Loaded(loaded)
        # One loaded body per program, as JAX loads one per specialisation
        # (and one for output discovery): closure state is not shared
        # between a function's specialisations.
        entry.body_key = program.id
        self._lifetimes.note(program.id)
        with self._lock:
            self._stats["programs_decoded"] += 1
            if loaded.kind == "method" and \
                    loaded.instance_id in self._destroyed:
                return entry  # its calls fail; never held again
            if self._keep is not None and not self._keep(program.id):
                return entry  # forgotten already (a call queued before)
            held = self._programs.setdefault(program.id, entry)
            if held is entry and loaded.kind == "method":  # goes with it
                ids = self._instance_programs.setdefault(
                    loaded.instance_id, [])
                if program.id not in ids:  # (loaded again after a forget)
                    ids.append(program.id)
            return held

    def _function(self, loaded: _Loaded):
        """The callable a call runs (loading the body on first use)."""
        prog = loaded.program
        if prog.kind == "method":
            return getattr(self._instance(loaded), prog.method_name)
        fn = loaded.fn
        if fn is None:
            with loaded.lock:
                fn = loaded.fn
                if fn is None:
                    fn = self._bodies.get(loaded.body_key)
                    if fn is None:
                        fn = self._load_body(prog)
                        with self._lock:  # not if forgotten meanwhile
                            if self._programs.get(loaded.body_key) is loaded:
                                fn = self._bodies.setdefault(
                                    loaded.body_key, fn)
                    loaded.fn = fn
        return fn

    def _load_body(self, prog):
        try:
            obj = loads_body(prog.body, self._resolver)
        except PayloadError as e:
            raise PayloadError(f"cannot load the body of {prog.name!r}: "
                               f"{e.reason}", e.path) from None
        self._stats["bodies_loaded"] += 1
        return obj

    def _instance(self, loaded: _Loaded):
        prog = loaded.program
        iid = prog.instance_id
        inst = self._instances.get(iid)
        if inst is None or not inst.ready:
            with self._lock:
                if iid in self._destroyed:
                    raise ExecutorError(
                        f"{prog.name}: instance {iid} was already destroyed")
                inst = self._instances.get(iid)
                if inst is None:
                    inst = self._instances[iid] = _Instance()
            with inst.lock:
                if not inst.ready:
                    try:
                        cls, init_args, init_kwargs = self._load_body(prog)
                        inst.obj = cls(*init_args, **init_kwargs)
                        self._stats["instances_created"] += 1
                    except Exception as e:
                        inst.fail(e)
                    inst.ready = True
        if inst.error is not None:
            raise inst.failed()
        return inst.obj

    def _destroy(self, instance_id: int) -> None:
        with self._lock:
            inst = self._instances.pop(instance_id, None)
            self._destroyed.add(instance_id)
            for pid in self._instance_programs.pop(instance_id, ()):
                self._programs.pop(pid, None)
            if inst is not None and inst.obj is not None:
                self._stats["instances_destroyed"] += 1
        del inst  # the host instance's last reference: __del__ runs here

    # ------------------------------------------------------------- running
    def _invoke(self, loaded: _Loaded, args: Sequence, checked=False):
        if not checked:  # Executor.call is public: other callers' arrays
            loaded.check_args(args)
        device = loaded.default_device
        if device is _PROCESS_DEFAULT:
            if _default_device.value is None:  # the same: no context
                return self._call_body(loaded, args)  # (~0.6 us)
            device = jax.local_devices()[0]
        with jax.default_device(device):
            return self._call_body(loaded, args)

    def _call_body(self, loaded: _Loaded, args: Sequence):
        """(leaves, treedef) of the body's outputs (an instance's
        ``__init__`` runs here, at its first method call)."""
        fn = self._function(loaded)
        a, kw = loaded.in_treedef.unflatten(args)
        return jtu.tree_flatten(fn(*a, **kw))

    def _run(self, loaded: _Loaded, args: Sequence, checked=False) -> list:
        leaves, treedef = self._invoke(loaded, args, checked)
        if loaded.out_treedef is None:
            raise ValueError(f"{loaded.program.name}: program has no out_specs; "
                             "use discover")
        if treedef != loaded.out_treedef:
            raise ValueError(
                f"{loaded.program.name}: output structure {treedef} does not "
                f"match the out specs' {loaded.out_treedef}")
        # Avals and shardings already found to match the spec are
        # recognised by identity (JAX interns avals; passed-through arrays
        # keep their sharding objects), so most checks are two `is`.
        seen_avals, seen_shardings = loaded.seen_avals, loaded.seen_shardings
        for i, spec in enumerate(loaded.out_leaves):
            x = leaves[i]
            try:
                aval, s = x.aval, x.sharding
                ok = aval is seen_avals[i]
                if not ok and x.shape == spec.shape and x.dtype == spec.dtype:
                    ok, seen_avals[i] = True, aval
                if ok and s is not seen_shardings[i]:
                    ok = s == spec.sharding
                    if ok:
                        seen_shardings[i] = s
            except AttributeError:
                ok = False
            if not ok:
                specs_mod.get_spec(x)  # a non-array gets the usual message
                raise ValueError(f"{loaded.program.name}: output {i} does not "
                                 "match its out spec: "
                                 + specs_mod.describe_mismatch(x, spec))
        return leaves

    def _discover(self, loaded: _Loaded, args: Sequence) -> tuple[list, bytes]:
        leaves, treedef = self._invoke(loaded, args)
        out_specs = [specs_mod.get_spec(x) for x in leaves]
        payload = spec_tree.encode_spec_tree(
            treedef.unflatten(out_specs), loaded.program.writer_version)
        return leaves, payload

    # --------------------------------------------------------------- lanes
    def _enqueue(self, lane: Hashable, fn, loaded: _Loaded, *args,
                 program=None) -> Future:
        fut = CallFuture()  # (callbacks never on the lane's runner)
        iid = loaded.program.instance_id if \
            loaded.program.kind == "method" else 0
        with self._lock:
            if self._closed:
                raise ExecutorError("InlineExecutor is closed")
            ln = self._lanes.get(lane)
            if ln is None:
                ln = self._lanes[lane] = _Lane()
            ln.queue.append((fut, fn, (loaded, *args), iid, program))
            if iid:
                self._queued_methods[iid] = \
                    self._queued_methods.get(iid, 0) + 1
            ln.pending += 1
            self._stats["queued"] += 1
            start = not ln.running
            ln.running = True
        if start:
            threading.Thread(target=self._drain, args=(lane, ln), daemon=True,
                             name=f"jaxcolo-inline-lane-{lane}").start()
        return fut

    def _method_call_done(self, iid: int) -> None:
        with self._lock:
            n = self._queued_methods.pop(iid, 1) - 1
            if n:
                self._queued_methods[iid] = n
                return
            if iid not in self._destroy_after:
                return
            self._destroy_after.discard(iid)
        self._destroy(iid)

    def _drain(self, lane: Hashable, ln: _Lane) -> None:
        # The runner is a thread the lane depends on: futures completed
        # here run their callbacks on their own thread (one waiting for a
        # later call of this lane would otherwise wait for ever).
        with executor_thread():
            self._drain_lane(lane, ln)

    def _drain_lane(self, lane: Hashable, ln: _Lane) -> None:
        while True:
            with self._lock:
                if not ln.queue:
                    ln.running = False
                    if not ln.pending and self._lanes.get(lane) is ln:
                        del self._lanes[lane]
                    return
                fut, fn, args, iid, program = ln.queue.popleft()
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        result = fn(*args)
                    except BaseException as e:  # delivered to the caller
                        _complete(fut.set_exception, e)
                    else:
                        _complete(fut.set_result, result)
                    result = None
            finally:
                del args, program
                with self._lock:
                    ln.pending -= 1
                if iid:
                    self._method_call_done(iid)
