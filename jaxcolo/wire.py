"""Bounds-checked reading of flatbuffers, and field layouts from generated code.

flatbuffers' Python runtime has no verifier: a corrupt buffer makes the
generated accessors raise arbitrary exceptions or return garbage.  Decoders in
jaxcolo therefore read through :class:`Table`, which checks every offset, every
vector length against the buffer size and every string's UTF-8 before
returning, and raises :class:`PayloadError` naming the field path otherwise.

Field positions (vtable offsets) are not written by hand: :func:`layout`
extracts them from the flatc-generated builder functions of each table, so the
schema stays the single source of truth.
"""

from __future__ import annotations

import re
import struct
import types

import numpy as np

from jaxcolo.errors import PayloadError

_U8 = struct.Struct("<B").unpack_from
_U16 = struct.Struct("<H").unpack_from
_I16 = struct.Struct("<h").unpack_from
_I32 = struct.Struct("<i").unpack_from
_U32 = struct.Struct("<I").unpack_from
_I64 = struct.Struct("<q").unpack_from
_U64 = struct.Struct("<Q").unpack_from

_SCALARS = {
    # name: (unpack_from, width)
    "u8": (_U8, 1), "bool": (_U8, 1), "u16": (_U16, 2), "i16": (_I16, 2),
    "i32": (_I32, 4), "u32": (_U32, 4), "i64": (_I64, 8), "u64": (_U64, 8),
}

_VECTOR_CODES = {  # name: (struct code, width) of vector elements
    "u8": ("B", 1), "bool": ("B", 1), "u16": ("H", 2), "i16": ("h", 2),
    "i32": ("i", 4), "u32": ("I", 4), "i64": ("q", 8), "u64": ("Q", 8),
}

_NP_LE = {
    "u8": np.dtype("u1"), "u32": np.dtype("<u4"), "i64": np.dtype("<i8"),
    "u16": np.dtype("<u2"),
}


# --------------------------------------------------------------- layouts

class _SlotProbe:
    """Stands in for a flatbuffers.Builder to learn which slot an Add* uses."""

    def __init__(self):
        self.slot = None

    def __getattr__(self, name):
        def record(slot, *args):
            self.slot = slot
        return record


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def layout(module: types.ModuleType, table: str) -> types.SimpleNamespace:
    """Vtable offsets of the fields of ``table`` in the generated ``module``.

    ``layout(jaxcolo_fb, "Mesh").device_ids == 4`` etc.  Read off the
    generated ``<Table>Add<Field>`` functions, so it always matches generated/.
    """
    prefix = f"{table}Add"
    fields = {}
    for name, fn in vars(module).items():
        if name.startswith(prefix) and callable(fn):
            probe = _SlotProbe()
            fn(probe, 0)
            fields[_snake(name[len(prefix):])] = 4 + 2 * probe.slot
    return types.SimpleNamespace(**fields)


# ---------------------------------------------------------------- reading

def _fail(path, reason):
    raise PayloadError(reason, path)


def _too_many_reads(path, name):
    """A Buffer's ``reads_left`` went negative (the accessors charge it
    inline: this is the decoder's hottest code)."""
    _fail(f"{path}.{name}", "vector reads are out of proportion to the "
          "payload size (vectors shared by many tables or entries)")


# A deflated body is charged for at most this many times its stored bytes
# (junk deflates 256x, symbolic text as writers write it far less).
STORED_PARSE_RATIO = 8


def parse_budget(size: int, stored: int | None = None) -> int:
    """Parse units (~3.5 us each, see codec.symbolic) a reader allows a
    flatbuffer of ``size`` bytes (``stored`` in the payload, if deflated);
    the writers refuse payloads over it."""
    if stored is not None and stored < size:
        size = min(size, STORED_PARSE_RATIO * stored)
    return 12 * size + 65536


