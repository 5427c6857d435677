"""PyTreeDefs in flat preorder form.

Built-in nodes (None, tuple, list, dict, namedtuple, OrderedDict, defaultdict)
are encoded natively.  Other node types go through one registry: the one users
already fill with ``jax.export.register_pytree_node_serialization`` /
``register_namedtuple_serialization``.  A namedtuple class registered as a
custom pytree node is a custom node (JAX flattens it with its own flatten).
Decoding never imports a module: an unregistered namedtuple is resolved only
among modules already imported.
"""

from __future__ import annotations

import collections

import numpy as np
from jax._src import tree_util as jtu
from jax._src.export import _export as jexport

import jaxcolo_fb as fb
from jaxcolo_fb import KeyKind
from jaxcolo_fb import LeafKind
from jaxcolo_fb import NodeKind
from jaxcolo import versions
from jaxcolo.codec.core import register_leaf, register_table
from jaxcolo.codec.names import custom_namedtuple_error, factory_name, \
    found_by_name, is_namedtuple, plain_namedtuple, qualified, \
    registry_generation, still_found
from jaxcolo.codec.node_data import REBUILT, check_auxdata_reads_back, \
    node_spec, rebuild_custom, type_name
from jaxcolo.errors import EncodeError, PayloadError
from jaxcolo.fastbuilder import offset_vector, string_vector
from jaxcolo.wire import layout

L = layout(fb, "PyTreeDef")
LD = layout(fb, "NodeData")

PyTreeDef = jtu.PyTreeDef
_LEAF = jtu.tree_structure(0)
_NONE = jtu.tree_structure(None)
_REGISTRY = jtu.default_registry
_make = PyTreeDef.from_node_data_and_children
MAX_DEPTH = 256  # nesting deeper than this is rejected as absurd
# Rebuilding a PyTreeDef bottom-up copies each node once per ancestor (JAX's
# from_node_data_and_children copies its children), so a deep chain around
# a wide node costs nodes x depth.  A body of ``size`` bytes may make at
# most copy_budget(size) such copies (~35 ns each), summed over its trees;
# the writer refuses a payload over it.
COPY_RATIO = 32
COPY_FLOOR = 1 << 20


def copy_budget(size: int) -> int:
    """Node copies a reader allows rebuilding the trees of a body of
    ``size`` bytes."""
    return COPY_RATIO * size + COPY_FLOOR


# jaxlib's from_node_data_and_children makes any node of a namedtuple type a
# namedtuple node, even when the type is registered as a custom node: those
# are assembled from PyTreeDef's pickle state (the children's nodes in
# postorder, then the node), costing about STATE_COST copies per node below
# (charged by writer and reader alike).
STATE_COST = 16
_CUSTOM_KIND = jtu.tree_structure(
    collections.OrderedDict(a=0)).__getstate__()[1][-1][0]


def _make_custom_node(registry, node_data, children):
    """from_node_data_and_children for a custom node of a namedtuple type."""
    t, aux = node_data
    nodes, leaves = [], 0
    for c in children:
        nodes += c.__getstate__()[1]
        leaves += c.num_leaves
    nodes.append((_CUSTOM_KIND, len(children), aux, t, leaves,
                  len(nodes) + 1))
    td = PyTreeDef.__new__(PyTreeDef)
    td.__setstate__((registry, nodes))
    return td


_NODE_KIND_MAX = NodeKind.custom
_WITH_DATA = frozenset((NodeKind.dict, NodeKind.namedtuple,
                        NodeKind.ordered_dict, NodeKind.default_dict,
                        NodeKind.custom))


# ------------------------------------------------------------------ encode

class FlatTree:
    """A PyTreeDef flattened to the wire's preorder arrays."""

    __slots__ = ("kinds", "arities", "node_data", "copies", "features",
                 "by_name")

    def __init__(self):
        self.kinds = bytearray()
        self.arities: list[int] = []
        self.node_data: list[tuple] = []
        self.copies = 0  # node copies a reader makes rebuilding it
        self.features: set = set()  # versions.py features it needs
        self.by_name: list = []  # (type, name) of namedtuples named as such


