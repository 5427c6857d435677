"""What version is a JAX export payload, and which JAX readers can read it?

JAX stores 2 or 3 in ``serialization_version`` whatever the real version, so
the version is inferred from the layout: which fields are present (see the
writer layouts in jaxcolo/export/versions.py).  Some versions write identical
bytes for some payloads (e.g. 10 and 11 differ only when a mesh has an
abstract device; 2..4 only when custom nodes or PRNG keys occur), so the
layout determines a *range* of versions.  ``serialization_version`` returns
its lower end: the oldest version whose format these bytes are in.

Only the structure is walked (no JAX objects are built), through the checked
reader, so this works for payloads whose custom types are not registered.
"""

from __future__ import annotations

import dataclasses

from jaxcolo.errors import PayloadError
from jaxcolo.export import pytrees, versions
from jaxcolo.export.decode import as_buffer
from jaxcolo.export.shardings import inferred_platform
from jaxcolo.export.layouts import AVAL as LV, CHECK as LC, DEVICE as LD, \
    EXPORTED as L, MESH as LM, NAMED as LN, SHARDING as LS, TREE as LT
from jaxcolo_jax_export_fb import DisabledSafetyCheckKind

MAX_DEPTH = pytrees.MAX_DEPTH  # as deep as the reader goes
_SHAPE_ASSERTIONS = DisabledSafetyCheckKind.shape_assertions


@dataclasses.dataclass
class Layout:
    """Evidence about the writer, gathered from one payload (vjps included)."""
    stored: set = dataclasses.field(default_factory=set)
    nr_short: bool = False
    nr_long: bool = False
    avals: bool = False              # some aval is written
    memory_space: bool = False       # the field is written at all
    nr_devices: int = 0              # the largest nr_devices written
    host_memory: bool = False        # some aval is not in device memory
    custom_nodes: bool = False
    max_dtype: int = 0
    hlo_sharded: bool = False        # a Sharding with kind/hlo proto
    named_only: bool = False         # a NamedSharding without kind/hlo
    named: bool = False
    abstract_device: bool = False
    platform: bool = False
    platform_not_inferable: bool = False  # a platform its kind does not give
    platform_missing: bool = False  # an abstract device without platform
    unique_tables: bool = False
    legacy_vectors: bool = True      # per-entry in_avals etc. are written
    jax_version: str | None = None
    shape_assertions: bool = False   # the 0.4.30 disabled check occurs


def _present(t, voff) -> bool:
    """Presence only (what the writer wrote); a field whose value counts is
    read, and its offset checked, where it is read -- as deserialize does,
    which never reads some of them (nr_devices_short beside nr_devices)."""
    return t.present(voff)


def scan(data) -> Layout:
    """Walk the payload's structure; PayloadError if it is malformed."""
    buf = as_buffer(data)
    out = Layout()
    _exported(buf, buf.root("$"), "$", out, 0)
    return out


