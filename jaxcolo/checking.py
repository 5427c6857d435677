"""Can a reader of a given version read a payload?  (``jaxcolo check``)"""

from __future__ import annotations

from jaxcolo import envelope, versions
from jaxcolo.errors import PayloadError, VersionError


def check_readable(data, reader_version: int) -> tuple[bool, str]:
    """(ok, reason).  Checks the envelope against the reader's version range
    and that this library can decode the content structurally."""
    try:
        header = envelope.read_header(data)
    except PayloadError as e:
        return False, f"not readable: {e}"
    if reader_version in versions.known_versions():
        lo = versions.version_info(reader_version).min_readable
    elif reader_version > versions.SCHEMA_VERSION:
        lo = versions.MIN_READABLE_VERSION  # a future reader; assume our range
    else:
        return False, (f"unknown reader version {reader_version}; known "
                       f"versions: {list(versions.known_versions())}")
    if header.min_reader_version > reader_version:
        return False, (
            f"not readable by version {reader_version}: the payload (written "
            f"by version {header.writer_version}) needs a reader of version "
            f">= {header.min_reader_version}")
    if header.writer_version < lo:
        return False, (
            f"not readable by version {reader_version}: it reads versions "
            f"{lo}..{reader_version}, the payload is version "
            f"{header.writer_version}")
    try:
        from jaxcolo.inspection import inspect
        inspect(data)
    except VersionError as e:
        return False, f"not readable: {e}"
    except PayloadError as e:
        return False, f"malformed payload: {e}"
    return True, (f"readable by version {reader_version} (payload version "
                  f"{header.writer_version}, needs reader >= "
                  f"{header.min_reader_version})")
