"""The SpecTree root: ``serialize``/``deserialize`` of any container nesting
over spec objects.

Encoding interns every leaf into the unique tables (phase 1), then builds the
tables bottom-up and the root last (phase 2).  Decoding reads the structure,
then each leaf from its table, decoding each unique entry once.
"""

from __future__ import annotations

import numpy as np
from jax._src import tree_util as jtu

import jaxcolo_fb as fb
from jaxcolo_fb import LeafKind
from jaxcolo_fb import RootKind
from jaxcolo import envelope, versions
from jaxcolo.codec import core, memo, names
from jaxcolo.codec.effects import PRNGImpl, decode_prng_impl
from jaxcolo.codec.mesh import make_resolver
from jaxcolo.codec.node_data import FOUND_BY_NAME
from jaxcolo.codec.pytree import SPEC_LEAF_TYPES, SpecLeafAsNode, build_treedef, \
    copy_budget, decode_treedef, flatten_treedef, require_features, \
    treedef_key
from jaxcolo.errors import EncodeError, PayloadError
from jaxcolo.fastbuilder import FastBuilder, offset_vector, string_vector
from jaxcolo.wire import Buffer, layout, parse_budget

L = layout(fb, "SpecTree")
_ADDERS = {name: getattr(fb, "SpecTreeAdd" + "".join(
    p.capitalize() for p in name.split("_"))) for name in vars(L)}
_SCALAR_VECTORS = ("devices", "prng_impls")
# The flatbuffer builder class: FastBuilder writes the same bytes as
# flatbuffers.Builder (checked by tests) several times faster.
BUILDER = FastBuilder


def _is_prng_impl(x) -> bool:
    return isinstance(x, PRNGImpl)


SPEC_LEAF_TYPES.add(PRNGImpl)


def _flatten(obj):
    """(leaves, treedef, its FlatTree, its treedef_key)."""
    try:
        leaves, treedef = jtu.tree_flatten(obj)
    except ValueError as e:  # JAX sorts a dict's keys while flattening
        if "sorting pytree dictionary keys" not in str(e):
            raise
        raise EncodeError("dict keys must all be str or all be int (JAX "
                          "cannot sort these keys to flatten the dict)",
                          _unsortable_dict_path(obj)) from None
    except (RecursionError, SystemError) as e:  # (SystemError: JAX's C++
        if isinstance(e, SystemError) and not isinstance(  # wrapping one)
                e.__cause__ or e.__context__, RecursionError):
            raise
        raise EncodeError("the tree nests too deep to flatten, or contains "
                          "itself", "$") from None
    key = treedef_key(treedef)
    try:
        flat = flatten_treedef(treedef, key=key)
    except SpecLeafAsNode:
        # PRNGImpl is a NamedTuple pytree node; as a spec it is a leaf.
        leaves, treedef = jtu.tree_flatten(obj, is_leaf=_is_prng_impl)
        key = treedef_key(treedef)
        flat = flatten_treedef(treedef, key=key)
    return leaves, treedef, flat, key


def _unsortable_dict_path(obj, limit: int = 100_000) -> str:
    """The path of the first dict in ``obj`` (through dicts, lists and
    tuples) whose keys do not sort, else "$"."""
    stack = [(obj, "$")]
    while stack and limit > 0:
        limit -= 1
        x, path = stack.pop()
        if isinstance(x, dict):
            try:
                sorted(x)
            except TypeError:
                return path
            stack.extend((v, f"{path}[{k!r}]") for k, v in
                         reversed(list(x.items())))
        elif isinstance(x, (list, tuple)):
            stack.extend((v, f"{path}[{i}]") for i, v in
                         reversed(list(enumerate(x))))
    return "$"


def _leaf_path(obj, i: int) -> str:
    try:
        paths = [p for p, _ in jtu.tree_flatten_with_path(
            obj, is_leaf=_is_prng_impl)[0]]
        return "$" + jtu.keystr(paths[i])
    except Exception:
        return f"$<leaf {i}>"


