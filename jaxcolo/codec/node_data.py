"""A pytree node's data on the wire, read back: its type and auxdata.

``node_spec`` turns a node's NodeData table into what jaxlib rebuilds the
node from -- ``(type, auxdata)`` -- checking it against this process: dict
keys (sorted, unique, as many as children), namedtuples found by name with
the payload's fields, registered custom nodes with their auxdata decoded by
the registered deserializer, and dataclass nodes with as many children and
meta values as they have fields (jaxlib indexes them unchecked).
"""

from __future__ import annotations

import collections
from typing import Callable, NamedTuple

from jax._src.export import _export as jexport
from jax.tree_util import tree_structure

import jaxcolo_fb as fb
from jaxcolo_fb import KeyKind
from jaxcolo_fb import NodeKind
from jaxcolo.codec.names import dataclass_fields, is_custom_node, \
    is_namedtuple, registered_factory, resolve_namedtuple
from jaxcolo import versions
from jaxcolo.errors import EncodeError, PayloadError, UnregisteredError
from jaxcolo.wire import layout

LD = layout(fb, "NodeData")


def _read_keys(t, n, path, *, need_sorted):
    key_kind = t.scalar(LD.key_kind, "u8", 0, path, "key_kind")
    if key_kind == KeyKind.str:
        keys = t.strings(LD.str_keys, path, "str_keys")
    elif key_kind == KeyKind.int:
        keys = list(t.ints(LD.int_keys, "i64", path, "int_keys"))
    elif key_kind == KeyKind.none:
        keys = []
    else:
        raise PayloadError(f"unknown KeyKind value {key_kind}",
                           f"{path}.key_kind")
    if len(keys) != n:
        raise PayloadError(f"{len(keys)} keys for {n} children", path)
    if len(set(keys)) != n:
        raise PayloadError("duplicate dict keys", path)
    if need_sorted and keys != sorted(keys):
        raise PayloadError("dict keys are not in sorted order", path)
    return keys


def type_name(t) -> str:
    return repr(getattr(t, "__qualname__", t))


def node_spec(kind, t, n, path):
    """(node type, node data, rebuild) of a node with ``n`` children whose
    data is table ``t``: ``rebuild`` is None, or for a registered custom
    node the :class:`CustomRebuild` that :func:`rebuild_custom` makes it
    with (once its children are known)."""
    if kind == NodeKind.dict:
        return dict, _read_keys(t, n, path, need_sorted=True), None
    if kind == NodeKind.ordered_dict:
        keys = _read_keys(t, n, path, need_sorted=False)
        return collections.OrderedDict, tuple(keys), None
    if kind == NodeKind.default_dict:
        keys = _read_keys(t, n, path, need_sorted=True)
        fname = t.string(LD.name, path, "name") or ""
        factory = None
        if fname:
            factory = registered_factory(fname)
            if factory is None:
                raise UnregisteredError(
                    f"defaultdict default_factory {fname[:200]!r} is not "
                    "registered here (jaxcolo.register_default_factory)",
                    f"{path}.name")
        return collections.defaultdict, (factory, tuple(keys)), None
    name = t.string(LD.name, path, "name")
    if not name:
        raise PayloadError("node type name missing", f"{path}.name")
    if kind == NodeKind.namedtuple:
        fields = tuple(t.strings(LD.fields, path, "fields"))
        nt = _lookup_namedtuple(name, path, fields, t.buf.memo)
        if is_custom_node(nt):  # rebuilt as such, with no auxdata
            raise PayloadError(
                f"namedtuple {name!r} is a custom pytree node here, the "
                "payload has a plain namedtuple node", f"{path}.name")
        if nt._fields != fields or len(fields) != n:
            raise PayloadError(
                f"namedtuple {name!r} has fields {nt._fields}, the payload "
                f"has {fields} with {n} children", f"{path}.fields")
        return nt, None, None
    # custom
    reg = jexport.deserialization_registry.get(name)
    if reg is None:
        raise UnregisteredError(
            f"pytree node type {name!r} is not registered here (use "
            "jax.export.register_pytree_node_serialization)", f"{path}.name")
    nodetype, deser, _ = reg
    if is_namedtuple(nodetype) and not is_custom_node(nodetype):
        raise PayloadError(
            f"{name!r} is a plain namedtuple here (no pytree registration), "
            "the payload has a custom node", f"{path}.name")
    fields = dataclass_fields(nodetype)
    if fields is not None and is_namedtuple(nodetype):
        raise PayloadError(f"{name!r} is a namedtuple registered as a "
                           "dataclass node: not supported", f"{path}.name")
    blob = t.bytes(LD.auxdata, path, "auxdata") or b""
    try:
        aux = deser(blob)
    except Exception as e:
        raise PayloadError(f"auxdata of {name!r} could not be decoded: {e!r}",
                           f"{path}.auxdata") from None
    if is_namedtuple(nodetype):  # rebuilt from pickle state
        return nodetype, aux, None
    return nodetype, aux, CustomRebuild(name, reg[2], fields)


class CustomRebuild(NamedTuple):
    """How a registered custom node is made once its children are known."""
    name: str
    from_children: Callable
    fields: tuple | None  # a dataclass node's (data, meta) field names