def require_features(writer, flat: FlatTree, path: str) -> None:
    """Note in ``writer`` the schema features tree ``flat`` needs."""
    for feature in flat.features:
        writer.require(feature, path)


def _keys(keys, where):
    """(KeyKind, keys) of a dict node at ``where`` (see ``_path``)."""
    if all(type(k) is str for k in keys):
        _check_utf8(keys, "dict key", lambda k: (where, k))
        return KeyKind.str if keys else KeyKind.none, list(keys)
    if all(type(k) is int for k in keys):
        if not all(-2**63 <= k < 2**63 for k in keys):
            raise EncodeError("int dict keys must fit in int64", _path(where))
        return KeyKind.int, list(keys)
    raise EncodeError(
        f"dict keys must all be str or all be int to serialize, got "
        f"{[type(k).__name__ for k in keys]}", _path(where))


def _check_utf8(texts, what: str, where_of) -> None:
    """EncodeError naming the tree path (``where_of(text)``) of the first
    of ``texts`` that UTF-8 cannot hold (a lone surrogate), rather than
    the payload field it would have gone to."""
    try:
        "".join(texts).encode("utf-8")
    except UnicodeEncodeError:
        for t in texts:
            try:
                t.encode("utf-8")
            except UnicodeEncodeError as e:
                raise EncodeError(
                    f"{what} {t!r:.80} cannot be written as UTF-8 "
                    f"({e.reason})", _path(where_of(t))) from None


class SpecLeafAsNode(EncodeError):
    """A type that jax treats as a pytree node but jaxcolo as a spec leaf."""


# Pytree node types that are spec objects in their own right (PRNGImpl).
SPEC_LEAF_TYPES: set = set()


class _Field(str):
    """A namedtuple field name as a path step (``.name``, as JAX's keystr
    writes it; other steps are ``[key]``)."""


def _path(where) -> str:
    """The path text of ``where``: a root path, or (parent, child step)."""
    steps = []
    while type(where) is tuple:
        where, step = where
        steps.append(f".{step}" if type(step) is _Field else f"[{step!r}]")
    return where + "".join(reversed(steps))


