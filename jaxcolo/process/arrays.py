"""Message buffers -> jax.Array shards, without pickle (the sending side is
:mod:`jaxcolo.process.packing`).

A shard travels as a buffer of raw bytes -- its elements in C order (PRNG
key arrays: their uint32 key data; StringDType arrays: uint64 UTF-8 lengths
then the bytes) -- in the message, in shared memory or in frames after it.

Receiving (:class:`Layout`, :func:`assemble`): the receiver knows each
leaf's spec (shape, dtype, sharding: from the program's in or out specs), so
it knows which devices it must fill and each shard's shape and byte size; a
buffer that does not fit is a PayloadError naming the leaf and device.  The
shards are placed with one batched device_put per leaf (zero-copy on CPU for
page-aligned shared memory).

Device ids in Shards are payload ids (``jaxcolo.codec.mesh.payload_id``):
the controller's ids on both sides.
"""

from __future__ import annotations

import functools
import gc
import math

import jax
import numpy as np
from jax._src import core

from jaxcolo_fb import BufferFormat, BufferWhere
from jaxcolo.codec.mesh import payload_id
from jaxcolo.errors import PayloadError
from jaxcolo.process.messages import Shards

FRAME_CHUNK = 16 << 20      # out-of-band frames carry at most this much
try:  # what JAX's garbage-collector callback runs (see release_deferred)
    from jax._src.lib import _jax as _xla_ext
    _collect_deferred = _xla_ext.collect_garbage
except (ImportError, AttributeError):  # pragma: no cover - other JAX
    def _collect_deferred() -> None:
        gc.collect(0)  # (runs JAX's callback)
try:
    from jax._src.interpreters.pxla import batched_device_put as _batched_put
except ImportError:  # pragma: no cover - other JAX versions
    _batched_put = None
try:  # what _batched_put does with host (numpy) buffers, without its checks
    from jax._src.lib import xla_client as _xc  # for jax.Arrays
    _host_put = _xc.batched_device_put
except (ImportError, AttributeError):  # pragma: no cover - other JAX
    _host_put = _batched_put


_KINDS: dict = {}   # dtype -> "raw" | "key" | "str"


def dtype_kind(dtype) -> str:
    kind = _KINDS.get(dtype)
    if kind is None:
        kind = ("key" if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
                else "str" if isinstance(dtype, np.dtypes.StringDType)
                else "raw")
        _KINDS[dtype] = kind
    return kind


def _is_key(dtype) -> bool:
    return dtype_kind(dtype) == "key"


def _is_str(dtype) -> bool:
    return dtype_kind(dtype) == "str"


_ADDRESSABLE: dict = {}   # device -> its process is this one


def addressable(d) -> bool:
    hit = _ADDRESSABLE.get(d)
    if hit is None:
        hit = _ADDRESSABLE[d] = d.process_index == jax.process_index()
    return hit


def index_key(index) -> tuple:
    return tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s
                 for s in index)


def decode_strings(buf, n: int, shape, where: str) -> np.ndarray:
    raw = bytes(buf)
    if len(raw) < 8 * n:
        raise PayloadError(f"string buffer of {len(raw)} bytes for {n} "
                           "strings", where)
    lengths = np.frombuffer(raw, np.uint64, n).tolist()  # Python ints:
    if sum(lengths) + 8 * n != len(raw):                   # no wrap-around
        raise PayloadError("string lengths do not match the buffer size",
                           where)
    out, pos = [], 8 * n
    try:
        for ln in lengths:
            out.append(raw[pos:pos + ln].decode("utf-8"))
            pos += ln
    except UnicodeDecodeError as e:
        raise PayloadError(f"invalid UTF-8 in a string ({e.reason})",
                           where) from None
    return np.array(out, np.dtypes.StringDType()).reshape(shape)



# ---------------------------------------------------------------- receive

