"""``jaxcolo.inspect``: a JSON-serialisable description of any payload.

Describes the envelope (versions, root kind, size, checksum) and the content:
table sizes, the tree structure and each leaf.  A payload naming devices this
process lacks is still described (header, tables, leaf count) with the reason
its leaves could not be shown.
"""

from __future__ import annotations

from jax.tree_util import PyTreeDef

from jaxcolo import envelope, versions
from jaxcolo.codec import core
from jaxcolo.codec import spec_tree
from jaxcolo.codec.mesh import make_resolver
from jaxcolo.errors import PayloadError, UnavailableHereError, \
    UnknownDeviceError, reports_malformed

INSPECTORS: dict = {}  # root kind -> fn(data, header) -> dict of content


def register_inspector(kind: int, fn) -> None:
    INSPECTORS[kind] = fn


def _payload_kind_name(kind: int) -> str:
    from jaxcolo.payload import ROOT_KIND_NAMES
    return ROOT_KIND_NAMES.get(kind, f"unknown({kind})")


def readable_by(header, used=()) -> list[int]:
    """Known reader versions that can read a payload with this header whose
    content uses the LENIENT features ``used`` (``versions.noting_used``:
    earlier writers stamped them readable by readers that refuse them)."""
    needed = max((versions.FEATURE_SINCE[f] for f in used), default=1)
    out = []
    for v in versions.known_versions():
        try:
            envelope.check_readable(header, v)
        except PayloadError:
            continue
        if v >= needed:
            out.append(v)
    return out


def _envelope_fields(data, header) -> dict:
    return {
        "format": "jaxcolo",
        "root_kind": _payload_kind_name(header.root_kind),
        "writer_version": header.writer_version,
        "min_reader_version": header.min_reader_version,
        "readable_by_versions": None,  # after the content
        "size": len(data),
        "crc32": f"{header.crc32:08x}",
    }


@reports_malformed
@envelope.shares_inflation
def inspect(data) -> dict:
    """Describe any jaxcolo payload, or a JAX export payload (recognised by
    the absence of jaxcolo's magic).  Raises PayloadError for bad bytes.
    ``readable_by_versions`` is what ``jaxcolo check`` answers for each
    known reader version."""
    if isinstance(data, (bytes, bytearray, memoryview)) and \
            not envelope.is_envelope(data):
        from jaxcolo.export.inspection import inspect_jax_export
        return inspect_jax_export(data)
    header = envelope.read_header(data)
    envelope.check_consistent(header)
    out = _envelope_fields(data, header)
    from jaxcolo.payload import load_root
    load_root(header.root_kind)
    fn = INSPECTORS.get(header.root_kind)
    with versions.noting_used() as used:
        if header.min_reader_version > versions.SCHEMA_VERSION:
            # Content a newer writer says only newer readers understand:
            # the header is all this reader can vouch for.
            out["content_unavailable"] = (
                f"needs a reader of version >= {header.min_reader_version}")
        elif fn is None:
            raise PayloadError(f"unknown root kind {header.root_kind}",
                               "$.header.root_kind")
        else:
            out.update(fn(data, header))
    out["readable_by_versions"] = readable_by(header, used)
    return out


def inspect_nested_spec_tree(data) -> tuple[dict, object]:
    """``inspect`` of a spec-tree payload nested in another (a bundle's
    specs, a program's in/out specs) and its tree (UNAVAILABLE if this
    process lacks its devices or registrations), refusing what decoders
    refuse there: any other root kind included.  Paths are relative to the
    nested payload."""
    header = envelope.read_header(data)
    out = _envelope_fields(data, header)
    with versions.noting_used() as used:
        content, tree = describe_spec_tree(data, header)
    out.update(content)
    out["readable_by_versions"] = readable_by(header, used)
    return out, tree


MAX_NODES_SHOWN = 1024   # a larger structure is summarised, not printed
MAX_REPR = 2000          # characters of one leaf's repr
MAX_LEAVES_SHOWN = 256