def _flatten_node(td, out: FlatTree, where, depth: int = 0) -> None:
    """Append ``td``'s preorder arrays to ``out``.  ``where``: its path,
    formatted by ``_path`` only for an error."""
    if depth > MAX_DEPTH:
        raise EncodeError(f"pytree nesting deeper than {MAX_DEPTH}",
                          _path(where))
    out.copies += depth  # copied once into each ancestor
    nd = td.node_data()
    if nd is None:
        out.kinds.append(NodeKind.leaf)
        return
    t, aux = nd
    if t in SPEC_LEAF_TYPES:
        raise SpecLeafAsNode(f"{t.__name__} is a spec leaf", _path(where))
    children = td.children()
    if t is type(None):
        out.kinds.append(NodeKind.none)
        return
    if t is tuple:
        out.kinds.append(NodeKind.tuple)
    elif t is list:
        out.kinds.append(NodeKind.list)
    elif t is dict:
        out.kinds.append(NodeKind.dict)
        out.node_data.append(("keys", *_keys(aux, where)))
    elif t is collections.OrderedDict:
        out.kinds.append(NodeKind.ordered_dict)
        out.node_data.append(("keys", *_keys(aux, where)))
    elif t is collections.defaultdict:
        factory, keys = aux
        out.kinds.append(NodeKind.default_dict)
        out.node_data.append(("defaultdict", *_keys(keys, where),
                              _factory_name(factory, where)))
    elif plain_namedtuple(t):
        reg = jexport.serialization_registry.get(t)
        name = reg[0] if reg is not None else qualified(t)
        _check_utf8((name,), f"serialized_name of {t.__name__}",
                    lambda _: where)
        if reg is None and not found_by_name(t, name):
            raise EncodeError(
                f"namedtuple {name} is not what that name refers to in its "
                "module (defined inside a function, or shadowed), so no "
                "reader can find it by name: register it with "
                "jax.export.register_namedtuple_serialization", _path(where))
        if reg is None:
            other = jexport.deserialization_registry.get(name)
            if other is not None:  # readers look that registry up first
                raise EncodeError(
                    f"namedtuple {name} is not registered, but that name is "
                    f"registered for serialization by {other[0]!r}, which "
                    "readers would make of it: register it with "
                    "jax.export.register_namedtuple_serialization under "
                    "another name", _path(where))
            out.by_name.append((t, name))
        out.kinds.append(NodeKind.namedtuple)
        out.node_data.append(("namedtuple", name, list(t._fields)))
    elif is_namedtuple(t) and (
            err := custom_namedtuple_error(t, _path(where))):
        raise err  # a custom node (not a namedtuple node) we cannot write
    elif t in jexport.serialization_registry:
        name, ser = jexport.serialization_registry[t]
        _check_utf8((name,), f"serialized_name of {t.__name__}",
                    lambda _: where)
        try:
            blob = ser(aux)
        except Exception as e:
            raise EncodeError(
                f"auxdata serializer of {t.__name__} ({name!r}) raised {e!r}",
                _path(where)) from e
        if not isinstance(blob, (bytes, bytearray)):
            raise EncodeError(
                f"auxdata serializer of {t.__name__} returned "
                f"{type(blob).__name__}, expected bytes", _path(where))
        if not is_namedtuple(t) and check_auxdata_reads_back(
                t, name, aux, bytes(blob), td, _path(where)):
            out.features.add(REBUILT)  # (older readers get it wrong)
        out.kinds.append(NodeKind.custom)
        out.node_data.append(("custom", name, bytes(blob)))
        if is_namedtuple(t):  # rebuilt from pickle state (_make_custom_node)
            out.copies += STATE_COST * (td.num_nodes - 1)
            out.features.add("namedtuple_custom_node")
    else:
        raise EncodeError(
            f"cannot serialize a PyTreeDef with node type {t!r}: register it "
            "with jax.export.register_pytree_node_serialization (or "
            "register_namedtuple_serialization)", _path(where))
    out.arities.append(len(children))
    if t is dict or t is collections.OrderedDict:
        steps = aux
    elif t is collections.defaultdict:
        steps = aux[1]
    elif plain_namedtuple(t) and len(t._fields) == len(children):
        steps = map(_Field, t._fields)
    else:
        steps = range(len(children))
    for step, c in zip(steps, children):
        _flatten_node(c, out, (where, step), depth + 1)


def _factory_name(factory, where) -> str:
    """factory_name, its error (if any) naming the path of ``where``."""
    try:
        return factory_name(factory, "$")
    except EncodeError as e:
        raise e.under(_path(where)) from None


_FLAT_CACHE: dict = {}
_FLAT_CACHE_MAX = 1024


def treedef_key(td):
    """A cache key of ``td`` that tells apart treedefs which compare equal
    but encode differently: ``{1: x}`` == ``{True: x}`` == ``{1.0: x}``, and
    a StrEnum key equals its str; their reprs differ.  It holds the
    registries' generation: a node type registered for serialization after
    a tree was cached is written under its new name.  None (not cached) if
    the treedef cannot be printed (an auxdata whose repr raises)."""
    try:
        return td, str(td), registry_generation()
    except Exception:  # noqa: BLE001 - the user's __repr__
        return None


def flatten_treedef(td, path: str = "$", key=None) -> FlatTree:
    """The preorder arrays of ``td`` (memoized: treedefs repeat in practice;
    ``key``: its treedef_key, if the caller has it)."""
    if key is None:
        key = treedef_key(td)
    try:
        hit = None if key is None else _FLAT_CACHE.get(key)
    except Exception:  # noqa: BLE001 - auxdata not hashable (its __hash__)
        hit = key = None
    if hit is not None and (not hit.by_name or still_found(hit.by_name)):
        return hit  # (else: a name was rebound; flattening says so)
    out = FlatTree()
    _flatten_node(td, out, path)
    if key is not None:
        if len(_FLAT_CACHE) >= _FLAT_CACHE_MAX:
            _FLAT_CACHE.clear()
        _FLAT_CACHE[key] = out
    return out