class Layout:
    """What a receiver needs to rebuild one leaf: per device it must fill,
    the payload id, shard shape and byte size."""

    __slots__ = ("spec", "shape", "dtype", "sharding", "aval", "kind",
                 "impl", "np_dtype", "parts", "single", "devices",
                 "is_bool")

    def __init__(self, spec, local_only: bool):
        self.spec = spec
        self.shape = tuple(spec.shape)
        self.dtype = spec.dtype
        self.sharding = spec.sharding
        self.kind = "raw"
        self.impl = None
        self.np_dtype = spec.dtype
        extra = ()
        if _is_key(spec.dtype):
            self.kind = "key"
            self.impl = spec.dtype._impl
            extra = tuple(self.impl.key_shape)
            self.np_dtype = np.dtype(np.uint32)
        elif _is_str(spec.dtype):
            self.kind = "str"
        else:
            check_holdable(spec.dtype)
        self.is_bool = self.kind == "raw" and \
            np.dtype(self.np_dtype) == np.bool_  # bytes checked: 0 or 1
        self.aval = core.ShapedArray(
            self.shape, spec.dtype, weak_type=getattr(spec, "weak_type", False)
        ) if self.kind == "raw" else None
        sharding = self.sharding
        devices = (sharding.addressable_devices if local_only
                   else sharding.device_set)
        index_map = sharding.devices_indices_map(self.shape)
        order = [d for d in sharding._device_assignment if d in devices]
        parts = []
        for d in order:
            shape = tuple(
                len(range(*sl.indices(dim))) if isinstance(sl, slice) else 1
                for sl, dim in zip(index_map[d], self.shape))
            n = math.prod(shape)
            if self.kind == "raw":
                nbytes = n * np.dtype(self.np_dtype).itemsize
            elif self.kind == "key":
                nbytes = n * math.prod(extra) * 4
            else:
                nbytes = None
            parts.append((d, payload_id(d), shape + extra, n, nbytes))
        self.parts = parts
        self.devices = [p[0] for p in parts]
        self.single = (len(parts) == 1 and isinstance(
            sharding, jax.sharding.SingleDeviceSharding))


def check_holdable(dtype) -> None:
    """ValueError unless this process's jax.Arrays can have ``dtype``:
    with jax_enable_x64 off, JAX would make a 64-bit array 32-bit,
    silently losing range or precision."""
    dtype = np.dtype(dtype)
    canonical = jax.dtypes.canonicalize_dtype(dtype)
    if canonical != dtype:
        raise ValueError(
            f"{dtype.name} arrays, but jax_enable_x64 is off in this process "
            f"(JAX would make them {canonical.name}): started workers take "
            "the controller's jax config as it is when the executor is "
            "created -- enable x64 before creating it (running workers: "
            "start them with JAX_ENABLE_X64=1)")


def _host(layout: Layout, part, buf, fmt, where: str):
    d, pid, shape, n, nbytes = part
    if layout.kind == "str":
        if fmt != BufferFormat.strings:
            raise PayloadError("a string array needs a strings buffer", where)
        return decode_strings(buf, n, shape, where)
    if fmt != BufferFormat.raw:
        raise PayloadError("expected a raw buffer", where)
    if len(buf) != nbytes:
        raise PayloadError(f"buffer of {len(buf)} bytes for a shard of "
                           f"shape {shape} {np.dtype(layout.np_dtype).name} "
                           f"({nbytes} bytes)", where)
    if layout.is_bool and np.frombuffer(buf, np.uint8).max(initial=0) > 1:
        raise PayloadError("a bool buffer holds bytes other than 0 and 1 "
                           "(numpy would show them, XLA read them as True)",
                           where)
    return np.frombuffer(buf, layout.np_dtype).reshape(shape)


