"""The registry of per-type hooks and the per-payload encode/decode state.

A spec payload is a set of *unique tables* (meshes, shardings, avals, ...) plus
leaves that reference them by index.  Each codec module registers:

* ``register_table(name, build, decode)``: how one entry of the SpecTree vector
  ``name`` is built into a flatbuffer (``build(writer, builder, item) ->
  offset``) and read back (``decode(reader, table, path) -> object``);
* ``register_leaf(types, kind, table, intern)``: which Python types are leaves
  of kind ``kind`` and how to intern one (``intern(writer, obj, path) ->
  index``).

New types plug in here without touching a switch statement elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxcolo import versions
from jaxcolo.errors import EncodeError, PayloadError
from jaxcolo.wire import Buffer, Table


@dataclasses.dataclass(frozen=True)
class TableCodec:
    name: str
    build: Callable  # (writer, builder, item) -> offset
    decode: Callable  # (reader, Table, path) -> object
    field: str  # the SpecTree vector holding the entries


@dataclasses.dataclass(frozen=True)
class LeafCodec:
    kind: int
    table: str
    intern: Callable  # (writer, obj, path) -> index


TABLES: dict[str, TableCodec] = {}
LEAF_TYPES: dict[type, LeafCodec] = {}
LEAF_BASES: list[tuple[type, LeafCodec]] = []  # isinstance fallbacks
KIND_TABLE: dict[int, str] = {}


def register_table(name: str, build: Callable, decode: Callable,
                   field: str | None = None) -> None:
    TABLES[name] = TableCodec(name, build, decode, field or name)


def register_leaf(types: tuple, kind: int, table: str, intern: Callable,
                  *, subclasses: bool = False) -> None:
    codec = LeafCodec(kind, table, intern)
    for t in types:
        LEAF_TYPES[t] = codec
        if subclasses:
            LEAF_BASES.append((t, codec))
    KIND_TABLE[kind] = table


def leaf_codec(obj: Any) -> LeafCodec | None:
    t = type(obj)
    codec = LEAF_TYPES.get(t)
    if codec is None:
        for base, c in LEAF_BASES:
            if isinstance(obj, base):
                LEAF_TYPES[t] = codec = c
                break
    return codec


class Unique:
    """Insertion-ordered interning of the entries of one unique table."""

    __slots__ = ("items", "index", "by_id")

    def __init__(self):
        self.items: list = []
        self.index: dict = {}
        self.by_id: dict = {}


class Writer:
    """State of one payload being encoded at schema version ``version``."""

    def __init__(self, version: int):
        self.version = version
        self.min_reader = 1
        self.uniques: dict[str, Unique] = {}

    def require(self, feature: str, path: str = "$") -> None:
        since = versions.require(feature, self.version, path)
        if since > self.min_reader:
            self.min_reader = since

    def intern(self, table: str, key: Any, item: Any = None, *,
               make: Callable | None = None) -> int:
        """Index of the entry identified by hashable ``key`` in ``table``;
        a new entry is ``item``, or ``make()`` (called only when new)."""
        u = self.uniques.get(table)
        if u is None:
            u = self.uniques[table] = Unique()
        i = u.index.get(key)
        if i is None:
            i = u.index[key] = len(u.items)
            u.items.append(make() if make is not None else item)
        return i

    def intern_obj(self, table: str, obj: Any, make_item: Callable) -> int:
        """Like intern, keyed by identity first and equality second."""
        u = self.uniques.get(table)
        if u is None:
            u = self.uniques[table] = Unique()
        hit = u.by_id.get(id(obj))
        if hit is not None and hit[0] is obj:
            return hit[1]
        try:
            i = u.index.get(obj)
        except TypeError:  # unhashable: identity only
            i = None
        if i is None:
            i = len(u.items)
            u.items.append(make_item(obj))
            try:
                u.index[obj] = i
            except TypeError:
                pass
        u.by_id[id(obj)] = (obj, i)
        return i

    def items(self, table: str) -> list:
        u = self.uniques.get(table)
        return u.items if u is not None else []

    def fail(self, reason: str, path: str):
        raise EncodeError(reason, path)


class Reader:
    """State of one payload being decoded: memoized unique-table entries."""

    def __init__(self, buf: Buffer, root: Table, layout, resolver,
                 root_path: str = "$"):
        self.buf = buf
        self.root = root
        self.layout = layout
        self.resolver = resolver
        self.root_path = root_path
        self._positions: dict[str, list] = {}
        self._memo: dict[str, list] = {}

    def count(self, table: str) -> int:
        return len(self._table_positions(table))

    def _table_positions(self, table: str) -> list:
        pos = self._positions.get(table)
        if pos is None:
            field = TABLES[table].field
            pos = self._positions[table] = self.root.tables(
                getattr(self.layout, field), self.root_path, field)
            self._memo[table] = [None] * len(pos)
        return pos

    def get(self, table: str, index: int, path: str) -> Any:
        """Entry ``index`` of unique table ``table``, decoded once."""
        positions = self._table_positions(table)
        if not 0 <= index < len(positions):
            raise PayloadError(
                f"reference {index} out of range: {table} has "
                f"{len(positions)} entries", path)
        memo = self._memo[table]
        obj = memo[index]
        if obj is None:
            entry_path = f"{self.root_path}.{TABLES[table].field}[{index}]"
            t = self.buf.table_at(positions[index], entry_path)
            obj = TABLES[table].decode(self, t, entry_path)
            memo[index] = obj
        return obj

    def get_optional(self, table: str, ref: int, path: str) -> Any:
        """``ref`` is 1 + index, or 0 for None."""
        if ref == 0:
            return None
        return self.get(table, ref - 1, path)
