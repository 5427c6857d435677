"""jax.Array shards <-> message buffers, without pickle.

Sending (:class:`Packer`): each addressable shard of an array becomes a
buffer of raw bytes -- the shard's elements in C order (PRNG key arrays:
their uint32 key data; StringDType arrays: uint64 UTF-8 lengths then the
bytes).  Replicas of one shard share a buffer.  Small buffers travel in the
message (up to ``INLINE_TOTAL`` bytes in all; any more in frames after it),
large ones in shared memory (a ``SegmentPool``) or, between machines, in
frames after the message.

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
import logging
import math
import time

import jax
import numpy as np
from jax._src import core

from jaxcolo_fb import BufferFormat, BufferWhere
from jaxcolo.codec.mesh import payload_id
from jaxcolo.errors import PayloadError
from jaxcolo.process.messages import Shards

COPY_CHUNK = 64 << 20      # bytes copied into shared memory between checks
INLINE_LIMIT = 64 * 1024    # larger buffers go out of the message
INLINE_TOTAL = 8 << 20      # a message carries at most this much data; more
                            # buffers (however small) go out of it too
FRAME_CHUNK = 16 << 20      # out-of-band frames carry at most this much
_ALIGN = 64
log = logging.getLogger(__name__)
_NO_ROOM_LOGGED = []


def _log_no_room(n: int, e: OSError) -> None:
    if not _NO_ROOM_LOGGED:  # once per process: it repeats per buffer
        _NO_ROOM_LOGGED.append(True)
        log.warning("no shared memory for a %d-byte buffer (%s): large "
                    "buffers go in frames while /dev/shm has no room", n, e)


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


def _dtype_kind(dtype) -> str:
    kind = _KINDS.get(dtype)
    if kind is None:
        kind = ("key" if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
                else "str" if isinstance(dtype, np.dtypes.StringDType)
                else "raw")
        _KINDS[dtype] = kind
    return kind


def _is_key(dtype) -> bool:
    return _dtype_kind(dtype) == "key"


def _is_str(dtype) -> bool:
    return _dtype_kind(dtype) == "str"


_ADDRESSABLE: dict = {}   # device -> its process is this one


def _addressable(d) -> bool:
    hit = _ADDRESSABLE.get(d)
    if hit is None:
        hit = _ADDRESSABLE[d] = d.process_index == jax.process_index()
    return hit


def _index_key(index) -> tuple:
    return tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s
                 for s in index)


def encode_strings(a: np.ndarray) -> bytes:
    parts = [s.encode("utf-8") for s in a.reshape(-1).tolist()]
    lengths = np.fromiter((len(p) for p in parts), np.uint64, len(parts))
    return lengths.tobytes() + b"".join(parts)


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


def host_array(data, dtype) -> tuple[np.ndarray | bytes, int]:
    """A single-device array's bytes: (contiguous array or bytes, format)."""
    kind = _dtype_kind(dtype)
    if kind == "raw":
        return np.ascontiguousarray(np.asarray(data)), BufferFormat.raw
    if kind == "key":
        return np.ascontiguousarray(np.asarray(jax.random.key_data(data))), \
            BufferFormat.raw
    return encode_strings(np.asarray(data)), BufferFormat.strings


_SINGLE = jax.sharding.SingleDeviceSharding


def inline_shards(xs, devices=None):
    """(signature, data) when a Packer would put every array of ``xs``
    (leaf i: ``xs[i]``, on ``devices``; None: addressable) in the message as
    one raw buffer each -- single-device arrays of raw dtypes, small enough
    -- else None.  ``data`` is the Packer's in-message data; the signature,
    ((payload device id, size), ...), fixes every other Shards column."""
    sig = []
    chunks = []
    size = 0
    for x in xs:
        try:
            sharding = x.sharding
            dtype = x.dtype
            shape = x.shape
        except AttributeError:
            return None
        if type(sharding) is not _SINGLE:
            return None
        d = sharding._device
        if not (_addressable(d) if devices is None else d in devices):
            return None
        if _dtype_kind(dtype) != "raw" or \
                dtype.itemsize * math.prod(shape) > INLINE_LIMIT:
            return None  # (a large array is not made a numpy array here)
        raw = np.asarray(x).tobytes()  # (C order, as host_array's)
        n = len(raw)
        if n > INLINE_LIMIT or size + n + _ALIGN > INLINE_TOTAL:
            return None
        pad = -size % _ALIGN
        if pad:
            chunks.append(bytes(pad))
            size += pad
        chunks.append(raw)
        size += n
        sig.append((payload_id(d), n))
    return tuple(sig), (chunks[0] if len(chunks) == 1 else b"".join(chunks))


class CopyDeadline(Exception):
    """A Packer's deadline passed while it copied inputs (nothing sent)."""