def rebuild_custom(nodetype, aux, how: CustomRebuild, children, path):
    """The custom node as JAX reads it back: jax.export builds it with
    its registered ``from_children`` over the children (leaves as 0.0) and
    flattens it again, so auxdata its unflatten normalises (a list made a
    tuple, fields derived from the children) comes back normalised.
    PayloadError if that is not a ``nodetype`` node of these children;
    None if ``from_children`` cannot build it over placeholders (it wants
    real leaves): the caller then makes it from ``aux`` as it is (a
    dataclass node's checked first: jaxlib indexes its fields unchecked)."""
    try:
        node = how.from_children(aux, [c.unflatten([0.0] * c.num_leaves)
                                       for c in children])
        td = tree_structure(node)
        data = td.node_data()
    except Exception:  # noqa: BLE001 - the user's unflatten
        fields = how.fields
        if fields is not None and (
                type(aux) is not tuple or len(aux) != len(fields[1])
                or len(children) != len(fields[0])):
            raise PayloadError(
                f"dataclass node {how.name!r} has {len(fields[0])} data and "
                f"{len(fields[1])} meta fields, the payload has "
                f"{len(children)} children and auxdata {short_repr(aux)}",
                f"{path}.auxdata") from None
        return None
    try:
        same = data is not None and data[0] is nodetype and \
            td.children() == children
    except Exception:  # noqa: BLE001 - an auxdata's __eq__ (numpy arrays)
        same = data is not None and data[0] is nodetype and \
            td.num_nodes == 1 + sum(c.num_nodes for c in children)
    if not same:
        raise PayloadError(
            f"custom node {how.name!r} rebuilt by its from_children is "
            f"{short_repr(td)}, not a {type_name(nodetype)} node of its "
            f"{len(children)} children", f"{path}.auxdata")
    if versions.noting() and _known_different(data[1], aux):
        versions.note_used(REBUILT)  # (read under any header)
    return td


# Readers before version 10 made a custom node of its auxdata as read,
# not rebuilt by its from_children (see versions.py).
REBUILT = "custom_node_rebuilt"


def check_auxdata_reads_back(t, name, aux, blob: bytes, td,
                             path: str) -> bool:
    """EncodeError unless a reader (this process's registrations) rebuilds
    custom node ``td`` (its type ``t``, auxdata ``aux``) equal, auxdata
    compared with ==: a serializer that loses something (JSON makes a
    tuple a list) changed the tree silently, and a colocated function's
    outputs, read back from the discovered specs, no longer matched on
    later calls.  Rebuilt as readers do (``rebuild_custom``); where
    ``from_children`` cannot build it over placeholders, the auxdata read
    back is compared.  True if it reads back equal only rebuilt (the
    auxdata read back differs, its from_children normalises it): readers
    before REBUILT's version get it wrong."""
    reg = jexport.deserialization_registry.get(name)
    if reg is None or reg[0] is not t:
        return False  # (another process's registrations decide)
    try:
        back = reg[1](blob)
    except Exception as e:
        raise EncodeError(f"auxdata of {t.__name__} ({name!r}) does not read "
                          f"back: its deserializer raised {e!r}",
                          path) from None
    children = td.children()
    try:
        rebuilt = tree_structure(reg[2](back, [
            c.unflatten([0.0] * c.num_leaves) for c in children]))
        data = rebuilt.node_data()
    except Exception:  # noqa: BLE001 - wants real leaves: compare auxdata
        rebuilt, data = None, (t, back)
    try:
        same = bool(data[1] == aux) if rebuilt is None else rebuilt == td
    except Exception:  # noqa: BLE001 - no usable __eq__: JAX's own
        return False   # treedef comparison cannot tell either
    if same:
        return rebuilt is not None and _known_different(back, aux)
    if not _equal(back, aux):
        raise EncodeError(
            f"auxdata of {t.__name__} ({name!r}) reads back as "
            f"{short_repr(back)}, not {short_repr(aux)}: its "
            "serialize_auxdata and deserialize_auxdata must be inverses "
            "(auxdata is compared with ==; the tree would come back "
            "different)", path)
    raise EncodeError(
        f"custom node {name!r} is rebuilt by its from_children over "
        f"placeholder leaves (as readers and jax.export rebuild it) as "
        f"{short_repr(rebuilt)}, not {short_repr(td)}: its auxdata must "
        "not depend on its leaves' values", path)


def _known_different(a, b) -> bool:
    """``a`` (auxdata as read) is not ``b`` (as rebuilt), by ==; False when
    that cannot tell (numpy arrays, an __eq__ that raises): such auxdata,
    which JAX's own treedef comparison cannot judge either, is not taken
    for one that only rebuilding reads back right."""
    if a is b:
        return False
    try:
        return not bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def _equal(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def short_repr(x) -> str:
    """``repr(x)`` for a message, cut to 80 characters (a placeholder if
    the user's __repr__ raises)."""
    try:
        text = repr(x)
    except Exception:  # noqa: BLE001
        return f"<{type(x).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


# Buffer.memo key: (type, name) of the namedtuples the buffer's trees found
# by name (a decode cached past a rebinding of such a name is stale).
FOUND_BY_NAME = "namedtuples found by name"


def _kind_of(obj) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"[:200]
    return f"a {type(obj).__name__}"[:200]


def _lookup_namedtuple(name, path, fields, buf_memo):
    reg = jexport.deserialization_registry.get(name)
    if reg is not None:
        nt = reg[0]
    else:
        nt = resolve_namedtuple(name, fields)
        buf_memo.setdefault(FOUND_BY_NAME, []).append((nt, name))
    if nt is not None and not is_namedtuple(nt):  # the payload's mistake
        raise PayloadError(f"namedtuple type {name!r} names "
                           f"{_kind_of(nt)} here, not a namedtuple",
                           f"{path}.name")
    if not is_namedtuple(nt):
        raise UnregisteredError(
            f"namedtuple type {name!r} is neither registered (jax.export."
            "register_namedtuple_serialization) nor defined in an imported "
            "module", f"{path}.name")
    return nt
