"""Can a reader of a given version read a payload?  (``jaxcolo check``)"""

from __future__ import annotations

from jaxcolo import envelope, versions
from jaxcolo.errors import PayloadError, UnavailableHereError, VersionError


def check_readable(data, reader_version: int) -> tuple[bool, str]:
    """(ok, reason).  Checks the envelope against the reader's version range
    (the same rule readers apply), then decodes the content with this
    library's own decoder (the one ``jaxcolo.deserialize`` uses; program
    bodies are not loaded) and walks every table as ``inspect`` does (a
    field the decoded objects do not use may be malformed too).  Content naming devices or registrations this
    process lacks is checked up to there and said so.  For a JAX export
    payload (no jaxcolo magic), ``reader_version`` is a JAX serialization
    version."""
    if isinstance(data, (bytes, bytearray, memoryview)) and \
            not envelope.is_envelope(data):
        from jaxcolo.export.inspection import check_jax_export
        return check_jax_export(data, reader_version)
    if reader_version not in versions.known_versions():
        return False, (f"unknown reader version {reader_version}; known "
                       f"versions: {list(versions.known_versions())}")
    try:
        header = envelope.read_header(data)
    except PayloadError as e:
        return False, f"not readable: {e}"
    try:
        envelope.check_readable(header, reader_version)
    except VersionError as e:
        return False, f"not readable by version {reader_version}: {e.reason}"
    except PayloadError as e:
        return False, f"malformed payload: {e}"
    note = ""
    with versions.noting_used() as used:
        try:
            from jaxcolo.payload import deserialize
            deserialize(data)
        except UnavailableHereError as e:
            note = (f"; content checked up to what this process lacks "
                    f"(fine where it exists): {e}")
        except VersionError as e:
            return False, (f"cannot check the content: this jaxcolo reads "
                           f"versions {versions.MIN_READABLE_VERSION}.."
                           f"{versions.SCHEMA_VERSION} ({e})")
        except PayloadError as e:
            return False, f"malformed payload: {e}"
        try:  # every table, also those the decoded objects do not use (as
            from jaxcolo.inspection import inspect  # inspect walks them;
            inspect(data)  # it goes on past content this process lacks,
        except PayloadError as e:  # and notes what it meets there too)
            return False, f"malformed payload: {e}"
    # Features readers read whatever the header says (earlier writers
    # stamped them readable by older readers, which refuse them).
    for feature in sorted(used, key=versions.FEATURE_SINCE.get):
        since = versions.FEATURE_SINCE[feature]
        if since > reader_version:
            return False, (
                f"not readable by version {reader_version}: the content "
                f"uses {feature}, which needs reader version >= {since} "
                f"(the header's min_reader_version "
                f"{header.min_reader_version} is what writers before "
                f"{since} stamped)")
    return True, (f"readable by version {reader_version} (payload version "
                  f"{header.writer_version}, needs reader >= "
                  f"{header.min_reader_version}){note}")