def build_treedef(builder, flat: FlatTree) -> int:
    shared: dict = {}  # equal node data is stored once and shared
    data_offs = []
    for j, d in enumerate(flat.node_data):
        key = _node_data_key(d)
        off = shared.get(key)
        if off is None:
            try:
                off = shared[key] = _build_node_data(builder, d)
            except EncodeError as e:  # a string UTF-8 cannot hold
                raise e.under(f"$.node_data[{j}]") from None
        data_offs.append(off)
    kinds = builder.CreateByteVector(bytes(flat.kinds))
    arities = (builder.CreateNumpyVector(np.asarray(flat.arities, np.uint32))
               if flat.arities else 0)
    nd = 0
    if data_offs:
        nd = offset_vector(builder, data_offs)
    fb.PyTreeDefStart(builder)
    fb.PyTreeDefAddKinds(builder, kinds)
    if arities:
        fb.PyTreeDefAddArities(builder, arities)
    if nd:
        fb.PyTreeDefAddNodeData(builder, nd)
    return fb.PyTreeDefEnd(builder)


def _node_data_key(d):
    return tuple(tuple(x) if isinstance(x, list) else x for x in d)


def _build_node_data(builder, d) -> int:
    tag = d[0]
    str_keys = int_keys = name = fields = aux = 0
    key_kind = KeyKind.none
    if tag in ("keys", "defaultdict"):
        key_kind, keys = d[1], d[2]
        if key_kind == KeyKind.str:
            str_keys = string_vector(builder, keys)
        elif key_kind == KeyKind.int:
            int_keys = builder.CreateNumpyVector(np.asarray(keys, np.int64))
        if tag == "defaultdict":
            name = builder.CreateSharedString(d[3])
    elif tag == "namedtuple":
        name = builder.CreateSharedString(d[1])
        fields = string_vector(builder, d[2])
    else:  # custom
        name = builder.CreateSharedString(d[1])
        aux = builder.CreateByteVector(d[2])
    fb.NodeDataStart(builder)
    if key_kind:
        fb.NodeDataAddKeyKind(builder, key_kind)
    for add, off in ((fb.NodeDataAddStrKeys, str_keys),
                     (fb.NodeDataAddIntKeys, int_keys),
                     (fb.NodeDataAddName, name),
                     (fb.NodeDataAddFields, fields),
                     (fb.NodeDataAddAuxdata, aux)):
        if off:
            add(builder, off)
    return fb.NodeDataEnd(builder)


# ------------------------------------------------------------------ decode

def decode_treedef(t, path: str):
    """Rebuild a PyTreeDef from its table, checking every count and key."""
    kinds = t.bytes(L.kinds, path, "kinds") or b""
    arities = t.ints(L.arities, "u32", path, "arities")
    data_pos = t.tables(L.node_data, path, "node_data")
    if not kinds:
        raise PayloadError("empty PyTreeDef", f"{path}.kinds")
    if len(kinds) == 1 and kinds[0] == NodeKind.leaf:
        return _LEAF
    state = _DecodeState(t.buf, kinds, arities, data_pos, path)
    td = state.node(0)
    state.budget[0] -= state.copies
    if state.k != len(kinds):
        raise PayloadError(
            f"{len(kinds) - state.k} trailing nodes after the tree",
            f"{path}.kinds")
    if state.a != len(arities) or state.d != len(data_pos):
        raise PayloadError("arities/node_data not fully consumed", path)
    if state.custom_namedtuples:  # read under any header: late version-7
        versions.note_used("namedtuple_custom_node")  # writers stamped it 1
    return td


