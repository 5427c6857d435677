"""jax.Array shards -> message buffers, without pickle (the receiving side
is :mod:`jaxcolo.process.arrays`).

:class:`Packer`: each addressable shard of an array becomes a buffer of raw
bytes -- the shard's elements in C order (PRNG key arrays: their uint32 key
data; StringDType arrays: uint64 UTF-8 lengths then the bytes).  Replicas of
one shard share a buffer.  Small buffers travel in the message (up to
``INLINE_TOTAL`` bytes in all; any more in frames after it), large ones in
shared memory (a ``SegmentPool``) or, between machines, in frames after the
message.  :func:`inline_shards`: the in-message data of arrays that all
travel in the message, for the encoder templates' fast path.
"""

from __future__ import annotations

import logging
import math
import time

import jax
import numpy as np

from jaxcolo_fb import BufferFormat, BufferWhere
from jaxcolo.codec.mesh import payload_id
from jaxcolo.process.arrays import FRAME_CHUNK, addressable, dtype_kind, \
    index_key
from jaxcolo.process.messages import Shards
from jaxcolo.transport import blobs

COPY_CHUNK = 64 << 20      # bytes copied into shared memory between checks
INLINE_LIMIT = 64 * 1024    # larger buffers go out of the message
INLINE_TOTAL = 8 << 20      # a message carries at most this much data; more
                            # buffers (however small) go out of it too
_ALIGN = 64

log = logging.getLogger(__name__)
_NO_ROOM_LOGGED = []


def _log_no_room(n: int, e: OSError) -> None:
    if not _NO_ROOM_LOGGED:  # once per process: it repeats per buffer
        _NO_ROOM_LOGGED.append(True)
        log.warning("no shared memory for a %d-byte buffer (%s): large "
                    "buffers go in frames while /dev/shm has no room", n, e)


def encode_strings(a: np.ndarray) -> bytes:
    parts = [s.encode("utf-8") for s in a.reshape(-1).tolist()]
    lengths = np.fromiter((len(p) for p in parts), np.uint64, len(parts))
    return lengths.tobytes() + b"".join(parts)


def host_array(data, dtype) -> tuple[np.ndarray | bytes, int]:
    """A single-device array's bytes: (contiguous array or bytes, format)."""
    kind = dtype_kind(dtype)
    if kind == "raw":
        return np.ascontiguousarray(np.asarray(data)), BufferFormat.raw
    if kind == "key":
        return np.ascontiguousarray(np.asarray(jax.random.key_data(data))), \
            BufferFormat.raw
    return encode_strings(np.asarray(data)), BufferFormat.strings


_SINGLE = jax.sharding.SingleDeviceSharding


def private_copies(xs) -> list:
    """Copies of jax.Arrays ``xs`` in their own buffers, on the same
    shardings (what a call that waits to be sent holds: its caller may
    delete or donate the inputs meanwhile)."""
    return [jax.device_put(x, x.sharding, may_alias=False)
            if isinstance(x, jax.Array) else x for x in xs]


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
        if not (addressable(d) if devices is None else d in devices):
            return None
        if dtype_kind(dtype) != "raw" or \
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
            if devices is None and not addressable(d):
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
            key = index_key(sh.index)
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
        no room or every segment the pool may have is leased (the buffer
        then goes in frames)."""
        try:
            return self.pool.lease(n)
        except blobs.PoolFull:
            return None
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
