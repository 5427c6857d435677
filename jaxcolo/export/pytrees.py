"""PyTreeDefs in JAX's export format: one table per node, children nested.

Encoding follows JAX's writer operation for operation (children first, then
dict keys / custom name and auxdata, then the node table), so the bytes are
identical.  Decoding rebuilds the tree the way JAX does it (the pytree over
the leaves, custom nodes by their registered ``from_children``, then one
``tree_structure``) so the result equals JAX's, in time linear in the nodes.
Only nodes registered with
``jax.export.register_pytree_node_serialization`` /
``register_namedtuple_serialization`` are custom nodes; nothing is imported.
"""

from __future__ import annotations

import types

from jax._src import tree_util as jtu
from jax._src.export import _export as jexport

import jaxcolo_jax_export_fb as fb
from jaxcolo.errors import EncodeError, PayloadError, UnregisteredError
from jaxcolo.export.layouts import TREE as L

# Deeper than JAX's own writer goes: its recursion fails past about 330
# levels, so every tree JAX writes reads back.  (Two frames a level here:
# a stack too shallow for that is an error of ours, never a RecursionError.)
MAX_DEPTH = 400
_K = fb.PyTreeDefKind
_NONE = jtu.tree_structure(None)


# ------------------------------------------------------------------ encode

def encode_tree(builder, td, custom_ok: bool, path: str = "$") -> int:
    """Build ``td`` bottom-up; returns the node table's offset."""
    try:
        return _encode_node(builder, td, custom_ok, path, 0)
    except RecursionError:
        raise EncodeError("pytree nesting too deep for this thread's stack",
                          path) from None


def _encode_node(builder, td, custom_ok: bool, path: str, depth: int) -> int:
    if depth > MAX_DEPTH:
        raise EncodeError(f"pytree nesting deeper than {MAX_DEPTH}", path)
    nd = td.node_data()
    children = td.children()
    children_off = 0
    if children:
        offs = [_encode_node(builder, c, custom_ok, path, depth + 1)
                for c in children]
        children_off = _offset_vector(builder, offs)
    names_off = name_off = aux_off = 0
    if nd is None:
        kind = _K.leaf
    else:
        t, aux = nd
        if t is types.NoneType:
            kind = _K.none
        elif t is tuple:
            kind = _K.tuple
        elif t is list:
            kind = _K.list
        elif t is dict:
            kind = _K.dict
            for k in aux:
                if not isinstance(k, str):
                    raise EncodeError(
                        f"dict key {k!r} of type {type(k).__name__}: JAX's "
                        "format only has string keys", path)
            names_off = _offset_vector(
                builder, [builder.CreateString(k) for k in aux])
        elif t in jexport.serialization_registry:
            if not custom_ok:
                raise EncodeError(
                    f"custom pytree node {t.__name__} needs serialization "
                    "version >= 3", path)
            kind = _K.custom
            name, ser = jexport.serialization_registry[t]
            name_off = builder.CreateString(name)
            try:
                blob = ser(aux)
            except Exception as e:
                raise EncodeError(f"auxdata serializer of {name!r} raised "
                                  f"{e!r}", path) from None
            if not isinstance(blob, (bytes, bytearray)):
                raise EncodeError(f"auxdata serializer of {name!r} returned "
                                  f"{type(blob).__name__}, not bytes", path)
            aux_off = builder.CreateByteVector(blob)
        else:
            raise EncodeError(
                f"cannot serialize a PyTreeDef with node type {t!r}: register "
                "it with jax.export.register_pytree_node_serialization (or "
                "register_namedtuple_serialization)", path)
    fb.PyTreeDefStart(builder)
    fb.PyTreeDefAddKind(builder, kind)
    if children_off:
        fb.PyTreeDefAddChildren(builder, children_off)
    if names_off:
        fb.PyTreeDefAddChildrenNames(builder, names_off)
    if name_off:
        fb.PyTreeDefAddCustomName(builder, name_off)
    if aux_off:
        fb.PyTreeDefAddCustomAuxdata(builder, aux_off)
    return fb.PyTreeDefEnd(builder)


def _offset_vector(builder, offs) -> int:
    return builder.offset_vector(offs)


# ------------------------------------------------------------------ decode

class _Node:
    """A decoded node before it becomes a PyTreeDef."""

    __slots__ = ("kind", "children", "keys", "custom")

    def __init__(self, kind, children, keys=None, custom=None):
        self.kind = kind
        self.children = children
        self.keys = keys
        self.custom = custom  # (nodetype, auxdata, from_children, name)


