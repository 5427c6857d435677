"""Meshes, abstract meshes, device lists and devices, as device ids.

Concrete devices never travel: a Mesh is its device-id array plus axis names
and types.  The reading side maps ids to its own devices with a *resolver*
(default: the devices of this process's JAX backends, by id).  An id the
resolver does not know is a PayloadError naming the id.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
from jax._src import mesh as jmesh
from jax._src.lib import xla_client as xc

from jaxcolo_fb import AxisType as FbAxisType
import jaxcolo_fb as fb
from jaxcolo_fb import LeafKind
from jaxcolo import versions
from jaxcolo.codec.core import register_leaf, register_table
from jaxcolo.errors import EncodeError, PayloadError, UnknownDeviceError
from jaxcolo.fastbuilder import string_vector
from jaxcolo.wire import bounded_product, layout

LM = layout(fb, "Mesh")
LA = layout(fb, "AbstractMesh")
LD = layout(fb, "AbstractDevice")
LL = layout(fb, "DeviceList")

AxisType = jax.sharding.AxisType
_AXIS_TO_FB = {AxisType.Auto: FbAxisType.Auto,
               AxisType.Explicit: FbAxisType.Explicit,
               AxisType.Manual: FbAxisType.Manual}
_FB_TO_AXIS = {v: k for k, v in _AXIS_TO_FB.items()}
MAX_ABSTRACT_MESH_SIZE = 1 << 48  # devices an AbstractMesh may describe
# Axes of a mesh (a concrete one has at most numpy's 64).  JAX checks each
# axis a PartitionSpec names against the tuple of axis names, so building a
# NamedSharding costs axes squared: a bound keeps that proportional.
MAX_MESH_AXES = 256


# ---------------------------------------------------------------- resolver

class Resolver:
    """Maps payload device ids to this process's devices."""

    def __init__(self, lookup, cacheable: bool):
        self._lookup = lookup
        self.cacheable = cacheable  # results may be memoized across payloads

    def device(self, device_id: int, path: str):
        return self.devices((device_id,), path)[0]

    def devices(self, ids, path: str) -> list:
        look = self._lookup
        out = []
        for i in ids:
            try:
                d = look(i)
            except _ResolverFailed as e:
                raise PayloadError(
                    f"the device resolver raised {e.error!r} for device id "
                    f"{i}", path) from e.error
            if d is None:
                raise UnknownDeviceError(
                    f"unknown device id {i}: the device resolver has no such "
                    "device", path)
            out.append(d)
        return out


class _ResolverFailed(Exception):
    """A user's device resolver raised ``error`` (not LookupError): carried
    to ``Resolver.devices``, which names the field it resolved."""

    def __init__(self, error: Exception):
        super().__init__(error)
        self.error = error


_DEFAULT: list = []
_SPACE: list = [None]  # [mapping payload id -> device] when installed


def set_device_space(id_to_device=None) -> None:
    """Name devices by other ids in every payload this process reads or
    writes (``None``: their own ``Device.id``, the default).

    A worker of a ProcessExecutor installs its device map here, so that
    every payload it reads or writes -- programs, spec payloads, bodies,
    nested colocated calls -- speaks its controller's device ids.  Call it
    before decoding or encoding anything; it clears the codec's memos.
    """
    from jaxcolo.codec import memo
    if id_to_device is None:
        _SPACE[0] = None
    else:
        by_id = dict(id_to_device)
        by_device = {d: i for i, d in by_id.items()}
        if len(by_device) != len(by_id):
            raise ValueError("a device map names one device twice")
        _SPACE[0] = (by_id, by_device)
    _DEFAULT.clear()
    _MESH_CACHE.clear()
    memo.clear()


def payload_id(device) -> int:
    """The id that names ``device`` in payloads written by this process."""
    space = _SPACE[0]
    if space is None:
        return device.id
    try:
        return space[1][device]
    except KeyError:
        raise EncodeError(f"device {device} has no id in this process's "
                          "device map (jaxcolo.codec.mesh.set_device_space)"
                          ) from None


def default_device_map() -> dict:
    """All devices this process's JAX backends know, by payload id (their
    own ids unless a device space is installed)."""
    if _SPACE[0] is not None:
        return dict(_SPACE[0][0])
    devs = {}
    for d in jax.devices():
        devs[d.id] = d
    try:
        for d in jax.devices("cpu"):
            devs.setdefault(d.id, d)
    except RuntimeError:
        pass
    return devs