class _DecodeState:
    __slots__ = ("buf", "kinds", "arities", "data_pos", "path", "k", "a", "d",
                 "specs", "copies", "budget", "custom_namedtuples")

    def __init__(self, buf, kinds, arities, data_pos, path):
        self.buf = buf
        self.kinds = kinds
        self.arities = arities
        self.data_pos = data_pos
        self.path = path
        self.k = self.a = self.d = 0
        # (node data position, kind, children) -> node spec, for the whole
        # buffer: the writer stores equal node data once, so trees of many
        # alike nodes read (and are charged for) each shared table once.
        self.specs: dict = buf.memo.setdefault("pytree_nodes", {})
        # node copies made so far, and what is left of the buffer's budget
        # (shared by its trees) when this one started
        self.copies = 0
        self.custom_namedtuples = False  # a v8 feature was read
        self.budget = buf.memo.get("pytree_copies")
        if self.budget is None:
            self.budget = buf.memo["pytree_copies"] = [copy_budget(buf.size)]

    def node(self, depth):
        if depth > MAX_DEPTH:
            raise PayloadError(f"pytree nesting deeper than {MAX_DEPTH}",
                               f"{self.path}.kinds[{self.k}]")
        k = self.k
        if k >= len(self.kinds):
            raise PayloadError("node list ends inside the tree",
                               f"{self.path}.kinds")
        kind = self.kinds[k]
        self.k = k + 1
        self.copies += depth  # copied once into each ancestor
        if kind == NodeKind.leaf:
            return _LEAF
        if kind == NodeKind.none:
            return _NONE
        if kind > _NODE_KIND_MAX:
            raise PayloadError(f"unknown NodeKind value {kind}",
                               f"{self.path}.kinds[{k}]")
        if self.a >= len(self.arities):
            raise PayloadError("missing arity", f"{self.path}.arities")
        n = self.arities[self.a]
        self.a += 1
        if n > len(self.kinds) - self.k:
            raise PayloadError(f"arity {n} exceeds the remaining nodes",
                               f"{self.path}.arities[{self.a - 1}]")
        spec = None
        if kind in _WITH_DATA:
            if self.d >= len(self.data_pos):
                raise PayloadError("missing node data",
                                   f"{self.path}.node_data")
            dpath = f"{self.path}.node_data[{self.d}]"
            key = (self.data_pos[self.d], kind, n)
            spec = self.specs.get(key)
            if spec is None:
                data = self.buf.table_at(self.data_pos[self.d], dpath)
                spec = self.specs[key] = node_spec(kind, data, n, dpath)
            self.d += 1
        children = []
        for _ in range(n):
            children.append(self.node(depth + 1))
        make = _make
        rebuild = None
        if spec is not None:
            spec, rebuild = spec[:2], spec[2]
        if kind == NodeKind.custom and is_namedtuple(spec[0]):
            self.copies += STATE_COST * sum(c.num_nodes for c in children)
            self.custom_namedtuples = True
            make = _make_custom_node
        elif rebuild is not None:  # unflattening the children copies them
            self.copies += sum(c.num_nodes for c in children)
        if self.copies > self.budget[0]:
            raise PayloadError(
                "rebuilding the tree copies nodes out of proportion to the "
                f"payload size (over {self.budget[0]} node copies: deep "
                "nesting around many nodes)", f"{self.path}.kinds[{k}]")
        if kind == NodeKind.tuple:
            return _make(_REGISTRY, (tuple, None), children)
        if kind == NodeKind.list:
            return _make(_REGISTRY, (list, None), children)
        if rebuild is not None:
            node = rebuild_custom(*spec, rebuild, children, dpath)
            if node is not None:
                return node
        try:
            return make(_REGISTRY, spec, children)
        except Exception as e:  # a registered node's constructor refused
            raise PayloadError(f"cannot rebuild node {type_name(spec[0])}: "
                               f"{e}", dpath) from None


# A PyTreeDef as a leaf of a spec tree.

def _build_treedef_entry(writer, builder, flat):
    return build_treedef(builder, flat)


def _decode_treedef_entry(reader, t, path):
    return decode_treedef(t, path)


def _intern_treedef(writer, td, path):
    writer.require("pytree", path)
    # Keyed by treedef_key: treedefs equal for JAX may differ in auxdata
    # (1, 1.0, True), which equality would merge into one entry.
    flat = flatten_treedef(td, path)  # (memoized)
    require_features(writer, flat, path)
    return writer.intern_obj("treedefs", td, lambda _: flat, key=treedef_key)


register_table("treedefs", _build_treedef_entry, _decode_treedef_entry)
register_leaf((PyTreeDef,), LeafKind.treedef, "treedefs", _intern_treedef)
