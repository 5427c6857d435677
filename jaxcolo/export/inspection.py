"""``jaxcolo inspect`` / ``jaxcolo check`` for JAX export payloads.

A JAX payload is a bare flatbuffer; anything that does not start with
jaxcolo's magic is tried as one.  The description says which serialization
versions could have written it and which JAX releases can read it.
"""

from __future__ import annotations

from jaxcolo.errors import PayloadError, UnavailableHereError
from jaxcolo.export import versions
from jaxcolo.inspection import describe_leaves, describe_structure
from jaxcolo.export.decode import deserialize
from jaxcolo.export.detect import reader_verdict, releases_reading, scan, \
    version_range

def inspect_jax_export(data, nested: bool = False) -> dict:
    """JSON-serialisable description.  PayloadError if malformed (when not
    ``nested`` in a bundle, saying that the bytes are no payload at all)."""
    try:
        lay = scan(data)
        lo, hi = version_range(data)
    except PayloadError as e:
        precise = _field_error(data)
        if precise is not None:  # an Exported, with one field wrong
            raise precise from None
        if nested:
            raise
        raise PayloadError(f"neither a jaxcolo payload (no JXCO magic) nor a "
                           f"JAX export payload: {e.reason}", e.path) from None
    readers = {}
    for row in versions.HISTORY:
        readers[row.version] = reader_verdict(row.version, lay)
    out = {
        "format": "jax_export",
        "root_kind": "Exported",
        "size": len(data),
        "stored_serialization_version": sorted(lay.stored),
        "serialization_version": lo,
        "version_range": [lo, hi],
        "written_by_releases": [r for row in versions.HISTORY
                                if lo <= row.version <= hi
                                for r in row.releases],
        "readable_by_versions": [v for v, (ok, _) in readers.items() if ok],
        "readable_by_releases": [r for row in versions.HISTORY
                                 if readers[row.version][0]
                                 for r in releases_reading(row.version, lay)],
        "not_readable_by": {v: why for v, (ok, why) in readers.items()
                            if not ok},
    }
    if lay.jax_version is not None:
        out["jax_version"] = lay.jax_version
    try:
        exp = deserialize(data)
    except UnavailableHereError as e:  # fine elsewhere: describe what we can
        out["content_unavailable"] = str(e)
        return out
    out.update({
        "fun_name": exp.fun_name,
        "platforms": list(exp.platforms),
        "nr_devices": exp.nr_devices,
        "calling_convention_version": exp.calling_convention_version,
        "in_tree": describe_structure(exp.in_tree),
        "out_tree": describe_structure(exp.out_tree),
        "in_avals": describe_leaves(exp.in_avals, str),
        "out_avals": describe_leaves(exp.out_avals, str),
        "in_shardings": describe_leaves(exp.in_shardings_hlo, str),
        "out_shardings": describe_leaves(exp.out_shardings_hlo, str),
        "ordered_effects": [str(e) for e in exp.ordered_effects],
        "unordered_effects": [str(e) for e in exp.unordered_effects],
        "disabled_safety_checks": [str(c) for c in
                                   exp.disabled_safety_checks],
        "module_bytes": len(exp.mlir_module_serialized),
        "vjp_orders": _vjp_orders(exp),
    })
    return out


def _field_error(data) -> PayloadError | None:
    """What ``deserialize`` says is wrong with ``data`` whose fields match
    no serialization version's layout, if that names a field (e.g. a dtype
    no version has: the layout scan only sees that nothing matches)."""
    try:
        deserialize(data)
    except UnavailableHereError:
        return None
    except PayloadError as e:
        return e if e.path not in ("", "$") else None
    return None


def _vjp_orders(exp) -> int:
    n = 0
    while exp.has_vjp():
        exp = exp.vjp()
        n += 1
    return n


def check_jax_export(data, reader_version: int) -> tuple[bool, str]:
    """Can JAX's reader of serialization version ``reader_version`` read
    ``data`` correctly?  (ok, reason)"""
    try:  # first: is it a payload at all?
        info = inspect_jax_export(data)
    except PayloadError as e:
        return False, f"malformed payload: {e}"
    if reader_version not in versions.VERSIONS:
        return False, (f"unknown JAX serialization version {reader_version}; "
                       f"known: {list(versions.VERSIONS)}")
    try:
        lay = scan(data)
    except PayloadError as e:
        return False, f"malformed payload: {e}"
    ok, why = reader_verdict(reader_version, lay)
    all_releases = versions.info(reader_version).releases
    reading = releases_reading(reader_version, lay)
    releases = ", ".join(reading if ok else all_releases) or "no PyPI release"
    lo, hi = info["version_range"]
    written = f"payload version {lo}" + (f"..{hi}" if hi != lo else "")
    if not ok:
        return False, (f"not readable by JAX serialization version "
                       f"{reader_version} ({releases}): {why} ({written})")
    failing = [(r, reader_verdict(reader_version, lay, r)[1])
               for r in all_releases if r not in reading]
    if failing:
        but = "but not by " + ", ".join(f"{r} ({reason})"
                                        for r, reason in failing)
        why = but if why == "ok" else f"{why}; {but}"
    return True, (f"readable by JAX serialization version {reader_version} "
                  f"({releases}){'' if why == 'ok' else ': ' + why} "
                  f"({written})")