def make_resolver(device_resolver=None) -> Resolver:
    """Normalize the ``device_resolver`` argument of ``deserialize``.

    Accepts None (default devices), a Mapping id -> Device, a sequence of
    devices (each standing for its own ``.id``; not indexed by position),
    or a callable id -> Device (returning None or raising
    KeyError/LookupError for unknown ids).  Any other exception a mapping's
    ``get`` or the callable raises is a PayloadError naming the field
    resolved, with that exception as its ``__cause__``.
    """
    if device_resolver is None:
        if not _DEFAULT:
            _DEFAULT.append(Resolver(default_device_map().get, True))
        return _DEFAULT[0]
    if isinstance(device_resolver, Resolver):
        return device_resolver
    if type(device_resolver) is dict:  # (its get raises nothing for ids)
        return Resolver(device_resolver.get, False)
    if isinstance(device_resolver, Mapping) or callable(device_resolver):
        fn = device_resolver.get if isinstance(device_resolver, Mapping) \
            else device_resolver

        def lookup(i, fn=fn):
            try:
                return fn(i)
            except LookupError:
                return None
            except Exception as e:  # the resolver's bug, not the payload's
                raise _ResolverFailed(e) from None
        return Resolver(lookup, False)
    try:
        by_id = {d.id: d for d in device_resolver}
    except (TypeError, AttributeError):
        raise TypeError(
            "device_resolver must be None, a mapping id -> Device, a sequence "
            f"of devices or a callable; got {type(device_resolver).__name__}"
        ) from None
    return Resolver(by_id.get, False)


# -------------------------------------------------------------------- mesh

def _axis_types(types_, path):
    try:
        return bytes(_AXIS_TO_FB[t] for t in types_)
    except KeyError as e:
        raise EncodeError(f"unsupported axis type {e.args[0]!r}", path) from None


def _read_axis_types(t, voff, n, path):
    raw = t.bytes(voff, path, "axis_types") or b""
    if len(raw) != n:
        raise PayloadError(f"{len(raw)} axis types for {n} axes",
                           f"{path}.axis_types")
    try:
        return tuple(_FB_TO_AXIS[b] for b in raw)
    except KeyError as e:
        raise PayloadError(f"unknown AxisType value {e.args[0]}",
                           f"{path}.axis_types") from None


def _read_axis_names(t, voff, path):
    n = t.vector_length(voff, 4, path, "axis_names")
    if n > MAX_MESH_AXES:
        raise PayloadError(f"{n} mesh axes, more than {MAX_MESH_AXES}",
                           f"{path}.axis_names")
    names = tuple(t.strings(voff, path, "axis_names"))
    if len(set(names)) != len(names):
        raise PayloadError(f"duplicate axis names {_short(names)}", f"{path}.axis_names")
    return names


def _mesh_item(mesh, path):
    if mesh.empty:  # JAX's placeholder for "no mesh": not a mesh to send
        raise EncodeError("an empty Mesh (no devices) cannot be serialized",
                          path)
    ids = mesh.device_ids if _SPACE[0] is None else \
        [payload_id(d) for d in mesh.devices.flat]
    return (device_id_array(ids, path + ".device_ids"),
            tuple(int(s) for s in mesh.devices.shape),
            tuple(mesh.axis_names), mesh.axis_types)


def build_mesh(writer, builder, item) -> int:
    ids, sizes, names, types_ = item
    names_off = string_vector(builder, names)
    ids_off = builder.CreateNumpyVector(ids)
    sizes_off = builder.CreateNumpyVector(np.asarray(sizes, np.uint32))
    types_off = builder.CreateByteVector(_axis_types(types_, "$.meshes"))
    fb.MeshStart(builder)
    fb.MeshAddDeviceIds(builder, ids_off)
    fb.MeshAddAxisSizes(builder, sizes_off)
    fb.MeshAddAxisNames(builder, names_off)
    fb.MeshAddAxisTypes(builder, types_off)
    return fb.MeshEnd(builder)


def _short(values: tuple) -> str:
    """``values`` for an error message, cut after 8 entries."""
    if len(values) <= 8:
        return repr(tuple(values))
    return f"({', '.join(map(repr, values[:8]))}, ... {len(values)} in all)"


_MESH_CACHE: dict = {}
_CACHE_MAX = 512
# Meshes with up to this many axis names and characters in all are cached
# (a crafted payload may name axes with huge strings; device ids are bounded
# by the devices the resolver knows).
CACHED_NAMES_SIZE = 1024


def names_size(names) -> int:
    """What a cache keyed on ``names`` holds of them: names and characters
    (the size that decides whether decoders cache a mesh or spec)."""
    return len(names) + sum(map(len, names))


