"""The 16-byte envelope header that precedes every jaxcolo flatbuffer.

Layout (little endian), documented also in schema/jaxcolo.fbs::

    magic "JXCO" | writer_version u16 | min_reader_version u16 |
    root_kind u8 | flags u8 | reserved u16 (0) | crc32 u32 of bytes[16:]

Flags: bit 0 (``FLAG_ZLIB``) = the body is the flatbuffer deflated with zlib
(the checksum covers the stored bytes).  Other bits must be 0.  Inflating is
bounded: at most ``MAX_INFLATE_RATIO`` times the stored size and ``MAX_BODY``
bytes in all, so memory stays proportional to the payload size; writers only
compress bodies within that ratio, so every payload they write is readable.

A payload may hold other payloads (a program's specs, a bundle's specs, a
message's program), each maybe compressed, so per-envelope ratios would
multiply.  Decoders marked :func:`shares_inflation` therefore share one budget
for everything they open, directly or nested: ``NESTED_INFLATE_RATIO`` times
the stored size of the first (outermost) envelope, plus ``INFLATE_FLOOR``.
A writer's nested payloads are compressed data, which does not compress
again, so what it writes inflates well within that.
"""

from __future__ import annotations

from typing import NamedTuple
import contextvars
import functools
import struct
import zlib

from jaxcolo_fb import RootKind
from jaxcolo import versions
from jaxcolo.errors import PayloadError, VersionError

MAGIC = b"JXCO"
HEADER = struct.Struct("<4sHHBBHI")
HEADER_SIZE = HEADER.size  # 16
FLAG_ZLIB = 0x01
KNOWN_FLAGS = FLAG_ZLIB
MAX_INFLATE_RATIO = 256
MAX_BODY = 2**31 - 1  # the flatbuffer size limit
# One decode (an envelope and every payload nested in it) inflates at most
# this many times the outermost envelope's stored size, plus the floor.
NESTED_INFLATE_RATIO = 4 * MAX_INFLATE_RATIO
INFLATE_FLOOR = 1 << 20


# Root kind -> the versions.py feature that introduced it.
_ROOT_FEATURES = {RootKind.spec_tree: "spec_tree", RootKind.program: "program",
                  RootKind.export_bundle: "export_bundle",
                  RootKind.hello: "hello", RootKind.message: "message"}


class Header(NamedTuple):
    """A payload's envelope header, as read (immutable)."""
    writer_version: int
    min_reader_version: int
    root_kind: int
    body_size: int
    crc32: int
    flags: int = 0


def seal(body: bytes | bytearray, root_kind: int, writer_version: int,
         min_reader_version: int, compress: bool = False) -> bytes:
    """Prefix ``body`` (a finished flatbuffer) with the envelope header;
    with ``compress``, deflate the body when that makes it smaller."""
    flags = 0
    if compress:
        packed = zlib.compress(body, 1)
        if len(packed) < len(body) <= MAX_INFLATE_RATIO * len(packed):
            body, flags = packed, FLAG_ZLIB
    head = HEADER.pack(MAGIC, writer_version, min_reader_version, root_kind,
                       flags, 0, zlib.crc32(body))
    return head + body


class Inflation:
    """What is left of one decode's inflation budget, in bytes (None: not
    yet set; the first envelope opened sets it)."""
    __slots__ = ("left",)

    def __init__(self, left: int | None = None):
        self.left = left

    def copy(self) -> "Inflation":
        return Inflation(self.left)


_INFLATION: contextvars.ContextVar = contextvars.ContextVar(
    "jaxcolo_inflation", default=None)


def current_inflation() -> Inflation | None:
    """The budget of the enclosing decode (None outside any)."""
    return _INFLATION.get()


class inflation_scope:
    """Context manager: every envelope opened inside shares one inflation
    budget: ``budget`` if given (to decode later the payloads nested in one
    decoded earlier, e.g. a message's program), else the enclosing scope's,
    else a new one."""
    __slots__ = ("_budget", "_token")

    def __init__(self, budget: Inflation | None = None):
        self._budget = budget

    def __enter__(self) -> Inflation:
        budget = self._budget
        if budget is None:
            budget = _INFLATION.get()
            if budget is not None:
                self._token = None
                return budget
            budget = Inflation()
        self._token = _INFLATION.set(budget)
        return budget

    def __exit__(self, *exc):
        if self._token is not None:
            _INFLATION.reset(self._token)
        return False