def describe_structure(treedef, limit: int = 64 * MAX_REPR) -> str:
    """``str(treedef)``, clipped to ``limit`` characters; summarised
    instead when it has more than MAX_NODES_SHOWN nodes or its text would
    be longer than ``limit`` (nodes sharing their node data, e.g. one dict's
    long keys, would make the text far larger than the payload, so its size
    is bounded before it is made)."""
    if treedef.num_nodes > MAX_NODES_SHOWN:
        return (f"PyTreeDef of {treedef.num_nodes} nodes and "
                f"{treedef.num_leaves} leaves (not printed: over "
                f"{MAX_NODES_SHOWN} nodes)")
    try:
        if _printed_size(treedef, limit) > limit:
            return (f"PyTreeDef of {treedef.num_nodes} nodes and "
                    f"{treedef.num_leaves} leaves (not printed: over {limit} "
                    "characters)")
        return clip(str(treedef), limit)
    except Exception as e:  # noqa: BLE001 - an auxdata's own __repr__
        return (f"PyTreeDef of {treedef.num_nodes} nodes and "
                f"{treedef.num_leaves} leaves (not printed: "
                f"{type(e).__name__} in a node's repr)")


def _printed_size(treedef, limit: int) -> int:
    """At least the length of ``str(treedef)`` (a bound: each node's type
    name, its node data's text and punctuation), or some number over
    ``limit`` once that is certain.  Each distinct node data object, and
    each distinct item of a list or tuple of them (a dict's keys), is
    formatted once."""
    lengths: dict[int, int] = {}

    def length(x, show=str) -> int:  # (JAX prints node data with str:
        n = lengths.get(id(x))         # a list's or tuple's items by repr)
        if n is None:
            if type(x) in (list, tuple):
                n = 2 + sum(2 + length(item, repr) for item in x)
            else:
                n = len(show(x))
            lengths[id(x)] = n
        return n

    total = 0
    stack = [treedef]
    while stack:
        node = stack.pop()
        data = node.node_data()
        total += 8
        if data is not None:
            kind, aux = data
            total += 16 + len(getattr(kind, "__qualname__", "")) + \
                length(aux)
        if total > limit:
            return total
        stack.extend(node.children())
    return total


def describe_leaves(leaves, show=repr) -> list[str]:
    """``show`` (repr) of the first MAX_LEAVES_SHOWN leaves, each clipped,
    each distinct object formatted once (leaves share specs); PyTreeDef
    leaves as :func:`describe_structure` shows them."""
    seen: dict[int, str] = {}
    out = []
    for x in leaves[:MAX_LEAVES_SHOWN]:
        text = seen.get(id(x))
        if text is None:
            text = seen[id(x)] = (
                describe_structure(x, MAX_REPR)
                if isinstance(x, PyTreeDef) else clip(show(x), MAX_REPR))
        out.append(text)
    return out


def clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


# describe_spec_tree's tree when this process cannot decode it
UNAVAILABLE = object()


def inspect_spec_tree(data, header) -> dict:
    return describe_spec_tree(data, header)[0]


def describe_spec_tree(data, header) -> tuple[dict, object]:
    """(inspect content of a spec-tree payload, its tree or UNAVAILABLE)."""
    _, buf, root = spec_tree.open_spec_tree(data)
    reader = core.Reader(buf, root, spec_tree.L, make_resolver(None),
                         declared_min_reader=header.min_reader_version)
    tables = {}
    for name, codec in core.TABLES.items():
        if codec.field in tables:
            continue
        if codec.open is not None:  # columnar
            n = reader.count(name)
        else:
            n = root.vector_length(getattr(spec_tree.L, codec.field), 4, "$",
                                   codec.field)
        if n:
            tables[codec.field] = n
    out = {"tables": tables}
    obj = UNAVAILABLE
    try:
        obj = spec_tree.decode_root(reader)
        from jax._src import tree_util as jtu
        leaves, treedef = jtu.tree_flatten(obj, is_leaf=spec_tree._is_prng_impl)
        out["structure"] = describe_structure(treedef)
        out["num_leaves"] = len(leaves)
        out["leaves"] = describe_leaves(leaves)
    except UnavailableHereError as e:
        # Devices or registrations this process lacks (the payload may read
        # fine elsewhere): the raw view, and why there is no more.
        out["num_leaves"] = len(root.bytes(spec_tree.L.leaf_kinds, "$",
                                           "leaf_kinds") or b"")
        key = ("devices_unavailable" if isinstance(e, UnknownDeviceError)
               else "content_unavailable")
        out[key] = str(e)
        # (features used past it: readable_by)
        reader.walk_available(spec_tree.leaf_views(reader))
    return out, obj


from jaxcolo_fb import RootKind  # noqa: E402

register_inspector(RootKind.spec_tree, inspect_spec_tree)