class Buffer:
    """A flatbuffer held as immutable bytes, with its size.

    Work is bounded by the size even when offsets are shared (a table or a
    string referenced from many places, which a crafted payload can do
    thousands of times): each string is decoded once per buffer and then
    shared, table visits are limited to ``visits_left`` (several per table a
    buffer of this size can hold), and decoders that parse text (symbolic
    expressions) charge it to ``parse_left`` through :meth:`charge_parse`.
    """

    __slots__ = ("data", "size", "visits_left", "parse_left", "reads_left",
                 "strs", "memo")

    def __init__(self, data: bytes, stored: int | None = None):
        self.data = data
        self.size = len(data)
        # A table takes >= 4 bytes, so size/4 tables at most: allow 4 visits
        # each (decoders make one or two passes), plus slack.
        self.visits_left = self.size + 4096
        self.parse_left = parse_budget(self.size, stored)
        # Vector elements handed out.  Several tables (or entries of one
        # vector) may point at the same vector: without a budget, re-reading
        # it once per reference would cost entries x length.  A decoder
        # reads each of the (at most size) elements once or twice.
        self.reads_left = 8 * self.size + 65536
        self.strs: dict = {}  # string position -> decoded str
        self.memo: dict = {}  # decoders' results by table position

    def charge_parse(self, n: int, path: str) -> None:
        """Account for parsing ``n`` characters of text from this buffer."""
        self.parse_left -= n
        if self.parse_left < 0:
            _fail(path, "text to parse is out of proportion to the payload "
                  "size (shared or repeated strings)")

    def string_at(self, s: int, path: str) -> str:
        """The string whose length prefix is at ``s`` (checked, decoded once
        per buffer)."""
        out = self.strs.get(s)
        if out is None:
            data, size = self.data, self.size
            if s + 4 > size:
                _fail(path, f"offset {s} out of bounds")
            ln = _U32(data, s)[0]
            if s + 4 + ln > size:
                _fail(path, f"string length {ln} exceeds the buffer")
            # strings at distinct but overlapping positions each decode in
            # full: their bytes count as reads like vector elements
            self.reads_left -= ln
            if self.reads_left < 0:
                _fail(path, "strings decoded are out of proportion to the "
                      "payload size (overlapping strings)")
            out = self.strs[s] = _decode_utf8(data, s + 4, ln, path)
        return out

    def root(self, path: str = "$") -> "Table":
        if self.size < 8:
            _fail(path, f"flatbuffer too short ({self.size} bytes)")
        return self.table_at(_U32(self.data, 0)[0], path)

    def table_at(self, pos: int, path: str) -> "Table":
        data, size = self.data, self.size
        self.visits_left -= 1
        if self.visits_left < 0:
            _fail(path, "too many table visits for the payload size (tables "
                  "shared or referenced in a cycle)")
        if pos < 0 or pos + 4 > size:
            _fail(path, f"table offset {pos} out of bounds ({size} bytes)")
        vt = pos - _I32(data, pos)[0]
        if vt < 0 or vt + 4 > size:
            _fail(path, f"vtable offset {vt} out of bounds")
        vtlen, tlen = _U16(data, vt)[0], _U16(data, vt + 2)[0]
        if vtlen < 4 or vtlen & 1 or vt + vtlen > size:
            _fail(path, f"bad vtable (length {vtlen})")
        if tlen < 4 or pos + tlen > size:
            _fail(path, f"bad table size {tlen}")
        return Table(self, pos, vt, vtlen, tlen)