def shares_inflation(decode):
    """Decorate a decoder so that it and everything it decodes (nested
    payloads) share one inflation budget; called inside another decorated
    decoder, it shares that one's."""
    @functools.wraps(decode)
    def scoped(*args, **kwargs):
        if _INFLATION.get() is not None:
            return decode(*args, **kwargs)
        token = _INFLATION.set(Inflation())
        try:
            return decode(*args, **kwargs)
        finally:
            _INFLATION.reset(token)
    return scoped


_NESTED_TOO_LARGE = ("compressed payloads nested in this one inflate beyond "
                     f"{NESTED_INFLATE_RATIO}x the outermost payload's "
                     "stored size")


def initial_budget(stored_size: int) -> int:
    """The inflation budget of a decode whose outermost envelope stores
    ``stored_size`` body bytes."""
    return NESTED_INFLATE_RATIO * stored_size + INFLATE_FLOOR


def open_body(data, header: Header) -> bytes:
    """The flatbuffer after the header, inflated if it is compressed (within
    the enclosing :func:`shares_inflation` budget, if any)."""
    stored = bytes(memoryview(data)[HEADER_SIZE:])
    budget = _INFLATION.get()
    if budget is not None and budget.left is None:
        budget.left = initial_budget(len(stored))
    if not header.flags & FLAG_ZLIB:
        return stored
    limit = min(MAX_BODY, MAX_INFLATE_RATIO * len(stored))
    shared = budget is not None and budget.left < limit
    if shared:
        limit = budget.left
        if limit <= 0:  # (0 would mean "no limit" to zlib)
            raise PayloadError(_NESTED_TOO_LARGE, "$.body")
    inflater = zlib.decompressobj()
    try:
        body = inflater.decompress(stored, limit)
    except zlib.error as e:
        raise PayloadError(f"corrupt compressed body: {e}", "$.body") \
            from None
    if not inflater.eof or inflater.unconsumed_tail or inflater.unused_data:
        if shared and not inflater.eof and len(body) == limit:
            raise PayloadError(_NESTED_TOO_LARGE, "$.body")
        raise PayloadError("compressed body is truncated, too large or has "
                           "trailing bytes", "$.body")
    if budget is not None:
        budget.left -= len(body)
    return body


def is_envelope(data) -> bool:
    return len(data) >= 4 and bytes(data[:4]) == MAGIC


