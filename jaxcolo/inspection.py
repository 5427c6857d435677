"""``jaxcolo.inspect``: a JSON-serialisable description of any payload.

Describes the envelope (versions, root kind, size, checksum) and the content:
table sizes, the tree structure and each leaf.  Device ids are shown as they
are in the payload; leaves that need devices this process lacks are reported
by their raw fields instead of failing.
"""

from __future__ import annotations

from jaxcolo import envelope, versions
from jaxcolo.codec import core
from jaxcolo.codec import spec_tree
from jaxcolo.codec.mesh import Resolver
from jaxcolo.errors import PayloadError

INSPECTORS: dict = {}  # root kind -> fn(data, header) -> dict of content


def register_inspector(kind: int, fn) -> None:
    INSPECTORS[kind] = fn


def _payload_kind_name(kind: int) -> str:
    from jaxcolo.payload import ROOT_KIND_NAMES
    return ROOT_KIND_NAMES.get(kind, f"unknown({kind})")


def readable_by(header) -> list[int]:
    """Known reader versions that can read a payload with this header."""
    return [v for v in versions.known_versions()
            if header.min_reader_version <= v
            and header.writer_version >= versions.version_info(v).min_readable]


def inspect(data) -> dict:
    """Describe any jaxcolo payload.  Raises PayloadError for bad bytes."""
    header = envelope.read_header(data)
    out = {
        "format": "jaxcolo",
        "root_kind": _payload_kind_name(header.root_kind),
        "writer_version": header.writer_version,
        "min_reader_version": header.min_reader_version,
        "readable_by_versions": readable_by(header),
        "size": len(data),
        "crc32": f"{header.crc32:08x}",
    }
    fn = INSPECTORS.get(header.root_kind)
    if fn is not None:
        out.update(fn(data, header))
    return out


def inspect_spec_tree(data, header) -> dict:
    _, buf, root = spec_tree.open_spec_tree(data, header.min_reader_version)
    reader = core.Reader(buf, root, spec_tree.L, Resolver(_raw_device_lookup,
                                                          False))
    tables = {}
    for name, codec in core.TABLES.items():
        if codec.field == name:
            n = root.vector_length(getattr(spec_tree.L, name), 4, "$", name)
            if n:
                tables[name] = n
    out = {"tables": tables}
    try:
        obj = spec_tree.decode_root(reader)
        from jax._src import tree_util as jtu
        leaves, treedef = jtu.tree_flatten(obj, is_leaf=spec_tree._is_prng_impl)
        out["structure"] = str(treedef)
        out["num_leaves"] = len(leaves)
        out["leaves"] = [repr(x) for x in leaves[:256]]
    except PayloadError as e:
        if "device" not in e.reason:
            raise
        # Payload refers to devices this process does not have: raw view.
        out["num_leaves"] = len(root.bytes(spec_tree.L.leaf_kinds, "$",
                                           "leaf_kinds") or b"")
        out["devices_unavailable"] = e.reason
    return out


def _raw_device_lookup(i):
    from jaxcolo.codec.mesh import default_device_map
    return default_device_map().get(i)


from jaxcolo_fb import RootKind  # noqa: E402

register_inspector(RootKind.spec_tree, inspect_spec_tree)