def assemble(layout: Layout, found: dict, leaf: int, what: str):
    """The jax.Array of one leaf from ``found``: payload device id ->
    (buffer bytes-like, format).  PayloadError if a shard is missing or
    does not fit its spec."""
    # The common case, checked inline (bools' bytes are checked in _host)
    if layout.single and layout.kind == "raw" and len(found) == 1 and \
            not layout.is_bool and _batched_put is not None:
        d, pid, shape, n, nbytes = layout.parts[0]
        hit = found.get(pid)
        if hit is not None and hit[1] == BufferFormat.raw and \
                len(hit[0]) == nbytes:
            try:  # (a numpy array: _batched_put's host-buffer case)
                return _host_put(layout.aval, layout.sharding, [
                    np.frombuffer(hit[0], layout.np_dtype).reshape(shape)],
                    layout.devices, True)
            except (TypeError, AttributeError):  # pragma: no cover - JAX
                pass                              # drift
    hosts = []
    for part in layout.parts:
        hit = found.get(part[1])
        where = f"{what}[{leaf}] on device {part[1]}"
        if hit is None:
            raise PayloadError(f"no shard for device {part[1]}", where)
        hosts.append(_host(layout, part, hit[0], hit[1], where))
    if len(found) != len(layout.parts):
        extra = sorted(set(found) - {p[1] for p in layout.parts})
        raise PayloadError(f"shards for devices {extra[:8]} that the spec "
                           f"does not place here", f"{what}[{leaf}]")
    if layout.kind == "raw" and _batched_put is not None:
        try:
            return _batched_put(layout.aval, layout.sharding, hosts,
                                layout.devices)
        except (TypeError, AttributeError):  # pragma: no cover - JAX drift
            pass
    arrays = []
    memory_kind = layout.sharding.memory_kind  # (each shard in its memory)
    for part, h in zip(layout.parts, hosts):
        a = jax.device_put(h, jax.sharding.SingleDeviceSharding(
            part[0], memory_kind=memory_kind))
        if layout.kind == "key":
            a = jax.random.wrap_key_data(a, impl=layout.impl)
        arrays.append(a)
    if layout.single and layout.kind != "key":
        return arrays[0]
    # (a host owning none of the shards has none to take the dtype from)
    return jax.make_array_from_single_device_arrays(
        layout.shape, layout.sharding, arrays, dtype=layout.dtype)


def release_deferred() -> None:
    """Let go of the numpy arrays dead jax.Arrays aliased, now.

    A jax.Array made zero-copy from a shared-memory view keeps that numpy
    array alive; when the jax.Array dies, XLA does not drop its reference
    at once but queues it until JAX's garbage-collector callback runs -- in
    a process that allocates little (an idle worker, a controller between
    calls) possibly never, so the view's lease did not go back to its
    owner.  Cheap: it drops what is queued (nothing, mostly)."""
    _collect_deferred()


def message_buffers(m, channel, maps, released):
    """``get(j)``: buffer j of message ``m``'s shards, as bytes-like.

    Reads the out-of-band frames that follow ``m`` on ``channel`` now (they
    come next in the stream) and maps the segments ``m`` announces into
    ``maps`` (a ``peer_segments.SegmentMaps``).  A shared-memory view puts its lease
    id on ``released`` (a queue) once the view is garbage."""
    s = m.shards
    frames = {}
    for j in range(s.num_buffers):
        if s.where[j] == BufferWhere.frame:
            frames[j] = channel.recv_buffer(s.size[j], FRAME_CHUNK)
    for sid, name, size in m.segments:
        try:
            maps.add(sid, name, size)
        except OSError as e:
            raise PayloadError(f"cannot map segment {name}: {e}",
                               "$.segments") from None

    def get(j):
        w = s.where[j]
        if w == BufferWhere.message:
            return memoryview(s.data)[s.offset[j]:s.offset[j] + s.size[j]]
        if w == BufferWhere.frame:
            return frames[j]
        try:  # the lease goes back once its mapping is unused (aliases too)
            return maps.view(s.segment[j], s.offset[j], s.size[j],
                             functools.partial(released.put, s.lease[j]))
        except (KeyError, ValueError, OSError) as e:
            raise PayloadError(f"bad shared-memory buffer {j}: {e}",
                               f"$.shards.segment[{j}]") from None
    return get


def release_unused(m, released) -> None:
    """Give back the shared-memory leases of message ``m``, none of whose
    buffers was viewed (a dropped or failed reply, a refused call)."""
    s = m.shards
    if s is None:
        return
    for j in range(s.num_buffers):
        if s.where[j] == BufferWhere.shm:
            released.put(s.lease[j])


def buffers_by_device(shards: Shards, leaf_count: int, get_buffer, what: str):
    """Group a message's shards: per leaf, payload device id -> (buffer,
    format).  ``get_buffer(j)`` returns buffer j's bytes."""
    per_leaf: list = [dict() for _ in range(leaf_count)]
    cache: dict = {}
    for leaf, dev, j in zip(shards.leaf, shards.device, shards.buffer):
        if leaf >= leaf_count:
            raise PayloadError(f"leaf {leaf} out of range ({leaf_count} "
                               "leaves)", f"{what}.leaf")
        if dev in per_leaf[leaf]:
            raise PayloadError(f"two shards of leaf {leaf} on device {dev}",
                               f"{what}.device")
        buf = cache.get(j)
        if buf is None:
            buf = cache[j] = get_buffer(j)
        per_leaf[leaf][dev] = (buf, shards.format[j])
    return per_leaf