def decode_mesh(reader, t, path):
    ids = t.ints(LM.device_ids, "u32", path, "device_ids")
    sizes = t.ints(LM.axis_sizes, "u32", path, "axis_sizes")
    if not sizes:  # read under any header: earlier writers stamped it 1
        versions.note_used("mesh_without_axes")
    names = _read_axis_names(t, LM.axis_names, path)
    types_ = _read_axis_types(t, LM.axis_types, len(names), path)
    resolver = reader.resolver
    key = (ids, sizes, names, types_) if resolver.cacheable and \
        names_size(names) <= CACHED_NAMES_SIZE else None
    if key is not None:
        hit = _MESH_CACHE.get(key)
        if hit is not None:
            return hit
    if len(sizes) != len(names):
        raise PayloadError(f"{len(sizes)} axis sizes for {len(names)} names",
                           f"{path}.axis_sizes")
    if sizes and min(sizes) < 1:  # no axes: one device
        raise PayloadError(f"mesh axis sizes {_short(sizes)} must be >= 1",
                           f"{path}.axis_sizes")
    if bounded_product(sizes, len(ids)) != len(ids):
        raise PayloadError(
            f"axis sizes {_short(sizes)} do not match {len(ids)} device ids",
            f"{path}.device_ids")
    if len(set(ids)) != len(ids):
        raise PayloadError("duplicate device ids in mesh", f"{path}.device_ids")
    devs = resolver.devices(ids, f"{path}.device_ids")
    arr = np.empty(len(devs), dtype=object)
    for k, dev in enumerate(devs):  # arr[:] = devs probes every device for
        arr[k] = dev                # the array protocols: 14 us for 8
    try:
        mesh = jax.sharding.Mesh(arr.reshape(sizes), names, axis_types=types_)
    except Exception as e:
        raise PayloadError(f"invalid mesh: {e}", path) from None
    if key is not None:
        if len(_MESH_CACHE) >= _CACHE_MAX:
            _MESH_CACHE.clear()
        _MESH_CACHE[key] = mesh
    return mesh


def intern_mesh(writer, mesh, path) -> int:
    writer.require("mesh", path)
    if not mesh.axis_names:
        # Read under any header (versions.LENIENT): earlier writers
        # stamped it readable by 1.
        writer.require("mesh_without_axes", path)
    return writer.intern_obj("meshes", mesh,
                             lambda m: _mesh_item(m, path))


# ----------------------------------------------------------- abstract mesh

def _build_abstract_device(builder, dev) -> int:
    kind = builder.CreateSharedString(dev.device_kind)
    platform = builder.CreateSharedString(dev.platform)
    fb.AbstractDeviceStart(builder)
    fb.AbstractDeviceAddDeviceKind(builder, kind)
    if dev.num_cores is not None:
        fb.AbstractDeviceAddNumCores(builder, dev.num_cores)
    if platform:
        fb.AbstractDeviceAddPlatform(builder, platform)
    return fb.AbstractDeviceEnd(builder)


def _decode_abstract_device(t, path):
    kind = t.string(LD.device_kind, path, "device_kind")
    if kind is None:
        raise PayloadError("device_kind missing", f"{path}.device_kind")
    num_cores = t.scalar(LD.num_cores, "i32", None, path, "num_cores")
    # Absent means "" (writers 1..3 left an empty platform out).
    platform = t.string(LD.platform, path, "platform")
    if platform is None:
        platform = ""
        versions.note_used("abstract_device_without_platform")
    return jmesh.AbstractDevice(kind, num_cores, platform)


def build_abstract_mesh(writer, builder, am) -> int:
    names_off = string_vector(builder, am.axis_names)
    sizes_off = builder.CreateNumpyVector(np.asarray(am.axis_sizes, np.uint32))
    types_off = builder.CreateByteVector(
        _axis_types(am.axis_types, "$.abstract_meshes"))
    dev_off = (_build_abstract_device(builder, am.abstract_device)
               if am.abstract_device is not None else 0)
    fb.AbstractMeshStart(builder)
    fb.AbstractMeshAddAxisSizes(builder, sizes_off)
    fb.AbstractMeshAddAxisNames(builder, names_off)
    fb.AbstractMeshAddAxisTypes(builder, types_off)
    if dev_off:
        fb.AbstractMeshAddAbstractDevice(builder, dev_off)
    return fb.AbstractMeshEnd(builder)


def decode_abstract_mesh(reader, t, path):
    sizes = t.ints(LA.axis_sizes, "u32", path, "axis_sizes")
    names = _read_axis_names(t, LA.axis_names, path)
    types_ = _read_axis_types(t, LA.axis_types, len(names), path)
    if len(sizes) != len(names):
        raise PayloadError(f"{len(sizes)} axis sizes for {len(names)} names",
                           f"{path}.axis_sizes")
    if any(s < 1 for s in sizes):
        raise PayloadError(f"mesh axis sizes {_short(sizes)} must be >= 1",
                           f"{path}.axis_sizes")
    if bounded_product(sizes, MAX_ABSTRACT_MESH_SIZE) is None:
        raise PayloadError(f"abstract mesh of more than "
                           f"{MAX_ABSTRACT_MESH_SIZE} devices",
                           f"{path}.axis_sizes")
    dev_t = t.table(LA.abstract_device, path, "abstract_device")
    dev = (_decode_abstract_device(dev_t, f"{path}.abstract_device")
           if dev_t is not None else None)
    try:
        return jmesh.AbstractMesh(sizes, names, types_, abstract_device=dev)
    except Exception as e:
        raise PayloadError(f"invalid abstract mesh: {e}", path) from None


