"""The 16-byte envelope header that precedes every jaxcolo flatbuffer.

Layout (little endian), documented also in schema/jaxcolo.fbs::

    magic "JXCO" | writer_version u16 | min_reader_version u16 |
    root_kind u8 | flags u8 (0) | reserved u16 (0) | crc32 u32 of bytes[16:]
"""

from __future__ import annotations

import dataclasses
import struct
import zlib

from jaxcolo import versions
from jaxcolo.errors import PayloadError, VersionError

MAGIC = b"JXCO"
HEADER = struct.Struct("<4sHHBBHI")
HEADER_SIZE = HEADER.size  # 16


@dataclasses.dataclass(frozen=True)
class Header:
    writer_version: int
    min_reader_version: int
    root_kind: int
    body_size: int
    crc32: int


def seal(body: bytes | bytearray, root_kind: int, writer_version: int,
         min_reader_version: int) -> bytes:
    """Prefix ``body`` (a finished flatbuffer) with the envelope header."""
    head = HEADER.pack(MAGIC, writer_version, min_reader_version, root_kind,
                       0, 0, zlib.crc32(body))
    return head + body


def is_envelope(data) -> bool:
    return len(data) >= 4 and bytes(data[:4]) == MAGIC


def read_header(data, *, check_crc: bool = True) -> Header:
    """Parse and check the header (magic, reserved bits, checksum).

    Raises PayloadError for anything malformed; does not judge the version.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(
            f"payload must be bytes, got {type(data).__name__}", "$")
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
    if flags or reserved:
        raise PayloadError(
            f"reserved header bits set (flags={flags}, reserved={reserved})",
            "$.header.flags")
    if check_crc and zlib.crc32(memoryview(data)[HEADER_SIZE:]) != crc:
        raise PayloadError(
            "checksum mismatch: the payload is corrupt or truncated",
            "$.header.crc32")
    return Header(writer, min_reader, kind, len(data) - HEADER_SIZE, crc)


def check_readable(header: Header, reader_version: int | None = None) -> None:
    """Raise VersionError unless a reader of ``reader_version`` reads it."""
    reader = versions.SCHEMA_VERSION if reader_version is None else reader_version
    lo = versions.version_info(reader).min_readable if reader in \
        versions.known_versions() else versions.MIN_READABLE_VERSION
    if header.min_reader_version > header.writer_version or \
            header.min_reader_version < 1:
        raise PayloadError(
            f"inconsistent header: min_reader_version "
            f"{header.min_reader_version} vs writer_version "
            f"{header.writer_version}", "$.header.min_reader_version")
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