def _exported(buf, t, path, out, depth):
    if depth > 64:
        raise PayloadError("vjp chain too long", path)
    out.stored.add(t.scalar(L.serialization_version, "u16", 0, path,
                            "serialization_version"))
    out.nr_short |= _present(t, L.nr_devices_short)
    out.nr_long |= _present(t, L.nr_devices)
    out.nr_devices = max(out.nr_devices, t.scalar(
        L.nr_devices, "u32", 0, path, "nr_devices"))
    if _present(t, L.jax_version):
        out.jax_version = t.string(L.jax_version, path, "jax_version") or ""
    if any(_present(t, getattr(L, f)) for f in (
            "unique_avals", "in_avals_idxs", "unique_named_shardings")):
        out.unique_tables = True
        for name in ("in_avals", "out_avals", "in_shardings",
                     "out_shardings"):
            if not _present(t, getattr(L, name)) and t.vector_length(
                    getattr(L, name + "_idxs"), 4, path, name + "_idxs"):
                out.legacy_vectors = False
    for name in ("in_tree", "out_tree"):
        tt = t.table(getattr(L, name), path, name)
        if tt is not None:
            try:
                _tree(buf, tt, f"{path}.{name}", out, 0)
            except RecursionError:
                raise PayloadError("pytree nesting too deep for this "
                                   "thread's stack", f"{path}.{name}") \
                    from None
    for name in ("in_avals", "out_avals", "unique_avals"):
        for i, p in enumerate(t.tables(getattr(L, name), path, name)):
            _aval(buf.table_at(p, f"{path}.{name}[{i}]"),
                  f"{path}.{name}[{i}]", out)
    for name in ("in_shardings", "out_shardings"):
        for i, p in enumerate(t.tables(getattr(L, name), path, name)):
            _sharding(buf, buf.table_at(p, f"{path}.{name}[{i}]"),
                      f"{path}.{name}[{i}]", out)
    for i, p in enumerate(t.tables(L.unique_named_shardings, path,
                                   "unique_named_shardings")):
        q = f"{path}.unique_named_shardings[{i}]"
        _named(buf, buf.table_at(p, q), q, out)
    for i, p in enumerate(t.tables(L.unique_abstract_meshes, path,
                                   "unique_abstract_meshes")):
        q = f"{path}.unique_abstract_meshes[{i}]"
        _mesh(buf.table_at(p, q), q, out)
    for i, p in enumerate(t.tables(L.disabled_checks, path,
                                   "disabled_checks")):
        q = f"{path}.disabled_checks[{i}]"
        if buf.table_at(p, q).scalar(LC.kind, "u8", 0, q, "kind") == \
                _SHAPE_ASSERTIONS:
            out.shape_assertions = True
    vjp = t.table(L.vjp, path, "vjp")
    if vjp is not None:
        _exported(buf, vjp, f"{path}.vjp", out, depth + 1)


def _tree(buf, t, path, out, depth):
    if depth > MAX_DEPTH:
        raise PayloadError("pytree nesting too deep", path)
    if t.scalar(LT.kind, "u8", 0, path, "kind") == 5:
        out.custom_nodes = True
    for i, p in enumerate(t.tables(LT.children, path, "children")):
        q = f"{path}.children[{i}]"
        _tree(buf, buf.table_at(p, q), q, out, depth + 1)


def _aval(t, path, out):
    out.avals = True
    out.max_dtype = max(out.max_dtype, t.scalar(LV.dtype, "u8", 0, path,
                                                "dtype"))
    if _present(t, LV.memory_space):
        out.memory_space = True
        if t.scalar(LV.memory_space, "u8", 0, path, "memory_space") > 1:
            out.host_memory = True


def _sharding(buf, t, path, out):
    hlo = _present(t, LS.kind) or _present(t, LS.hlo_sharding_proto)
    nt = t.table(LS.named_sharding, path, "named_sharding")
    out.hlo_sharded |= hlo
    if nt is not None:
        out.named_only |= not hlo
        _named(buf, nt, f"{path}.named_sharding", out)


def _named(buf, t, path, out):
    out.named = True
    mt = t.table(LN.mesh, path, "mesh")
    if mt is not None:
        _mesh(mt, f"{path}.mesh", out)


def _mesh(t, path, out):
    dt = t.table(LM.abstract_device, path, "abstract_device")
    if dt is not None:
        out.abstract_device = True
        if not _present(dt, LD.platform):
            out.platform_missing = True
        else:
            out.platform = True
            kind = dt.string(LD.device_kind, path + ".abstract_device",
                              "device_kind")
            stored = dt.string(LD.platform, path + ".abstract_device",
                               "platform")
            if kind is None or inferred_platform(kind) != stored:
                out.platform_not_inferable = True


# ----------------------------------------------------------- inference

def _consistent(row, lay: Layout) -> bool:
    """Could JAX's writer of ``row`` have produced a payload with ``lay``?"""
    if lay.stored - {row.stored}:
        return False
    if lay.max_dtype > row.max_dtype or (lay.custom_nodes and
                                         not row.custom_pytree):
        return False
    # Writers that write the short leave it out when it cannot hold the
    # count (jaxcolo's own version-5 writer does, above 32767 devices).
    short_fits = lay.nr_devices <= 32767
    if lay.nr_short != (row.nr_devices_short and short_fits) and \
            not row.short_optional:
        return False
    if lay.nr_long != row.nr_devices_long:
        return False
    # Without any aval there is no evidence about memory spaces.
    if lay.avals and lay.memory_space != row.memory_space:
        return False
    if (lay.hlo_sharded and not row.hlo_shardings) or \
            (lay.named_only and row.hlo_shardings) or \
            (lay.named and not row.named_shardings):
        return False
    if (lay.abstract_device and not row.abstract_device) or \
            (lay.platform and not row.device_platform):
        return False
    if lay.platform_missing and row.device_platform:  # (writers of these
        return False                                    # always write it)
    return lay.unique_tables == row.unique_tables and \
        (lay.jax_version is not None) == row.jax_version