def intern_abstract_mesh(writer, am, path) -> int:
    writer.require("mesh", path)
    if len(am.axis_names) > MAX_MESH_AXES:
        raise EncodeError(f"{len(am.axis_names)} mesh axes, more than "
                          f"{MAX_MESH_AXES}", path + ".axis_names")
    if any(not 1 <= s <= MAX_DEVICE_ID for s in am.axis_sizes) or \
            bounded_product(am.axis_sizes, MAX_ABSTRACT_MESH_SIZE) is None:
        raise EncodeError(f"abstract mesh axis sizes {am.axis_sizes} must be "
                          f"in 1..{MAX_DEVICE_ID} with a product of at most "
                          f"{MAX_ABSTRACT_MESH_SIZE}", path + ".axis_sizes")
    return writer.intern_obj("abstract_meshes", am, lambda m: _checked_device(
        m, path + ".abstract_device"))


def _checked_device(am, path):
    """``am``; EncodeError unless the schema holds its abstract device
    exactly: str kind and platform (as JAX makes them; readers read an
    absent platform as ""), num_cores None or an int32."""
    dev = am.abstract_device
    if dev is None:
        return am
    for name in ("device_kind", "platform"):
        if not isinstance(getattr(dev, name), str):
            raise EncodeError(f"AbstractDevice.{name} must be a str, got "
                              f"{getattr(dev, name)!r}", f"{path}.{name}")
    n = dev.num_cores
    if n is not None and (not isinstance(n, (int, np.integer)) or
                          not -2**31 <= n < 2**31):
        raise EncodeError(f"AbstractDevice.num_cores {n!r} is not None or "
                          "an int32", f"{path}.num_cores")
    return am


# ------------------------------------------------------ device lists/devices

MAX_DEVICE_ID = 2**32 - 1


def device_id_array(ids, path) -> np.ndarray:
    """Device ids as the schema's uint32 vector (EncodeError if out of
    range, or repeated: JAX takes a device twice in a mesh or device list,
    readers refuse it)."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() > MAX_DEVICE_ID):
        raise EncodeError(f"device ids must be in 0..{MAX_DEVICE_ID}", path)
    if len(set(ids.tolist())) != ids.size:
        raise EncodeError("duplicate device ids (a device used twice)", path)
    return ids.astype(np.uint32)


def device_ids_of(devices, path="$") -> np.ndarray:
    if _SPACE[0] is None:
        return device_id_array([d.id for d in devices], path)
    return device_id_array([payload_id(d) for d in devices], path)


def build_device_list(writer, builder, ids) -> int:
    off = builder.CreateNumpyVector(ids)
    fb.DeviceListStart(builder)
    fb.DeviceListAddDeviceIds(builder, off)
    return fb.DeviceListEnd(builder)


def decode_device_list(reader, t, path):
    ids = t.ints(LL.device_ids, "u32", path, "device_ids")
    if not ids:
        raise PayloadError("empty device list", f"{path}.device_ids")
    if len(set(ids)) != len(ids):
        raise PayloadError("duplicate device ids", f"{path}.device_ids")
    devs = reader.resolver.devices(ids, f"{path}.device_ids")
    try:
        return xc.DeviceList(tuple(devs))
    except Exception as e:
        raise PayloadError(f"invalid device list: {e}", path) from None


def intern_device_list(writer, devices, path) -> int:
    writer.require("device_list", path)
    ids = device_ids_of(devices, path)
    return writer.intern("device_lists", ids.tobytes(), ids)


def intern_device(writer, device, path) -> int:
    writer.require("device_list", path)
    i = payload_id(device)
    if not 0 <= i <= MAX_DEVICE_ID:
        raise EncodeError(f"device id {i} out of range", path)
    return writer.intern("devices", i, i)


register_table("meshes", build_mesh, decode_mesh)
register_table("abstract_meshes", build_abstract_mesh, decode_abstract_mesh)
register_table("device_lists", build_device_list, decode_device_list)
register_leaf((jax.sharding.Mesh,), LeafKind.mesh, "meshes", intern_mesh)
register_leaf((jmesh.AbstractMesh,), LeafKind.abstract_mesh, "abstract_meshes",
              intern_abstract_mesh)
register_leaf((xc.DeviceList,), LeafKind.device_list, "device_lists",
              intern_device_list)
register_leaf((xc.Device,), LeafKind.device, "devices", intern_device,
              subclasses=True)
