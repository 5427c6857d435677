"""A faster drop-in for ``flatbuffers.Builder``, for the flatc-generated code.

The generated ``<Table>Start/Add<Field>/End`` functions only call a handful
of Builder methods.  This class implements those methods with the same
semantics and byte layout as flatbuffers' own Builder (alignment, vtable
sharing, field order), but builds the buffer *reversed* in a bytearray — each
prepend is one ``extend`` of pre-reversed bytes — and reverses once at the end.
The tests check that it produces byte-identical output to
``flatbuffers.Builder`` over the whole test corpus.
"""

from __future__ import annotations

import struct

import numpy as np

from jaxcolo.errors import EncodeError

_BE = {name: struct.Struct(">" + code).pack for name, code in (
    ("Bool", "?"), ("Uint8", "B"), ("Int8", "b"), ("Uint16", "H"),
    ("Int16", "h"), ("Uint32", "I"), ("Int32", "i"), ("Uint64", "Q"),
    ("Int64", "q"), ("Float32", "f"), ("Float64", "d"))}
_SIZE = {name: struct.calcsize(code) for name, code in (
    ("Bool", "?"), ("Uint8", "B"), ("Int8", "b"), ("Uint16", "H"),
    ("Int16", "h"), ("Uint32", "I"), ("Int32", "i"), ("Uint64", "Q"),
    ("Int64", "q"), ("Float32", "f"), ("Float64", "d"))}
_U32 = _BE["Uint32"]
_I32 = _BE["Int32"]
_U16 = _BE["Uint16"]


_VTABLE_PACKERS: dict = {}


def _vtable_packer(n: int):
    """struct packer of a vtable of ``n`` fields, big endian (reversed)."""
    p = _VTABLE_PACKERS.get(n)
    if p is None:
        p = _VTABLE_PACKERS[n] = struct.Struct(f">{n + 2}H").pack
    return p


