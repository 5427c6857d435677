"""``colocated_python(fn)``: the controller side of a colocated function.

A :class:`ColocatedFunction` keeps one
:class:`~jaxcolo.colocated.specialized.Specialized` per input signature
(``jaxcolo.colocated.cache``).  A specialisation knows its input specs,
devices and, once known, output specs; from them it builds program payloads
(``jaxcolo.colocated.program``) at the executor's payload version, which
the function hands to the current executor (``jaxcolo.colocated.executor``).

Semantics follow ``jax.experimental.colocated_python`` (JAX 0.10.2):

* arguments and results are pytrees of jax.Arrays; all arguments share one
  device list unless ``devices`` is specialised; results must live on the
  program's devices;
* without ``out_specs_fn`` the first call of a signature runs synchronously
  to discover the output specs (a *discovery* program); concurrent first
  calls of that signature wait for it, later calls reuse the specs;
* ``specialize`` pins in_specs, out_specs_fn and devices, each at most once.

Each specialisation pickles the function body when it first encodes a
program (as JAX pickles one per specialisation): a global the body captures
by value is the one of that moment, in every program of that
specialisation.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from concurrent.futures import CancelledError, Future
from typing import Any, Callable

from jax._src import tree_util as jtu
from jax._src.lib import xla_client as xc

from jaxcolo.colocated import specs as specs_mod
from jaxcolo.colocated.body import dumps_body
from jaxcolo.colocated.cache import SignatureCache, fast_key
from jaxcolo.colocated.executor import current_lane, get_executor
from jaxcolo.colocated.program import ProgramRef
from jaxcolo.colocated.specialized import NO_OUT_SPECS, SPECS_KNOWN, \
    Specialized, call_deadline, time_left

_flatten = jtu.tree_flatten


def _source_info(obj) -> str | None:
    try:
        from jax._src import api_util
        return api_util.fun_sourceinfo(obj)
    except Exception:
        return None


@dataclasses.dataclass(frozen=True)
class Specialization:
    """What ``specialize`` pinned.  Each field may be set once."""

    in_specs_treedef: Any = None
    in_specs_leaves: tuple | None = None
    out_specs_fn: Callable | None = None
    devices: xc.DeviceList | None = None

    def update(self, *, in_specs_treedef=None, in_specs_leaves=None,
               out_specs_fn=None, devices=None) -> "Specialization":
        if in_specs_treedef is not None and self.in_specs_treedef is not None:
            raise ValueError("in_specs already specified")
        if out_specs_fn is not None and self.out_specs_fn is not None:
            raise ValueError("out_specs_fn already specified")
        if devices is not None and self.devices is not None:
            raise ValueError("devices already specified")
        return Specialization(
            self.in_specs_treedef if in_specs_treedef is None else in_specs_treedef,
            self.in_specs_leaves if in_specs_leaves is None else in_specs_leaves,
            self.out_specs_fn if out_specs_fn is None else out_specs_fn,
            self.devices if devices is None else specs_mod.as_device_list(devices))


class FunctionTarget:
    """What a program runs: a plain function."""

    kind = "function"
    method_name = None
    instance_id = None
    track = None  # per-call hook (methods record the executor)

    def __init__(self, fn):
        self.fn = fn
        self.name = getattr(fn, "__name__", "unknown")
        self.source_info = _source_info(fn)

    def body(self, version: int, carry: tuple = (),
             copy: bytes | None = None, script: tuple = ()) -> bytes:
        """The function pickled now (each specialisation pickles its own
        copy, as in JAX: globals it captures by value are as of then),
        carrying the node types ``carry`` (by reference) and ``script``
        (the script's, by value) and the specialisation's ``copy`` token
        (its programs are its own, not shared with an equal function's)."""
        return dumps_body(self.fn, version=version, carry=carry, copy=copy,
                          script=script,
                          what=f"colocated function {self.name!r}")




class ColocatedFunction:
    """A colocated Python function (``jaxcolo.colocated_python(fn)``).

    Call it like ``fn``; ``specialize(...)`` returns a new one with more
    pinned; ``submit(...)`` returns a Future; ``programs()`` lists the
    program payloads built so far.
    """

    def __init__(self, target, specialization: Specialization):
        self._target = target
        self._specialization = specialization
        self._cache = SignatureCache()
        self._pinned = {}  # in_specs with shardings filled -> Specialized
        # jax.clear_caches() drops these too, as JAX's specialized_functions
        self._cache.on_clear = self._pinned.clear
        self._pinned_lock = threading.Lock()
        functools.update_wrapper(self, target.fn, updated=())
        for name, value in getattr(target.fn, "__dict__", {}).items():
            if name not in self.__dict__:  # the function's attributes, as
                self.__dict__[name] = value  # JAX's wrapper has them

    def __repr__(self):
        return f"<colocated_python {self._target.name}>"

    def __reduce__(self):
        # A body may call another colocated function: it travels as its
        # function and specialisation (caches are rebuilt on the host).
        if not isinstance(self._target, FunctionTarget):
            raise TypeError(f"cannot pickle colocated method {self!r}")
        return _rebuild, (self._target.fn, self._specialization)

    def __copy__(self):  # as a function's: itself (a method keeps its
        return self      # instance; pickling one still raises)

    def __deepcopy__(self, memo):
        return self

    def __get__(self, obj, objtype=None):  # behaves like a function in classes
        return self if obj is None else functools.partial(self, obj)

    # --------------------------------------------------------------- API
    def specialize(self, in_specs=None, out_specs_fn=None, devices=None):
        """A copy with ``in_specs`` (specs of ``(args, kwargs)``),
        ``out_specs_fn`` (input specs -> output specs) and/or ``devices``
        pinned.  Pinning something already pinned raises ValueError."""
        treedef = leaves = None
        if in_specs is not None:
            leaves, treedef = _flatten(in_specs)
            leaves = tuple(leaves)
        return ColocatedFunction(self._target, self._specialization.update(
            in_specs_treedef=treedef, in_specs_leaves=leaves,
            out_specs_fn=out_specs_fn, devices=devices))

    def _prepare(self, args, kwargs):
        """(specialisation, executor, leaves) of a call (the hot path)."""
        leaves, treedef = _flatten((args, kwargs))
        key = fast_key(treedef, leaves)
        sp = self._cache.get_fast(key)
        if sp is None:
            sp = self._specialized(key, treedef, leaves)
        ex = get_executor()
        if sp.track is not None:
            sp.track(ex)
        return sp, ex, leaves

    def __call__(self, /, *args, **kwargs):
        sp, ex, leaves = self._prepare(args, kwargs)
        ref = sp.programs.get(ex.payload_version) or sp.program(
            ex.payload_version)
        lane = current_lane()
        if ref is None:
            deadline = call_deadline(ex)
            out = sp.discover(ex, leaves, lane, deadline)
            if out is not SPECS_KNOWN:
                return out
            ref = sp.program(ex.payload_version)
            with time_left(ex, deadline, sp.name):  # the rest of its time
                return sp.out_treedef.unflatten(ex.call(
                    ref, leaves, lane=lane, checked=True))
        # checked: the signature cache matched these leaves to sp's specs
        return sp.out_treedef.unflatten(ex.call(ref, leaves, lane=lane,
                                                checked=True))

    def submit(self, /, *args, **kwargs) -> Future:
        """Call without waiting.  Calls submitted from one thread run in
        the order submitted (and before that thread's later calls).  A first
        call that must discover output specs runs before submit returns.
        Argument errors raise here; errors of the call are in the Future
        (the function's body that cannot be pickled, a closed executor),
        on a first call and later ones alike."""
        sp, ex, leaves = self._prepare(args, kwargs)
        lane = current_lane()
        try:
            ref = sp.program(ex.payload_version)
            if ref is not None:
                return _chain(ex.submit(ref, leaves, lane=lane, checked=True),
                              sp.out_treedef)
        except Exception as e:  # noqa: BLE001 - delivered in the Future
            failed = Future()
            failed.set_running_or_notify_cancel()
            failed.set_exception(e)
            return failed
        outer = Future()  # a first call: discovered before returning
        outer.set_running_or_notify_cancel()
        try:
            deadline = call_deadline(ex)
            out = sp.discover(ex, leaves, lane, deadline)
            if out is SPECS_KNOWN:
                with time_left(ex, deadline, sp.name):
                    return self.submit(*args, **kwargs)
            outer.set_result(out)
        except Exception as e:
            outer.set_exception(e)
        return outer

    def programs(self) -> list[ProgramRef]:
        """Every program payload built so far (discovery and full)."""
        pinned = list(self._pinned.values())
        out = [p for sp in pinned for p in sp.all_programs()]
        for sp in self._cache.values():
            if all(sp is not p for p in pinned):
                out.extend(sp.all_programs())
        return out

    # --------------------------------------------------- specialisation
    def _specialized(self, key, treedef, leaves) -> Specialized:
        spec = self._specialization
        if not leaves and spec.devices is None:
            raise ValueError(
                "No devices found. colocated_python function without input "
                "arguments must be first specialized with devices.")
        return self._cache.get(
            key, leaves,
            lambda: (treedef, tuple(specs_mod.get_spec(x) for x in leaves)),
            lambda skey: self._create(skey[0], skey[1], leaves))

    def _create(self, treedef, arg_specs: tuple, leaves) -> Specialized:
        spec = self._specialization
        if spec.in_specs_treedef is not None:
            self._check_pinned(treedef, arg_specs)
            # An in_spec without a sharding takes the argument's: one
            # specialisation per sharding, never one call's for the next.
            # The argument's weak type is kept (it promotes on the host as
            # it would in-process): one specialisation for each.
            in_leaves = tuple(
                specs_mod.pinned_spec(p, a)
                for p, a in zip(spec.in_specs_leaves, arg_specs))
            if spec.devices is not None:
                specs_mod.check_within(in_leaves, spec.devices, "input",
                                       self._target.name)
            with self._pinned_lock:
                sp = self._pinned.get(in_leaves)
                if sp is None:
                    sp = self._pinned[in_leaves] = self._new_specialized(
                        treedef, in_leaves, leaves)
                return sp
        devices = spec.devices
        if devices is None:
            devices = specs_mod.infer_devices(leaves)
        else:
            specs_mod.check_within(arg_specs, devices, "input",
                                   self._target.name)
        return self._new_specialized(treedef, arg_specs, leaves, devices)

    def _new_specialized(self, treedef, in_leaves, leaves, devices=None):
        spec = self._specialization
        if devices is None:
            devices = spec.devices or specs_mod.infer_devices(leaves)
        out_tree = NO_OUT_SPECS
        if spec.out_specs_fn is not None:  # given strong specs, as in JAX
            a, kw = treedef.unflatten([specs_mod.strong(s) for s in in_leaves])
            out_tree = spec.out_specs_fn(*a, **kw)
        return Specialized(self._target, treedef, in_leaves, devices, out_tree)

    def _check_pinned(self, treedef, arg_specs) -> None:
        spec = self._specialization
        if treedef != spec.in_specs_treedef or \
                len(arg_specs) != len(spec.in_specs_leaves):
            raise ValueError(
                f"{self._target.name}: arguments {treedef} do not match the "
                f"specialized in_specs {spec.in_specs_treedef}")
        for i, (a, p) in enumerate(zip(arg_specs, spec.in_specs_leaves)):
            ps = getattr(p, "sharding", None)
            if a.shape != p.shape or a.dtype != p.dtype or (
                    ps is not None and a.sharding != ps):
                raise ValueError(
                    f"{self._target.name}: argument {i} does not match the "
                    f"specialized in_specs: {specs_mod.describe_mismatch(a, p)}")


def _chain(inner: Future, out_treedef) -> Future:
    """A Future of ``out_treedef.unflatten(inner.result())``, of the
    executor's own Future class (whose ``add_done_callback`` may decide
    where user callbacks run); the chaining itself is registered with the
    plain Future method, so it runs inline wherever ``inner`` completes."""
    outer = type(inner)()
    outer.set_running_or_notify_cancel()

    def done(f: Future) -> None:
        handed = getattr(f, "pass_after_callbacks", None)
        if handed is not None:  # what waits for its callbacks waits for
            handed(outer)       # the outer future's (the user's) instead
        if f.cancelled():
            outer.set_exception(CancelledError())
            return
        e = f.exception()
        if e is not None:
            outer.set_exception(e)
            return
        try:
            out = out_treedef.unflatten(f.result())
        except Exception as e:  # noqa: BLE001 - the outer future must end
            outer.set_exception(e)
            return
        outer.set_result(out)
    Future.add_done_callback(inner, done)
    return outer


def _rebuild(fn, specialization: Specialization) -> ColocatedFunction:
    return ColocatedFunction(FunctionTarget(fn), specialization)


def colocated_python(fun: Callable) -> ColocatedFunction:
    """Run ``fun`` on the hosts of its arguments' devices, as a drop-in for
    ``jax.experimental.colocated_python.colocated_python``; its program and
    specs travel as jaxcolo payloads, only the body as cloudpickle."""
    if isinstance(fun, ColocatedFunction):
        return fun
    return ColocatedFunction(FunctionTarget(fun), Specialization())
