"""The registry of per-type hooks and the per-payload encode/decode state.

A spec payload is a set of *unique tables* (meshes, shardings, avals, ...) plus
leaves that reference them by index.  Each codec module registers:

* ``register_table(name, build, decode)``: how one entry of the SpecTree vector
  ``name`` is built into a flatbuffer (``build(writer, builder, item) ->
  offset``) and read back (``decode(reader, table, path) -> object``);
* ``register_leaf(types, kind, table, intern, key=None)``: which Python types
  are leaves of kind ``kind`` and how to intern one (``intern(writer, obj,
  path) -> index``); ``key(obj)``, when given, returns a hashable value that
  is equal for leaves that intern to the same entry (or None), so repeated
  leaves of one payload skip ``intern``.

New types plug in here without touching a switch statement elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxcolo import versions
from jaxcolo.errors import EncodeError, PayloadError, UnavailableHereError
from jaxcolo.wire import Buffer, Table


@dataclasses.dataclass(frozen=True)
class TableCodec:
    name: str
    build: Callable  # (writer, builder, item) -> offset
    decode: Callable  # (reader, Table, path) -> object
    field: str  # the SpecTree vector holding the entries
    # Columnar tables: the SpecTree field is one table of columns, built from
    # all items at once, ``build(writer, builder, items) -> offset``;
    # ``open(reader, Table | None, path) -> columns`` (with len()) checks it
    # once per payload and ``decode(reader, columns, index, path)`` builds
    # one entry.  Several names may view one field (different leaf types).
    open: Callable | None = None


@dataclasses.dataclass(frozen=True)
class LeafCodec:
    kind: int
    table: str
    intern: Callable  # (writer, obj, path) -> index
    key: Callable | None = None  # obj -> hashable | None (see register_leaf)


TABLES: dict[str, TableCodec] = {}
LEAF_TYPES: dict[type, LeafCodec] = {}
LEAF_BASES: list[tuple[type, LeafCodec]] = []  # isinstance fallbacks
KIND_TABLE: dict[int, str] = {}


def register_table(name: str, build: Callable, decode: Callable,
                   field: str | None = None) -> None:
    TABLES[name] = TableCodec(name, build, decode, field or name)


def register_columns(name: str, field: str, build: Callable | None,
                     open: Callable, decode: Callable) -> None:
    """A columnar unique table (see TableCodec.open)."""
    TABLES[name] = TableCodec(name, build, decode, field, open)


def register_leaf(types: tuple, kind: int, table: str, intern: Callable,
                  *, subclasses: bool = False,
                  key: Callable | None = None) -> None:
    codec = LeafCodec(kind, table, intern, key)
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
        self.required: set[str] = set()
        # Per-payload memo for codecs' fast paths (e.g. id(obj) -> (obj, i)).
        self.memo: dict = {}
        self.dtype_refs: dict = {}  # dtype -> index in the dtypes table
        # Parse units a reader will charge for symbolic text, per distinct
        # text (see wire.parse_budget).
        self.parsed: dict = {}

    def require(self, feature: str, path: str = "$") -> None:
        if feature in self.required:
            return
        since = versions.require(feature, self.version, path)
        if since > self.min_reader:
            self.min_reader = since
        self.required.add(feature)

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

    def intern_obj(self, table: str, obj: Any, make_item: Callable,
                   key: Callable | None = None) -> int:
        """Like intern, keyed by identity first and equality second: of
        ``key(obj)`` if given (for objects that compare equal yet encode
        differently), else of ``obj``."""
        u = self.uniques.get(table)
        if u is None:
            u = self.uniques[table] = Unique()
        hit = u.by_id.get(id(obj))
        if hit is not None and hit[0] is obj:
            return hit[1]
        k = obj if key is None else key(obj)
        try:
            i = u.index.get(k)
        except TypeError:  # unhashable: identity only
            i = None
        if i is None:
            i = len(u.items)
            u.items.append(make_item(obj))
            try:
                u.index[k] = i
            except TypeError:
                pass
        u.by_id[id(obj)] = (obj, i)
        return i

    def items(self, table: str) -> list:
        u = self.uniques.get(table)
        return u.items if u is not None else []

    def fail(self, reason: str, path: str):
        raise EncodeError(reason, path)


class _Unavailable:
    """A memo entry whose decoding needed what this process lacks."""

    __slots__ = ("error",)

    def __init__(self, error: UnavailableHereError):
        self.error = error


class Reader:
    """State of one payload being decoded: memoized unique-table entries."""

    def __init__(self, buf: Buffer, root: Table, layout, resolver,
                 root_path: str = "$", declared_min_reader: int | None = None):
        self.buf = buf
        # The header's min_reader_version: the body may use no feature newer
        # than that (checked by check_declared where a feature is decoded).
        self.declared_min_reader = declared_min_reader
        self.root = root
        self.layout = layout
        self.resolver = resolver
        self.root_path = root_path
        self._positions: dict[str, list] = {}  # table name -> entry positions
        self._columns: dict[str, Any] = {}     # field -> opened columns
        self._memo: dict[str, list] = {}       # table name -> decoded entries
        self.state: dict[str, Any] = {}        # codecs' per-payload notes

    def check_declared(self, feature: str, path: str) -> None:
        """PayloadError if the body uses ``feature`` but the header claims an
        older reader can read it (a corrupt or forged header, which would
        make that reader drop the feature silently)."""
        since = versions.FEATURE_SINCE[feature]
        declared = self.declared_min_reader
        if declared is not None and since > declared:
            raise PayloadError(
                f"{feature} needs reader version >= {since}, but the header "
                f"declares min_reader_version {declared}", path)

    def _open(self, table: str) -> list:
        codec = TABLES[table]
        field = codec.field
        slot = getattr(self.layout, field)
        if codec.open is not None:
            cols = self._columns.get(field)
            if cols is None:
                path = f"{self.root_path}.{field}"
                cols = self._columns[field] = codec.open(
                    self, self.root.table(slot, self.root_path, field), path)
            n = len(cols)
        else:
            pos = self._positions[table] = self.root.tables(
                slot, self.root_path, field)
            n = len(pos)
        memo = self._memo[table] = [None] * n
        return memo

    def count(self, table: str) -> int:
        memo = self._memo.get(table)
        return len(memo if memo is not None else self._open(table))

    def get(self, table: str, index: int, path: str) -> Any:
        """Entry ``index`` of unique table ``table``, decoded once."""
        memo = self._memo.get(table)
        if memo is None:
            memo = self._open(table)
        if not 0 <= index < len(memo):
            raise PayloadError(
                f"reference {index} out of range: {table} has "
                f"{len(memo)} entries", path)
        obj = memo[index]
        if obj is None:
            codec = TABLES[table]
            entry_path = f"{self.root_path}.{codec.field}[{index}]"
            try:
                if codec.open is not None:
                    obj = codec.decode(self, self._columns[codec.field],
                                       index, entry_path)
                else:
                    t = self.buf.table_at(self._positions[table][index],
                                          entry_path)
                    obj = codec.decode(self, t, entry_path)
            except UnavailableHereError as e:  # once: entries referring to
                memo[index] = _Unavailable(e)  # it fail at once (inspect
                raise                          # walks on past it)
            memo[index] = obj
        elif obj.__class__ is _Unavailable:
            e = obj.error
            raise type(e)(e.reason, e.path)
        return obj

    def walk_available(self, views: dict | None = None) -> None:
        """Decode every entry of every table that does not need what this
        process lacks, so features used past such content are noted
        (versions.noting_used); a malformed entry is a PayloadError.

        An entry of a column field several tables view (ShapeDtypeStruct
        and ShapedArray leaves share one) is decoded only as what refers to
        it: ``views`` maps (field, index) to the tables the leaves read it
        through; an entry no leaf names, through the table that writes it.
        """
        views = views or {}
        viewers: dict = {}
        for codec in TABLES.values():
            viewers[codec.field] = viewers.get(codec.field, 0) + 1
        for table, codec in TABLES.items():
            shared = viewers[codec.field] > 1
            for index in range(self.count(table)):
                if shared:
                    wanted = views.get((codec.field, index))
                    if table not in wanted if wanted is not None else \
                            codec.build is None:
                        continue
                try:
                    self.get(table, index, self.root_path)
                except UnavailableHereError:
                    pass

    def get_optional(self, table: str, ref: int, path: str) -> Any:
        """``ref`` is 1 + index, or 0 for None."""
        if ref == 0:
            return None
        return self.get(table, ref - 1, path)
