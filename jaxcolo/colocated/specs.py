"""Specs of call arguments and results: what a colocated call may take and
return, which devices it runs on, and the checks behind the error messages
users know from ``jax.experimental.colocated_python``."""

from __future__ import annotations

from typing import Any, Sequence

import jax
from jax._src import core
from jax._src.lib import xla_client as xc

from jaxcolo.codec import names
from jaxcolo.codec.mesh import payload_id


def get_spec(x: Any) -> jax.ShapeDtypeStruct:
    """The spec of a call argument or result, which must be a jax.Array."""
    if isinstance(x, core.Tracer):
        raise ValueError(
            "colocated_python functions cannot be called on traced values "
            f"(got {type(x).__name__}); call them outside jit/vmap/grad.")
    if not isinstance(x, jax.Array):
        # In a worker, the controller's script's classes are __main__'s;
        # their pytree registrations stayed in the script.
        hint = "" if names.foreign_main is None or getattr(
            type(x), "__module__", None) != "__main__" else (
            " (a pytree node type registered in the script is not registered "
            "in ProcessExecutor workers: register it in a module)")
        raise ValueError(
            "colocated_python only supports jax.Array as input and output, "
            f"but got {type(x)}{hint}.")
    return jax.ShapeDtypeStruct(shape=x.shape, dtype=x.dtype,
                                sharding=x.sharding,
                                weak_type=getattr(x, "weak_type", False))


def strong(spec: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """``spec`` without its weak type (what JAX hands ``out_specs_fn``)."""
    if not getattr(spec, "weak_type", False):
        return spec
    return spec.update(weak_type=False)


def pinned_spec(pinned, arg: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """The spec of an argument matching the pinned in_spec ``pinned``:
    the pinned spec with the argument's weak type, and its sharding when
    ``pinned`` has none."""
    sharding = getattr(pinned, "sharding", None)
    if not isinstance(pinned, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(pinned.shape, pinned.dtype,
                                    sharding=sharding or arg.sharding,
                                    weak_type=arg.weak_type)
    if sharding is None:
        return pinned.update(weak_type=arg.weak_type, sharding=arg.sharding)
    if pinned.weak_type != arg.weak_type:  # (its format, etc. kept)
        return pinned.update(weak_type=arg.weak_type)
    return pinned


def infer_devices(leaves: Sequence[Any]) -> xc.DeviceList | None:
    """The one device list shared by all arguments (None without any)."""
    found: set = set()
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        if sharding is not None:
            found.add(sharding._internal_device_list)
    if not found:
        return None
    if len(found) != 1:
        raise ValueError(
            "All arguments must use the same device list, but got multiple "
            f"device lists: {found}.")
    return found.pop()


def as_device_list(devices) -> xc.DeviceList:
    if isinstance(devices, xc.DeviceList):
        return devices
    devices = tuple(devices)
    if not devices:
        raise ValueError("devices must not be empty")
    for d in devices:
        if not isinstance(d, xc.Device):
            raise TypeError(f"devices must be jax devices, got {d!r}")
    return xc.DeviceList(devices)


def check_within(specs: Sequence[jax.ShapeDtypeStruct],
                 devices: xc.DeviceList, what: str, name: str) -> None:
    """Every spec's devices must be among the program's ``devices``."""
    allowed = set(devices)
    for i, s in enumerate(specs):
        if s.sharding is None:
            raise ValueError(f"{name}: {what} {i} has no sharding: {s}")
        extra = set(s.sharding.device_set) - allowed
        if extra:
            raise ValueError(
                f"{name}: {what} {i} lives on devices "
                f"{sorted(d.id for d in extra)} outside the function's "
                f"devices {[d.id for d in devices]} (outputs use the "
                "inputs' devices; specialize with devices= to widen them)")


def same_spec(x, spec: jax.ShapeDtypeStruct) -> bool:
    """Does array or spec ``x`` match ``spec`` (shape, dtype, sharding)?"""
    s = x.sharding
    return (x.shape == spec.shape and x.dtype == spec.dtype and
            (s is spec.sharding or s == spec.sharding))


class ArgCheck:
    """Checks a call's arrays against a program's input specs, every call.

    A sharding found equal to its spec's is remembered by identity, so
    repeated calls with the same sharding objects compare with ``is``
    (sharding equality costs microseconds)."""

    __slots__ = ("name", "specs", "known")

    def __init__(self, name: str, specs):
        self.name = name
        self.specs = tuple(specs)
        self.known = [s.sharding for s in self.specs]

    def __call__(self, args) -> None:
        """ValueError naming the first argument that does not match."""
        specs, known = self.specs, self.known
        if len(args) != len(specs):
            raise ValueError(f"{self.name}: got {len(args)} input arrays, "
                             f"the program takes {len(specs)}")
        for i, x in enumerate(args):
            spec = specs[i]
            ok = isinstance(x, jax.Array)
            if ok:
                s = x.sharding
                ok = x.shape == spec.shape and x.dtype == spec.dtype
            if ok and s is not known[i]:
                ok = s == spec.sharding
                if ok:
                    known[i] = s
            if not ok:
                raise ValueError(f"{self.name}: input {i} does not match the "
                                 "program's in_specs: "
                                 + describe_mismatch(x, spec))


def describe_mismatch(x, spec) -> str:
    if not all(hasattr(x, a) for a in ("shape", "dtype", "sharding")):
        return (f"got {type(x).__name__}, expected a jax.Array of shape="
                f"{spec.shape} dtype={spec.dtype} sharding={spec.sharding}")
    return (f"got shape={x.shape} dtype={x.dtype} sharding={x.sharding}"
            f"{_payload_devices(x.sharding)}, expected shape={spec.shape} "
            f"dtype={spec.dtype} sharding={spec.sharding}"
            f"{_payload_devices(spec.sharding)}")


def _payload_devices(sharding) -> str:
    """Where a process's device ids differ from the ones its payloads use
    (a worker's), " (devices [ids] in the caller's numbering)"; else ""."""
    try:
        devices = sharding._device_assignment
        ids = [payload_id(d) for d in devices]
    except Exception:  # noqa: BLE001 - a message detail only
        return ""
    if ids == [d.id for d in devices]:
        return ""
    return f" (devices {ids} in the caller's numbering)"