def read_header(data, *, check_crc: bool = True) -> Header:
    """Parse and check the header (magic, reserved bits, checksum).

    Raises PayloadError for anything malformed; does not judge the version.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(
            f"payload must be bytes, got {type(data).__name__}", "$")
    if type(data) is memoryview and not (data.c_contiguous and
                                         data.itemsize == 1):
        raise PayloadError("a payload memoryview must be contiguous bytes "
                           f"(format {data.format!r}, contiguous "
                           f"{data.c_contiguous})", "$")
    if len(data) < HEADER_SIZE:
        raise PayloadError(
            f"truncated payload: {len(data)} bytes, the header alone is "
            f"{HEADER_SIZE}", "$.header")
    magic, writer, min_reader, kind, flags, reserved, crc = HEADER.unpack_from(
        data, 0)
    if magic != MAGIC:
        raise PayloadError(
            f"not a jaxcolo payload (magic {magic!r}, expected {MAGIC!r})",
            "$.header.magic")
    if flags & ~KNOWN_FLAGS:
        raise PayloadError(f"unknown header flag bits set (flags={flags})",
                           "$.header.flags")
    if reserved:
        raise PayloadError(f"reserved header field set ({reserved})",
                           "$.header.reserved")
    if check_crc and zlib.crc32(memoryview(data)[HEADER_SIZE:]) != crc:
        raise PayloadError(
            "checksum mismatch: the payload is corrupt or truncated",
            "$.header.crc32")
    return Header(writer, min_reader, kind, len(data) - HEADER_SIZE, crc,
                  flags)


# (writer, min reader, root kind, reader version) combinations that passed
# check_readable: a repeat (every message of a connection) is one lookup.
_READABLE: set = set()
_READABLE_MAX = 256


def check_readable(header: Header, reader_version: int | None = None) -> None:
    """Raise VersionError unless a reader of ``reader_version`` reads it."""
    key = (header.writer_version, header.min_reader_version,
           header.root_kind, reader_version)
    if key in _READABLE:
        return
    _check_readable(header, reader_version)
    if len(_READABLE) >= _READABLE_MAX:
        _READABLE.clear()
    _READABLE.add(key)


def check_consistent(header: Header) -> None:
    """PayloadError unless the header's versions agree with each other and
    with its root kind (whatever reader is asking)."""
    if header.min_reader_version < 1:
        raise PayloadError(
            f"min_reader_version {header.min_reader_version}: versions "
            "start at 1", "$.header.min_reader_version")
    if header.min_reader_version > header.writer_version:
        raise PayloadError(
            f"inconsistent header: min_reader_version "
            f"{header.min_reader_version} vs writer_version "
            f"{header.writer_version}", "$.header.min_reader_version")
    feature = _ROOT_FEATURES.get(header.root_kind)
    since = versions.FEATURE_SINCE[feature] if feature else 1
    if feature is not None and header.min_reader_version < since:
        raise PayloadError(
            f"a {feature} payload needs reader version >= {since}, but the "
            f"header declares min_reader_version {header.min_reader_version}",
            "$.header.min_reader_version")


def _check_readable(header: Header, reader_version: int | None) -> None:
    reader = versions.SCHEMA_VERSION if reader_version is None else reader_version
    lo = versions.version_info(reader).min_readable if reader in \
        versions.known_versions() else versions.MIN_READABLE_VERSION
    check_consistent(header)
    if header.min_reader_version > reader:
        raise VersionError(
            f"payload needs a reader of version >= {header.min_reader_version} "
            f"(written by version {header.writer_version}); this reader "
            f"supports versions {lo}..{reader}: upgrade jaxcolo",
            "$.header.min_reader_version")
    if header.writer_version < lo:
        raise VersionError(
            f"payload version {header.writer_version} is older than this "
            f"reader supports ({lo}..{reader})", "$.header.writer_version")
    # (a newer writer's kind needs a newer reader: refused above)
    if header.root_kind not in _ROOT_FEATURES:
        raise PayloadError(f"unknown root kind {header.root_kind}",
                           "$.header.root_kind")


def nested_min_reader(nested, outer_version: int, path: str,
                      error=None) -> int:
    """The min_reader_version of a payload nested in another one written at
    ``outer_version`` (1 for bytes that are not a jaxcolo payload: opaque
    here, checked by whoever decodes them); ``error`` (EncodeError when
    writing) if its header is bad or newer than its container."""
    error = error or PayloadError
    if not is_envelope(nested):
        return 1
    try:
        h = read_header(nested, check_crc=False)
    except PayloadError as e:
        raise error(f"nested payload: {e.reason}", path + e.path[1:]) \
            from None
    if h.writer_version > outer_version:
        raise error(f"nested payload of version {h.writer_version} in a "
                    f"version {outer_version} payload",
                    f"{path}.header.writer_version")
    return h.min_reader_version


def decode_nested(fn, data, path: str, *args):
    """``fn(data, *args)`` -- decoding or inspecting a payload nested in
    another one -- with a PayloadError's path put under ``path`` (the
    field holding it)."""
    try:
        return fn(data, *args)
    except PayloadError as e:
        raise type(e)(e.reason, path + e.path[1:]) from None


def check_nested_declared(nested, outer: Header, path: str) -> None:
    """PayloadError if a nested payload needs a newer reader than its
    container's header declares (a forged or corrupt header: a reader of the
    declared version would accept the container, then fail inside)."""
    need = nested_min_reader(nested, outer.writer_version, path)
    if need > outer.min_reader_version:
        raise PayloadError(
            f"nested payload needs reader version >= {need}, but the header "
            f"declares min_reader_version {outer.min_reader_version}",
            f"{path}.header.min_reader_version")