class Table:
    """A checked view of one table.  Accessors return None when absent."""

    __slots__ = ("buf", "pos", "vt", "vtlen", "tlen")

    def __init__(self, buf, pos, vt, vtlen, tlen):
        self.buf = buf
        self.pos = pos
        self.vt = vt
        self.vtlen = vtlen
        self.tlen = tlen

    def present(self, voff: int) -> bool:
        """Whether the vtable says the field is there (its offset is not
        checked: that is done where the field is read)."""
        return voff < self.vtlen and _U16(self.buf.data, self.vt + voff)[0] != 0

    def _field(self, voff: int, width: int, path: str, name: str) -> int:
        """Absolute position of a field, or 0 when it is absent."""
        if voff >= self.vtlen:
            return 0
        fo = _U16(self.buf.data, self.vt + voff)[0]
        if not fo:
            return 0
        if fo + width > self.tlen:
            _fail(f"{path}.{name}", f"field offset {fo} outside its table")
        return self.pos + fo

    def scalar(self, voff: int, kind: str, default, path: str, name: str):
        unpack, width = _SCALARS[kind]
        at = self._field(voff, width, path, name)
        if not at:
            return default
        return unpack(self.buf.data, at)[0]

    def _target(self, voff: int, path: str, name: str) -> int:
        at = self._field(voff, 4, path, name)
        if not at:
            return 0
        tgt = at + _U32(self.buf.data, at)[0]
        if tgt + 4 > self.buf.size:
            _fail(f"{path}.{name}", f"offset {tgt} out of bounds "
                  f"({self.buf.size} bytes)")
        return tgt

    def table(self, voff: int, path: str, name: str) -> "Table | None":
        tgt = self._target(voff, path, name)
        if not tgt:
            return None
        return self.buf.table_at(tgt, f"{path}.{name}")

    def _vector(self, voff: int, width: int, path: str, name: str):
        """(start, length) of a vector field, bounds-checked; None if absent.

        (_field and _target inlined: this is the decoder's hottest call.)"""
        if voff >= self.vtlen:
            return None
        buf = self.buf
        data = buf.data
        fo = _U16(data, self.vt + voff)[0]
        if not fo:
            return None
        if fo + 4 > self.tlen:
            _fail(f"{path}.{name}", f"field offset {fo} outside its table")
        at = self.pos + fo
        tgt = at + _U32(data, at)[0]
        size = buf.size
        if tgt + 4 > size:
            _fail(f"{path}.{name}", f"offset {tgt} out of bounds "
                  f"({size} bytes)")
        n = _U32(data, tgt)[0]
        if tgt + 4 + n * width > size:
            _fail(f"{path}.{name}", f"vector length {n} exceeds the buffer "
                  f"({size} bytes)")
        return tgt + 4, n

    def string(self, voff: int, path: str, name: str) -> "str | None":
        v = self._vector(voff, 1, path, name)
        if v is None:
            return None
        return self.buf.string_at(v[0] - 4, f"{path}.{name}")

    def bytes(self, voff: int, path: str, name: str) -> "bytes | None":
        v = self._vector(voff, 1, path, name)
        if v is None:
            return None
        buf = self.buf
        buf.reads_left -= v[1]
        if buf.reads_left < 0:
            _too_many_reads(path, name)
        return buf.data[v[0]:v[0] + v[1]]

    def array(self, voff: int, kind: str, path: str, name: str) -> np.ndarray:
        """A scalar vector as a read-only numpy array (empty when absent)."""
        dt = _NP_LE[kind]
        v = self._vector(voff, dt.itemsize, path, name)
        if v is None:
            return np.empty(0, dt)
        buf = self.buf
        buf.reads_left -= v[1]
        if buf.reads_left < 0:
            _too_many_reads(path, name)
        return np.frombuffer(buf.data, dt, v[1], v[0])

    def ints(self, voff: int, kind: str, path: str, name: str) -> tuple:
        """A scalar vector as a tuple of Python ints (empty when absent)."""
        code, width = _VECTOR_CODES[kind]
        v = self._vector(voff, width, path, name)
        if v is None or not v[1]:
            return ()
        buf = self.buf
        buf.reads_left -= v[1]
        if buf.reads_left < 0:
            _too_many_reads(path, name)
        return struct.unpack_from(f"<{v[1]}{code}", buf.data, v[0])

    def strings(self, voff: int, path: str, name: str) -> list:
        v = self._vector(voff, 4, path, name)
        if v is None:
            return []
        buf = self.buf
        data, string_at, cached = buf.data, buf.string_at, buf.strs.get
        start, n = v
        buf.reads_left -= n
        if buf.reads_left < 0:
            _too_many_reads(path, name)
        out = []
        for i in range(n):
            at = start + 4 * i
            s = at + _U32(data, at)[0]
            out.append(cached(s) or string_at(s, f"{path}.{name}[{i}]"))
        return out

    def tables(self, voff: int, path: str, name: str) -> list:
        """Positions of the tables in a vector of tables (not yet checked)."""
        v = self._vector(voff, 4, path, name)
        if v is None:
            return []
        buf = self.buf
        data = buf.data
        start, n = v
        buf.reads_left -= n
        if buf.reads_left < 0:
            _too_many_reads(path, name)
        return [start + 4 * i + _U32(data, start + 4 * i)[0] for i in range(n)]

    def vector_length(self, voff: int, width: int, path: str, name: str) -> int:
        v = self._vector(voff, width, path, name)
        return 0 if v is None else v[1]


def _decode_utf8(data: bytes, start: int, n: int, path: str) -> str:
    try:
        return data[start:start + n].decode("utf-8")
    except UnicodeDecodeError as e:
        raise PayloadError(f"invalid UTF-8 in string ({e.reason})", path) \
            from None


def bounded_product(values, limit: int):
    """The product of non-negative ints ``values``, or None once it exceeds
    ``limit`` (without building huge integers: time linear in the count)."""
    out = 1
    for v in values:
        out *= v
        if out > limit:
            return None
    return out


def check_enum(value: int, valid, path: str, what: str) -> int:
    if value not in valid:
        raise PayloadError(f"unknown {what} value {value}", path)
    return value


def enum_values(enum_class) -> frozenset:
    """All values of a flatc-generated enum class."""
    return frozenset(v for k, v in vars(enum_class).items()
                     if not k.startswith("_") and isinstance(v, int))