class _Reader:
    __slots__ = ("buf", "n_leaves")

    def __init__(self, buf):
        self.buf = buf
        self.n_leaves = 0

    def node(self, t, path, depth):
        if depth > MAX_DEPTH:
            raise PayloadError(f"pytree nesting deeper than {MAX_DEPTH}", path)
        if t.vtlen == 4:  # no fields at all: a leaf (JAX writes leaves so)
            self.n_leaves += 1
            return None
        kind = t.scalar(L.kind, "u8", 0, path, "kind")
        positions = t.tables(L.children, path, "children")
        if kind == _K.leaf or kind == _K.none:
            if positions:
                raise PayloadError(f"a {'leaf' if kind == _K.leaf else 'None'}"
                                   " node with children", f"{path}.children")
            if kind == _K.leaf:
                self.n_leaves += 1
                return None
            return _NONE
        buf = self.buf
        children = [self.node(buf.table_at(p, f"{path}.children[{i}]"),
                              f"{path}.children[{i}]", depth + 1)
                    for i, p in enumerate(positions)]
        if kind == _K.tuple or kind == _K.list:
            return _Node(kind, children)
        if kind == _K.dict:
            keys = t.strings(L.children_names, path, "children_names")
            if len(keys) != len(children):
                raise PayloadError(f"{len(keys)} dict keys for "
                                   f"{len(children)} children",
                                   f"{path}.children_names")
            if len(set(keys)) != len(keys):
                raise PayloadError("duplicate dict keys",
                                   f"{path}.children_names")
            return _Node(kind, children, keys)
        if kind == _K.custom:
            return _Node(kind, children, custom=self.custom(t, path))
        raise PayloadError(f"unknown PyTreeDefKind value {kind}",
                           f"{path}.kind")

    def custom(self, t, path):
        name = t.string(L.custom_name, path, "custom_name")
        if name is None:
            raise PayloadError("custom node without custom_name",
                               f"{path}.custom_name")
        reg = jexport.deserialization_registry.get(name)
        if reg is None:
            raise UnregisteredError(
                f"pytree node type {name!r} is not registered here (use "
                "jax.export.register_pytree_node_serialization or "
                "register_namedtuple_serialization)", f"{path}.custom_name")
        nodetype, deser, from_children = reg
        blob = t.bytes(L.custom_auxdata, path, "custom_auxdata") or b""
        try:
            aux = deser(blob)
        except Exception as e:
            raise PayloadError(f"auxdata of {name!r} could not be decoded: "
                               f"{e!r}", f"{path}.custom_auxdata") from None
        return nodetype, aux, from_children, name


def _as_pytree(node, leaves):
    """The pytree JAX builds (leaves taken from the iterator ``leaves``)."""
    if node is None:
        return next(leaves)
    if not isinstance(node, _Node):
        return None
    children = [_as_pytree(c, leaves) for c in node.children]
    if node.kind == _K.tuple:
        return tuple(children)
    if node.kind == _K.list:
        return children
    if node.kind == _K.dict:
        return dict(zip(node.keys, children))
    return node.custom[2](node.custom[1], children)


def decode_tree(buf, t, path: str, leaves) -> jtu.PyTreeDef:
    """The PyTreeDef stored in table ``t``; ``leaves`` are the avals it must
    hold (JAX passes them to custom nodes' ``from_children``)."""
    reader = _Reader(buf)
    try:
        root = reader.node(t, path, 0)
    except RecursionError:
        raise PayloadError("pytree nesting too deep for this thread's stack",
                           path) from None
    if reader.n_leaves != len(leaves):
        raise PayloadError(f"tree has {reader.n_leaves} leaves but there are "
                           f"{len(leaves)} avals", path)
    # Built as objects and flattened once: linear in the nodes (rebuilding
    # the PyTreeDef bottom-up would copy each node once per ancestor).
    try:
        td = jtu.tree_structure(_as_pytree(root, iter(leaves)))
    except RecursionError:
        raise PayloadError("pytree nesting too deep for this thread's stack",
                           path) from None
    except Exception as e:  # user from_children code rejected the children
        raise PayloadError(f"cannot rebuild the tree: {e!r}", path) from None
    if td.num_leaves != len(leaves):
        raise PayloadError(f"rebuilt tree has {td.num_leaves} leaves, "
                           f"expected {len(leaves)}", path)
    return td