def intern_leaves(writer: core.Writer, obj, leaves):
    """Phase 1: (leaf kinds, leaf refs) of the flattened ``obj``.

    Leaves whose codec has a ``key`` are interned once per distinct key;
    repeats (the common case: many arrays with one sharding, shape and
    dtype) only hash their key.
    """
    if leaves:
        fast = _intern_uniform_leaves(writer, obj, leaves)
        if fast is not None:
            return fast
    kinds = bytearray()
    refs = []
    seen: dict = {}
    leaf_codec = core.leaf_codec
    by_type = core.LEAF_TYPES
    for i, leaf in enumerate(leaves):
        codec = by_type.get(type(leaf)) or leaf_codec(leaf)
        k = None
        if codec is not None and codec.key is not None:
            try:
                k = codec.key(leaf)
                ref = seen.get(k)
            except TypeError:  # unhashable parts: intern it the long way
                k = ref = None
            if ref is not None:
                kinds.append(codec.kind)
                refs.append(ref)
                continue
        try:
            if codec is None:
                raise EncodeError(
                    f"unsupported leaf of type {type(leaf).__module__}."
                    f"{type(leaf).__qualname__}", "")
            ref = codec.intern(writer, leaf, "")
        except EncodeError as e:
            raise EncodeError(e.reason, _leaf_path(obj, i) + e.path) from None
        kinds.append(codec.kind)
        refs.append(ref)
        if k is not None:
            seen[k] = ref
    return kinds, np.array(refs, np.uint32)


def _intern_uniform_leaves(writer, obj, leaves):
    """intern_leaves for leaves of one keyed type, in C-level passes (same
    entries in the same order as the general loop); None if not applicable."""
    types = set(map(type, leaves))
    if len(types) != 1:
        return None
    codec = core.LEAF_TYPES.get(types.pop())
    if codec is None or codec.key is None:
        return None
    n = len(leaves)
    first_of_key: dict = {}
    try:  # each leaf -> index of the first leaf with an equal key (one hash)
        firsts = np.fromiter(map(first_of_key.setdefault,
                                 map(codec.key, leaves), range(n)),
                             np.intp, n)
    except TypeError:
        return None
    ref_at = np.zeros(n, np.uint32)
    for i in first_of_key.values():  # distinct leaves, first-seen order
        try:
            ref_at[i] = codec.intern(writer, leaves[i], "")
        except EncodeError as e:
            raise EncodeError(e.reason, _leaf_path(obj, i) + e.path) from None
    return bytearray((codec.kind,)) * n, ref_at[firsts]


def build_tables(writer: core.Writer, builder) -> dict:
    """Phase 2a: every non-empty unique table as a vector offset."""
    offsets = {}
    for name, codec in core.TABLES.items():
        if codec.build is None or name in _SCALAR_VECTORS:
            continue
        items = writer.items(codec.field)
        if not items:
            continue
        path = f"$.{codec.field}"
        if codec.open is not None:  # columnar: one table for all items
            try:
                offsets[codec.field] = codec.build(writer, builder, items)
            except EncodeError as e:  # a string UTF-8 cannot hold
                raise e.under(path) from None
            continue
        offs = []
        for i, it in enumerate(items):
            try:
                offs.append(codec.build(writer, builder, it))
            except EncodeError as e:
                raise e.under(f"{path}[{i}]") from None
        offsets[codec.field] = offset_vector(builder, offs)
    devices = writer.items("devices")
    if devices:
        offsets["devices"] = builder.CreateNumpyVector(
            np.asarray(devices, np.uint32))
    impls = writer.items("prng_impls")
    if impls:
        try:
            offsets["prng_impls"] = string_vector(builder, impls)
        except EncodeError as e:
            raise e.under("$.prng_impls") from None
    return offsets


def _seal_within_parse_budget(writer, body, version, compress) -> bytes:
    """The payload of ``body``; EncodeError when a reader would refuse its
    symbolic text as out of proportion to its size (many distinct costly
    expressions).  Deflated, a body's budget follows its stored size too:
    where that refuses it, it is stored plain."""
    cost = sum(writer.parsed.values())
    data = envelope.seal(body, RootKind.spec_tree, version,
                         writer.min_reader, compress)
    stored = len(data) - envelope.HEADER_SIZE
    if cost > parse_budget(len(body), stored) and stored < len(body):
        data = envelope.seal(body, RootKind.spec_tree, version,
                             writer.min_reader, False)
    if cost > parse_budget(len(body)):
        raise EncodeError(
            f"the symbolic dimensions cost {cost} parse units, more than a "
            f"reader allows a {len(body)}-byte payload "
            f"({parse_budget(len(body))}): use fewer distinct nested "
            "max/min expressions or long products", "$")
    return data


