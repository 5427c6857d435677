"""One specialisation of a colocated function: :class:`Specialized`.

It knows its input specs, devices and, once known, output specs; from them
it builds (once per payload version) the program payloads a call sends --
the full program, and the discovery program a first call without
``out_specs_fn`` runs to learn the output specs (single-flight: concurrent
first calls wait for it).  ``call_deadline``/``time_left`` carry a call's
timeout across that wait.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time

import jax
from jax._src import tree_util as jtu
from jax._src.lib import xla_client as xc

from jaxcolo.codec import spec_tree
from jaxcolo.codec.mesh import payload_id
from jaxcolo.colocated import program_lifetimes, specs as specs_mod
from jaxcolo.colocated.body import types_to_carry
from jaxcolo.colocated.program import ProgramRef, encode_program
from jaxcolo.errors import EncodeError, ExecutorError
from jaxcolo.versions import FEATURE_SINCE

_flatten = jtu.tree_flatten
_WEAK_ARGS_SINCE = FEATURE_SINCE["weak_type_args"]


# No out_specs_fn: the output specs are discovered by the first call.
NO_OUT_SPECS = object()


class Specialized:
    """One specialisation: specs, devices, and its programs per version."""

    def __init__(self, target, in_treedef, in_leaves: tuple,
                 devices: xc.DeviceList, out_tree=NO_OUT_SPECS):
        self.target = target
        self.name = target.name
        self.track = target.track
        self.in_treedef = in_treedef
        self.in_leaves = in_leaves
        self.devices = devices
        self.out_treedef = None
        self.out_leaves = None
        self.programs: dict[int, ProgramRef] = {}   # full programs, by version
        self._discovery: dict[int, ProgramRef] = {}
        self._in_payloads: dict[int, bytes] = {}
        self._out_payloads: dict[int, bytes] = {}
        self._bodies: dict[int, bytes] = {}  # by version
        self._copy = secrets.token_bytes(8)  # its own copy on the hosts
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._discovering = False
        if out_tree is not NO_OUT_SPECS:  # (None: a function returning None)
            self._set_out_specs(out_tree, "out_specs_fn result")

    def _set_out_specs(self, tree, what: str) -> None:
        leaves, treedef = _flatten(tree)
        for i, s in enumerate(leaves):
            if not isinstance(s, jax.ShapeDtypeStruct):
                raise ValueError(f"{self.name}: {what} leaf {i} must be a "
                                 f"jax.ShapeDtypeStruct, got {type(s)}")
        specs_mod.check_within(leaves, self.devices, "output", self.name)
        self.out_leaves = tuple(leaves)
        self.out_treedef = treedef

    # ----------------------------------------------------------- programs
    def _encode(self, version: int, out_specs: bytes | None) -> ProgramRef:
        in_specs = self._in_payloads.get(version)
        if in_specs is None:
            if version < _WEAK_ARGS_SINCE:
                self._refuse_weak_args(version)
            in_specs = self._in_payloads[version] = spec_tree.encode_spec_tree(
                self.in_treedef.unflatten(self.in_leaves), version)
        t = self.target
        body = self._bodies.get(version)
        if body is None:  # one pickle for the discovery and full program
            carry, script = types_to_carry(self.in_treedef)
            body = self._bodies.setdefault(version, t.body(
                version, carry, self._copy, script))
        return program_lifetimes.hold(ProgramRef.of(encode_program(
            name=t.name, kind=t.kind, body=body, in_specs=in_specs,
            out_specs=out_specs,
            device_ids=[payload_id(d) for d in self.devices],
            method_name=t.method_name, instance_id=t.instance_id,
            source_info=t.source_info, version=version)))

    def _refuse_weak_args(self, version: int) -> None:
        """EncodeError if an argument is weakly typed: workers of sessions
        before version 7 build it strongly typed, so it would promote
        differently there than in-process."""
        for i, spec in enumerate(self.in_leaves):
            if getattr(spec, "weak_type", False):
                paths = jtu.tree_flatten_with_path(self.in_treedef.unflatten(
                    self.in_leaves))[0]
                raise EncodeError(
                    f"{self.name}: a weakly typed argument; workers of a "
                    f"version-{version} session would make it strongly "
                    "typed (it promotes differently): pass it strongly "
                    "typed (e.g. jnp.asarray(x, x.dtype)) or use workers "
                    f"of version >= {_WEAK_ARGS_SINCE}",
                    "$" + jtu.keystr(paths[i][0]))

    def program(self, version: int) -> ProgramRef | None:
        """The full program (out specs known) at ``version``, else None."""
        ref = self.programs.get(version)
        if ref is None and self.out_treedef is not None:
            with self._lock:
                ref = self.programs.get(version)
                if ref is None:
                    out = self._out_payloads.get(version)
                    if out is None:
                        out = self._out_payloads[version] = \
                            spec_tree.encode_spec_tree(self.out_treedef.unflatten(
                                self.out_leaves), version)
                    ref = self.programs[version] = self._encode(version, out)
        return ref

    def discovery_program(self, version: int) -> ProgramRef:
        with self._lock:
            ref = self._discovery.get(version)
            if ref is None:
                ref = self._discovery[version] = self._encode(version, None)
            return ref

    def all_programs(self) -> list[ProgramRef]:
        with self._lock:
            return list(self._discovery.values()) + list(self.programs.values())

    # ---------------------------------------------------------- discovery
    def discover(self, executor, leaves, lane, deadline=None):
        """Run the discovery program (single-flight per specialisation).

        Returns the call's outputs, or SPECS_KNOWN if the out specs became
        known while waiting (the caller then makes a normal call; a
        function's outputs may well be None).  ``deadline`` (monotonic
        time, from ``call_deadline``): when the call's timeout ends, waits
        included.
        """
        with self._cond:
            if self.out_treedef is None and self._discovering:
                self._wait_for_discovery(deadline)
            if self.out_treedef is not None:
                return SPECS_KNOWN
            self._discovering = True
        try:
            version = executor.payload_version
            ref = self.discovery_program(version)
            with time_left(executor, deadline, self.name):
                outs, payload = executor.discover(ref, leaves, lane=lane)
            tree = spec_tree.decode_spec_tree(payload)
            with self._lock:
                self._set_out_specs(tree, "discovered output spec")
                self._out_payloads[version] = bytes(payload)
            if len(outs) != len(self.out_leaves):
                raise ValueError(f"{self.name}: the executor returned "
                                 f"{len(outs)} outputs for "
                                 f"{len(self.out_leaves)} discovered specs")
            self.program(version)  # later calls find it built
            return self.out_treedef.unflatten(outs)
        finally:
            with self._cond:
                self._discovering = False
                self._cond.notify_all()

    def _wait_for_discovery(self, deadline: float | None) -> None:
        """Wait (holding ``_cond``) while another thread discovers; an
        ExecutorError at ``deadline`` (the end of the caller's timeout)."""
        while self.out_treedef is None and self._discovering:
            remaining = None if deadline is None else \
                deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise ExecutorError(
                    f"{self.name}: call timed out waiting for another "
                    "thread's first call to discover the output specs; it "
                    "was not sent")
            self._cond.wait(None if remaining is None else
                            min(remaining, threading.TIMEOUT_MAX))


def call_deadline(executor) -> float | None:
    """When a call made now by this thread must be done (its executor's
    ``call_timeout()`` from now), or None."""
    timeout = executor.call_timeout()
    return None if timeout is None else time.monotonic() + timeout


def time_left(executor, deadline, name: str):
    """Context: the executor's calls inside get what is left until
    ``deadline`` as their timeout (ExecutorError if nothing is); their
    timeout messages name the timeout the caller set."""
    if deadline is None:
        return contextlib.nullcontext()
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise ExecutorError(f"{name}: call timed out before it could be "
                            "sent (waiting for the output specs)")
    stated = executor.call_timeout()
    left = getattr(executor, "timeout_left", None)  # (Executor's method)
    return left(remaining, stated) if left is not None else \
        executor.timeout(remaining)


# Specialized.discover's answer when another thread discovered the specs.
SPECS_KNOWN = object()