def version_range(data) -> tuple[int, int]:
    """(oldest, newest) serialization version whose JAX writer produces this
    layout.  PayloadError if no version does (an inconsistent payload)."""
    lay = scan(data)
    fits = [row.version for row in versions.HISTORY if _consistent(row, lay)]
    if not fits:
        raise PayloadError("the payload's fields match no JAX serialization "
                           f"version's layout (stored version "
                           f"{sorted(lay.stored)})", "$")
    return fits[0], fits[-1]


def serialization_version(data) -> int:
    """The real serialization version of a JAX export payload: the oldest
    version whose format these bytes are in (see :func:`version_range`)."""
    return version_range(data)[0]


# -------------------------------------------------------------- readers

def reader_verdict(version: int, lay: Layout,
                   release: str | None = None) -> tuple[bool, str]:
    """Can JAX's reader of ``version`` (of PyPI release ``release`` of that
    version; None: its newest) read a payload with layout ``lay``
    correctly?  (ok, reason)."""
    row = versions.info(version)
    if version == 2 and lay.stored - {2}:
        return False, "readers of version 2 require stored version 2"
    if version in (3, 4) and lay.stored - {2, 3}:
        return False, "readers of versions 3-4 require stored version 2 or 3"
    if lay.custom_nodes and not row.custom_pytree:
        return False, "custom pytree nodes need a reader of version >= 3"
    if lay.max_dtype > row.max_dtype_of(release):
        return False, f"dtype enum value {lay.max_dtype} is unknown to it"
    if lay.shape_assertions and not row.shape_assertions:
        return False, ("it refuses the shape_assertions disabled check "
                       "(removed from JAX)")
    if not row.nr_devices_long and not lay.nr_short:
        return False, "it reads only nr_devices_short, which is absent"
    if lay.host_memory and not row.memory_space:
        return False, "it would drop the avals' memory spaces"
    if lay.named_only and not row.named_shardings:
        return False, ("it reads only HloShardings, which are absent: it "
                       "would treat sharded values as unsharded")
    if not lay.legacy_vectors and not row.unique_tables:
        return False, "per-entry avals/shardings are absent"
    if lay.platform_not_inferable and not row.device_platform:
        return False, ("it infers device platforms from device kinds, and "
                       "an abstract device's platform differs from that")
    notes = []
    if lay.abstract_device and not row.abstract_device:
        notes.append("ignores abstract devices")
    if lay.platform and not row.device_platform:
        notes.append("infers device platforms from device kinds")
    return True, "; ".join(notes) or "ok"


def readable_by(data) -> list[dict]:
    """For each serialization version: can its JAX readers read ``data``?
    ``ok``/``reason``: the version's reader (its newest release);
    ``releases``: its PyPI releases that read it; ``releases_failing``:
    release -> reason for those that do not."""
    lay = scan(data)
    out = []
    for row in versions.HISTORY:
        ok, reason = reader_verdict(row.version, lay)
        failing = {}
        for r in row.releases:
            r_ok, why = reader_verdict(row.version, lay, r)
            if not r_ok:
                failing[r] = why
        out.append({"version": row.version,
                     "releases": [r for r in row.releases if r not in failing],
                     "ok": ok, "reason": reason,
                     "releases_failing": failing})
    return out


def releases_reading(version: int, lay: Layout) -> list[str]:
    """The PyPI releases of serialization version ``version`` that read a
    payload with layout ``lay`` correctly."""
    return [r for r in versions.info(version).releases
            if reader_verdict(version, lay, r)[0]]