def _check_copy_budget(writer, flat, size: int) -> None:
    """EncodeError when a reader would refuse to rebuild the payload's trees
    (the structure and PyTreeDef leaves) as too costly for its size."""
    treedefs = writer.uniques.get("treedefs")
    copies = flat.copies + (sum(f.copies for f in treedefs.items)
                            if treedefs is not None else 0)
    if copies > copy_budget(size):
        raise EncodeError(
            f"rebuilding the pytrees takes {copies} node copies, more than "
            f"a reader allows a {size}-byte payload ({copy_budget(size)}): "
            "nest fewer levels around wide nodes", "$")


def encode_spec_tree(obj, version: int | None = None,
                     compress: bool = True) -> bytes:
    version = versions.check_writable(version)
    leaves, treedef, flat, td_key = _flatten(obj)
    try:
        key = None if td_key is None else \
            memo.encode_key((version, compress), td_key, leaves)
        hit = memo.lookup_encoded(key, leaves)
    except Exception:  # noqa: BLE001 - unhashable node data: not memoized
        key = hit = None
    if hit is not None:
        return hit
    writer = core.Writer(version)
    writer.require("spec_tree")
    require_features(writer, flat, "$.structure")
    kinds, refs = intern_leaves(writer, obj, leaves)
    builder = BUILDER(256 + 16 * len(kinds))
    offsets = build_tables(writer, builder)
    try:
        offsets["structure"] = build_treedef(builder, flat)
    except EncodeError as e:  # a dict key or name UTF-8 cannot hold
        raise e.under("$.structure") from None
    offsets["leaf_kinds"] = builder.CreateByteVector(bytes(kinds))
    offsets["leaf_refs"] = builder.CreateNumpyVector(refs)
    fb.SpecTreeStart(builder)
    for name, off in offsets.items():
        _ADDERS[name](builder, off)
    builder.Finish(fb.SpecTreeEnd(builder))
    body = builder.Output()
    if flat.copies > 1 << 19 or "treedefs" in writer.uniques:
        _check_copy_budget(writer, flat, len(body))
    if writer.parsed:
        data = _seal_within_parse_budget(writer, body, version, compress)
    else:
        data = envelope.seal(body, RootKind.spec_tree, version,
                             writer.min_reader, compress)
    if writer.items("scopes"):  # each encode notes its scopes (scopes.py)
        key = None
    memo.remember_encoded(key, leaves, data, len(body))
    return data


class _ScalarLeaves:
    """Leaves stored in plain vectors (device ids, PRNG impl names)."""

    def __init__(self, reader):
        self.reader = reader
        self.devices = None
        self.impls = None

    def device(self, ref, path):
        if self.devices is None:
            self.devices = self.reader.root.ints(L.devices, "u32", "$",
                                                 "devices")
        if ref >= len(self.devices):
            raise PayloadError(f"reference {ref} out of range: devices has "
                               f"{len(self.devices)} entries", path)
        return self.reader.resolver.device(self.devices[ref],
                                           f"$.devices[{ref}]")

    def prng_impl(self, ref, path):
        if self.impls is None:
            self.impls = self.reader.root.strings(L.prng_impls, "$",
                                                  "prng_impls")
        if ref >= len(self.impls):
            raise PayloadError(f"reference {ref} out of range: prng_impls has "
                               f"{len(self.impls)} entries", path)
        return decode_prng_impl(self.impls[ref], f"$.prng_impls[{ref}]")


def open_spec_tree(data, reader_version=None, header=None):
    """Check the envelope (unless the caller passes the ``header`` it has
    already read and checked); return the body Buffer and its root Table."""
    if header is None:
        header = envelope.read_header(data)
        envelope.check_readable(header, reader_version)
    if header.root_kind != RootKind.spec_tree:
        raise PayloadError(
            f"root kind {header.root_kind} is not a spec tree",
            "$.header.root_kind")
    buf = Buffer(envelope.open_body(data, header),
                 len(data) - envelope.HEADER_SIZE)
    return header, buf, buf.root("$")


