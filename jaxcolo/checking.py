"""Can a reader of a given version read a payload?  (``jaxcolo check``)"""

from __future__ import annotations

from jaxcolo import envelope, versions
from jaxcolo.errors import PayloadError, VersionError


def check_readable(data, reader_version: int) -> tuple[bool, str]:
    """(ok, reason).  Checks the envelope against the reader's version range
    (the same rule readers apply) and that this library can decode the
    content structurally.  For a JAX export payload (no jaxcolo magic),
    ``reader_version`` is a JAX serialization version."""
    if isinstance(data, (bytes, bytearray, memoryview)) and \
            not envelope.is_envelope(data):
        from jaxcolo.export.inspection import check_jax_export
        return check_jax_export(data, reader_version)
    try:
        header = envelope.read_header(data)
    except PayloadError as e:
        return False, f"not readable: {e}"
    if reader_version not in versions.known_versions() and \
            reader_version <= versions.SCHEMA_VERSION:
        return False, (f"unknown reader version {reader_version}; known "
                       f"versions: {list(versions.known_versions())}")
    try:
        envelope.check_readable(header, reader_version)
    except PayloadError as e:
        return False, f"not readable by version {reader_version}: {e.reason}"
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