class Packer:
    """Builds the Shards of one message.

    ``pool``: a SegmentPool for buffers above ``inline_limit`` (None: frames).
    After ``add``-ing every leaf, ``finish()`` returns the Shards; then
    ``segments`` (announcements), ``frames`` (out-of-band payloads, in
    order) and ``leases`` (lease ids used) describe the rest.  A message
    that is not sent after all must be ``abandon()``-ed (its leases go back
    to the pool).  However many leaves, the message itself stays small:
    past ``INLINE_TOTAL`` bytes of inline data, buffers go out of it.
    """

    def __init__(self, pool=None, inline_limit: int = INLINE_LIMIT,
                 deadline: float | None = None):
        self.pool = pool
        self.inline_limit = inline_limit
        self.deadline = deadline  # (time.monotonic) CopyDeadline after
        self.s = Shards()
        self._chunks: list = []
        self._data_size = 0
        self.segments: list = []
        self.frames: list = []
        self.leases: list = []
        self._lease_objects: list = []

    def _copy(self, dst, src) -> None:
        """Copy into shared memory, in COPY_CHUNK pieces with the deadline
        checked between them (a GiB takes about half a second)."""
        n = len(src)
        if self.deadline is None or n <= COPY_CHUNK:
            np.copyto(dst, src)
            return
        for start in range(0, n, COPY_CHUNK):
            if time.monotonic() >= self.deadline:
                raise CopyDeadline(f"{start} of {n} bytes copied")
            end = start + COPY_CHUNK
            np.copyto(dst[start:end], src[start:end])

    def abandon(self) -> None:
        """Give back the shared-memory space of a message never sent."""
        if self._lease_objects:
            self.pool.abandon(self._lease_objects)
            self._lease_objects = []
            self.leases = []

    def add(self, leaf: int, x, devices=None) -> None:
        """Add the shards of array ``x`` (leaf number ``leaf``) on
        ``devices`` (a set; None: every addressable shard)."""
        try:
            sharding = x.sharding
            dtype = x.dtype
        except AttributeError:
            raise ValueError(f"leaf {leaf} is {type(x).__name__}, not a "
                             "jax.Array") from None
        s = self.s
        if type(sharding) is jax.sharding.SingleDeviceSharding:
            d = sharding._device
            if devices is None and not _addressable(d):
                return  # another host's: that host sends it
            if devices is None or d in devices:
                s.leaf.append(leaf)
                s.device.append(payload_id(d))
                s.buffer.append(self._buffer(*host_array(x, dtype)))
            return
        shards = x.addressable_shards
        if len(shards) == 1:
            sh = shards[0]
            if devices is None or sh.device in devices:
                s.leaf.append(leaf)
                s.device.append(payload_id(sh.device))
                s.buffer.append(self._buffer(*host_array(sh.data, dtype)))
            return
        seen: dict = {}
        for sh in shards:
            if devices is not None and sh.device not in devices:
                continue
            key = _index_key(sh.index)
            j = seen.get(key)
            if j is None:
                j = seen[key] = self._buffer(*host_array(sh.data, dtype))
            s.leaf.append(leaf)
            s.device.append(payload_id(sh.device))
            s.buffer.append(j)

    def add_all(self, xs) -> None:
        """``add`` every array of ``xs`` (leaf i: ``xs[i]``), all shards."""
        for i, x in enumerate(xs):
            self.add(i, x, None)

    def _lease(self, n: int):
        """A shared-memory lease of ``n`` bytes, or None when /dev/shm has
        no room (the buffer then goes in frames)."""
        try:
            return self.pool.lease(n)
        except OSError as e:
            _log_no_room(n, e)
            return None

    def _buffer(self, arr, fmt) -> int:
        s = self.s
        j = len(s.where)
        raw = arr if isinstance(arr, bytes) else arr.reshape(-1).view(np.uint8)
        n = len(raw)
        s.format.append(fmt)
        s.size.append(n)
        if (n <= self.inline_limit and
                self._data_size + n + _ALIGN <= INLINE_TOTAL):
            pad = -self._data_size % _ALIGN
            if pad:
                self._chunks.append(bytes(pad))
                self._data_size += pad
            s.where.append(BufferWhere.message)
            s.offset.append(self._data_size)
            s.segment.append(0)
            s.lease.append(0)
            self._chunks.append(raw if isinstance(raw, bytes)
                                else raw.tobytes())
            self._data_size += n
        elif self.pool is not None and n > self.inline_limit and \
                (lease := self._lease(n)) is not None:
            self._lease_objects.append(lease)  # abandon() gives it back
            self._copy(lease.view, np.frombuffer(raw, np.uint8)
                       if isinstance(raw, bytes) else raw)
            if lease.announce is not None:
                self.segments.append(lease.announce)
            self.leases.append(lease.id)
            s.where.append(BufferWhere.shm)
            s.offset.append(0)
            s.segment.append(lease.segment)
            s.lease.append(lease.id)
        else:
            s.where.append(BufferWhere.frame)
            s.offset.append(0)
            s.segment.append(0)
            s.lease.append(0)
            mv = memoryview(raw)
            for start in range(0, n, FRAME_CHUNK):
                self.frames.append(mv[start:start + FRAME_CHUNK])
            if n == 0:
                self.frames.append(b"")
        return j

    def finish(self) -> Shards:
        if self._chunks:
            self.s.data = self._chunks[0] if len(self._chunks) == 1 else \
                b"".join(self._chunks)
        return self.s


def frame_count(shards: Shards) -> list:
    """Sizes of the frame buffers, in order (how many frames follow)."""
    return [shards.size[j] for j in range(len(shards.where))
            if shards.where[j] == BufferWhere.frame]


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
    for part, h in zip(layout.parts, hosts):
        a = jax.device_put(h, part[0])
        if layout.kind == "key":
            a = jax.random.wrap_key_data(a, impl=layout.impl)
        arrays.append(a)
    if layout.single and layout.kind != "key":
        return arrays[0]
    return jax.make_array_from_single_device_arrays(
        layout.shape, layout.sharding, arrays)


def message_buffers(m, channel, maps, released):
    """``get(j)``: buffer j of message ``m``'s shards, as bytes-like.

    Reads the out-of-band frames that follow ``m`` on ``channel`` now (they
    come next in the stream) and maps the segments ``m`` announces into
    ``maps`` (a ``blobs.SegmentMaps``).  A shared-memory view puts its lease
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