@envelope.shares_inflation
def decode_spec_tree(data, device_resolver=None, header=None):
    """The object of spec-tree payload ``data``; ``header``: its envelope
    header, already read and checked by the caller."""
    generation = names.registry_generation()
    if device_resolver is None:
        hit = memo.lookup_decoded(data)
        if hit is not None and hit[2] == generation and (
                not hit[3] or names.still_found(hit[3])):
            return hit[0].unflatten(hit[1])
    header, buf, root = open_spec_tree(data, header=header)
    reader = core.Reader(buf, root, L, make_resolver(device_resolver),
                         declared_min_reader=header.min_reader_version)
    foreign = names.foreign_lookups()
    structure, leaves = decode_leaves(reader)
    obj = _unflatten(structure, leaves)
    if device_resolver is None and names.foreign_lookups() == foreign and \
            not root.vector_length(L.scopes, 4, "$", "scopes"):
        # valid while the registries and the names it found stay the same
        memo.remember_decoded(data, buf.size, (
            structure, leaves, generation,
            tuple(buf.memo.get(FOUND_BY_NAME, ()))))
    return obj


def decode_root(reader: core.Reader):
    """The object of an opened spec tree."""
    return _unflatten(*decode_leaves(reader))


def _unflatten(structure, leaves):
    try:
        return structure.unflatten(leaves)
    except Exception as e:  # a registered node's unflatten rejected leaves
        raise PayloadError(f"cannot rebuild the tree: {e!r}",
                           "$.structure") from None


def leaf_views(reader: core.Reader) -> dict:
    """(field, index) -> the tables the leaves read that entry through
    (``core.Reader.walk_available``'s ``views``)."""
    root = reader.root
    kinds = root.bytes(L.leaf_kinds, "$", "leaf_kinds") or b""
    refs = root.ints(L.leaf_refs, "u32", "$", "leaf_refs")
    if len(kinds) != len(refs):
        raise PayloadError(f"{len(kinds)} leaf_kinds but {len(refs)} "
                           "leaf_refs", "$.leaf_kinds")
    views: dict = {}
    for i, (kind, ref) in enumerate(zip(kinds, refs)):
        table = core.KIND_TABLE.get(kind)
        if table is None:
            raise PayloadError(f"unknown LeafKind value {kind}",
                               f"$.leaf_kinds[{i}]")
        codec = core.TABLES.get(table)
        if codec is None:  # (devices, PRNG impls: checked where read)
            continue
        n = reader.count(table)
        if not 0 <= ref < n:
            raise PayloadError(f"reference {ref} out of range: {table} has "
                               f"{n} entries", f"$.leaf_refs[{i}]")
        views.setdefault((codec.field, int(ref)), set()).add(table)
    return views


def decode_leaves(reader: core.Reader):
    """(PyTreeDef, leaves) of an opened spec tree."""
    root = reader.root
    st = root.table(L.structure, "$", "structure")
    if st is None:
        raise PayloadError("structure missing", "$.structure")
    structure = decode_treedef(st, "$.structure")
    kinds = root.bytes(L.leaf_kinds, "$", "leaf_kinds") or b""
    refs = root.ints(L.leaf_refs, "u32", "$", "leaf_refs")
    n = structure.num_leaves
    if len(kinds) != n or len(refs) != n:
        raise PayloadError(
            f"structure has {n} leaves but leaf_kinds/leaf_refs have "
            f"{len(kinds)}/{len(refs)}", "$.leaf_kinds")
    leaves = [None] * n
    table_of = core.KIND_TABLE
    get = reader.get
    scalars = None
    for i in range(n):
        kind = kinds[i]
        table = table_of.get(kind)
        if table is None:
            raise PayloadError(f"unknown LeafKind value {kind}",
                               f"$.leaf_kinds[{i}]")
        if kind == LeafKind.device or kind == LeafKind.prng_impl:
            scalars = scalars or _ScalarLeaves(reader)
            fn = scalars.device if kind == LeafKind.device else \
                scalars.prng_impl
            leaves[i] = fn(refs[i], f"$.leaf_refs[{i}]")
        else:
            leaves[i] = get(table, refs[i], f"$.leaf_refs[{i}]")
    return structure, leaves