class FastBuilder:
    """Subset of flatbuffers.Builder used by generated code and jaxcolo."""

    __slots__ = ("buf", "minalign", "vtable", "object_end", "vtables",
                 "vector_num", "nested", "sharedStrings")

    def __init__(self, initial_size: int = 0):
        self.buf = bytearray()  # the buffer, reversed
        self.minalign = 1
        self.vtable = None
        self.object_end = 0
        self.vtables: dict[bytes, int] = {}
        self.vector_num = 0
        self.sharedStrings: dict = {}

    def Offset(self) -> int:
        return len(self.buf)

    def Prep(self, size: int, additional: int) -> None:
        if size > self.minalign:
            self.minalign = size
        pad = (-(len(self.buf) + additional)) % size
        if pad:
            self.buf.extend(bytes(pad))

    # ------------------------------------------------------------ scalars
    def PrependUOffsetTRelative(self, off: int) -> None:
        buf = self.buf
        if self.minalign < 4:
            self.minalign = 4
        pad = -len(buf) % 4
        if pad:
            buf.extend(bytes(pad))
        buf.extend(_U32(len(buf) - off + 4))

    def PrependUint32(self, x) -> None:
        self.Prep(4, 0)
        self.buf.extend(_U32(x))

    # ------------------------------------------------------------ tables
    def StartObject(self, numfields: int) -> None:
        self.vtable = [0] * numfields
        self.object_end = len(self.buf)

    def PrependUOffsetTRelativeSlot(self, slot, x, d) -> None:
        if x != d:
            self.PrependUOffsetTRelative(x)
            self.vtable[slot] = len(self.buf)

    def EndObject(self) -> int:
        buf = self.buf
        self.Prep(4, 0)
        buf.extend(b"\0\0\0\0")  # soffset placeholder
        obj = len(buf)
        vt = self.vtable
        n = len(vt)
        while n and not vt[n - 1]:
            n -= 1
        entries = [(obj - o if o else 0) for o in vt[:n]]
        # vtable entries are prepended last-field-first, then the table's
        # size, then the vtable's; those (reversed) bytes are also its key.
        entries.reverse()
        entries.append(obj - self.object_end)
        entries.append((n + 2) * 2)
        key = _vtable_packer(n)(*entries)
        existing = self.vtables.get(key)
        if existing is None:
            buf.extend(key)
            existing = len(buf)
            self.vtables[key] = existing
        buf[obj - 4:obj] = _I32(existing - obj)
        self.vtable = None
        return obj

    # ----------------------------------------------------------- vectors
    def StartVector(self, elem_size: int, num: int, alignment: int) -> int:
        self.Prep(4, elem_size * num)
        self.Prep(alignment, elem_size * num)
        self.vector_num = num
        return len(self.buf)

    def EndVector(self, vector_num_elems=None) -> int:
        self.buf.extend(_U32(self.vector_num if vector_num_elems is None
                             else vector_num_elems))
        return len(self.buf)

    def CreateString(self, s) -> int:
        """The string ``s``; EncodeError (at "$": callers that know where
        it goes re-root it) if a str is not text UTF-8 can hold (lone
        surrogates), or ``s`` is neither str nor bytes (JAX takes any
        hashable as an axis name: an int must not become that many NULs),
        the one way every writer learns of those."""
        if isinstance(s, str):
            try:
                b = s.encode("utf-8")
            except UnicodeEncodeError as e:
                raise EncodeError(
                    f"string {s!r:.80} cannot be written as UTF-8 "
                    f"({e.reason}, at index {e.start})") from None
        elif isinstance(s, (bytes, bytearray, memoryview)):
            b = bytes(s)
        else:
            raise EncodeError(f"{type(s).__name__} {s!r:.80} is not a str: "
                              "names are written as text")
        self.Prep(4, len(b) + 1)
        self.buf.append(0)
        self.buf.extend(b[::-1])
        self.buf.extend(_U32(len(b)))
        return len(self.buf)

    def CreateSharedString(self, s) -> int:
        """CreateString, writing each distinct string once per buffer."""
        off = self.sharedStrings.get(s)
        if off is None:
            off = self.sharedStrings[s] = self.CreateString(s)
        return off

    def CreateByteVector(self, b) -> int:
        b = bytes(b)
        self.Prep(4, len(b))
        self.Prep(1, len(b))
        self.buf.extend(b[::-1])
        self.buf.extend(_U32(len(b)))
        return len(self.buf)

    def CreateNumpyVector(self, x) -> int:
        x = np.asarray(x)
        if x.dtype.byteorder == ">":
            x = x.astype(x.dtype.newbyteorder("<"))
        n, size = x.size, x.dtype.itemsize
        self.Prep(4, n * size)
        self.Prep(size, n * size)
        self.buf.extend(x.tobytes()[::-1])
        self.buf.extend(_U32(n))
        return len(self.buf)

    # ------------------------------------------------------------ finish
    def Finish(self, root: int) -> None:
        self.Prep(self.minalign, 4)
        self.PrependUOffsetTRelative(root)

    def Output(self) -> bytes:
        return bytes(self.buf[::-1])


def offset_vector(builder, offs) -> int:
    """The vector of offsets ``offs`` (tables or strings, in order), built
    with any Builder (this one or flatbuffers')."""
    builder.StartVector(4, len(offs), 4)
    for off in reversed(offs):
        builder.PrependUOffsetTRelative(off)
    return builder.EndVector()


def string_vector(builder, strings) -> int:
    """The vector of ``strings``, each stored once per buffer."""
    return offset_vector(builder,
                         [builder.CreateSharedString(s) for s in strings])


def _make_prepend(name):
    pack, size = _BE[name], _SIZE[name]

    def prepend(self, x):
        self.Prep(size, 0)
        self.buf.extend(pack(x))

    def prepend_slot(self, slot, x, d):
        if x != d:
            self.Prep(size, 0)
            self.buf.extend(pack(x))
            self.vtable[slot] = len(self.buf)
    return prepend, prepend_slot


for _name in _BE:
    _p, _ps = _make_prepend(_name)
    setattr(FastBuilder, f"Prepend{_name}", _p)
    setattr(FastBuilder, f"Prepend{_name}Slot", _ps)
FastBuilder.PrependByte = FastBuilder.PrependUint8
