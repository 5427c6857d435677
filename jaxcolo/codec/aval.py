"""Array specs: jax.ShapeDtypeStruct and core.ShapedArray leaves.

Both are stored in one columnar unique table, ``SpecTree.arrays``
(schema: ArraySpecs): ranks, concatenated dims, dtype and sharding references
and flag bits, one value per entry, plus sparse ``extras`` for the rare parts
(symbolic dims with their scope, manual axis types).  N distinct specs thus
cost a fixed handful of vectors to write and to read.

Symbolic dimensions (jax.export shape polymorphism) are written as JAX spells
them and parsed back with JAX's own shape_poly parser in their scope (see
:mod:`jaxcolo.codec.scopes`).
"""

from __future__ import annotations

import itertools
import operator

import jax
import numpy as np
from jax._src import core
from jax._src.export import shape_poly
from jax._src.layout import Format

import jaxcolo_fb as fb
from jaxcolo_fb import ArrayFlags, LeafKind
from jaxcolo.codec.core import register_columns, register_leaf
from jaxcolo.codec.dtypes import intern_dtype
from jaxcolo.codec.layout import build_layout, decode_layout, layout_item
from jaxcolo.codec.sharding import intern_sharding
from jaxcolo.codec.scopes import scope_entry
from jaxcolo.codec.symbolic import FREE_TRIAL_MARGIN, PAST_MODEL, \
    bits_of_scope, empty_scope, legacy_or_current_charge, parse_shape, \
    trial_parse_units, writable_cost
from jaxcolo.errors import EncodeError, PayloadError
from jaxcolo.fastbuilder import offset_vector, string_vector
from jaxcolo.wire import layout

LA = layout(fb, "ArraySpecs")
LX = layout(fb, "ArraySpecExtra")
LM = layout(fb, "ManualAxisType")

_MEMORY_FLAGS = {core.MemorySpace.Device: 0,
                 core.MemorySpace.Host: ArrayFlags.host_memory,
                 core.MemorySpace.Any: ArrayFlags.any_memory}
_FLAGS_MEMORY = {v: k for k, v in _MEMORY_FLAGS.items()}
_MEMORY_BITS = ArrayFlags.host_memory | ArrayFlags.any_memory
_KNOWN_FLAGS = (ArrayFlags.weak_type | ArrayFlags.is_ref | _MEMORY_BITS)
_EMPTY_MAT = core.ManualAxisType()
_DimExpr = shape_poly._DimExpr
SYMBOLIC = -1
_DIM_LIMIT = 2**63
MAX_RANK = 255

# ------------------------------------------------------ manual axis types

def _mat_item(mat, keep_empty: bool = False):
    """The wire form of a ManualAxisType; None for none (and for an empty
    one unless ``keep_empty``: a ShapedArray's default)."""
    if mat is None or (mat == _EMPTY_MAT and not keep_empty):
        return None
    return (tuple(sorted(mat.varying)), tuple(sorted(mat.unreduced)),
            tuple(sorted(mat.reduced)))


def _build_mat(builder, item) -> int:
    if item is None:
        return 0
    offs = [string_vector(builder, v) if v else 0 for v in item]
    fb.ManualAxisTypeStart(builder)
    for add, off in zip((fb.ManualAxisTypeAddVarying,
                         fb.ManualAxisTypeAddUnreduced,
                         fb.ManualAxisTypeAddReduced), offs):
        if off:
            add(builder, off)
    return fb.ManualAxisTypeEnd(builder)


def _decode_mat(t, path):
    if t is None:
        return None
    try:
        return core.ManualAxisType(
            varying=frozenset(t.strings(LM.varying, path, "varying")),
            unreduced=frozenset(t.strings(LM.unreduced, path, "unreduced")),
            reduced=frozenset(t.strings(LM.reduced, path, "reduced")))
    except ValueError as e:
        raise PayloadError(f"invalid manual axis type: {e}", path) from None


# ------------------------------------------------------------ encoding

def _shape_item(writer, shape, path):
    """(dims, symbolic dim texts, scope ref) of a shape."""
    if len(shape) > MAX_RANK:
        raise EncodeError(f"rank {len(shape)} exceeds {MAX_RANK}", path)
    dims, sym, scope_ref = [], [], 0
    for d in shape:
        if type(d) is int or isinstance(d, (int, np.integer)):
            if not 0 <= d < _DIM_LIMIT:
                raise EncodeError(f"dimension {d} is negative or does not "
                                  "fit in int64", path)
            dims.append(int(d))
        elif isinstance(d, _DimExpr):
            dims.append(SYMBOLIC)
            text = str(d)
            sym.append(text)
            ref = scope_entry(writer, d.scope, path)
            if (text, ref) not in writer.parsed:  # a reader parses it once
                cost = writable_cost(text, path, bits_of_scope(d.scope))
                if cost.counted:  # readers before its version refuse it
                    writer.require(PAST_MODEL, path)
                trial = writer.memo.get(("trial scope", id(d.scope)))
                constrained = trial is not None
                if trial is None and cost.work_counted:  # a reader counts
                    trial = writer.memo.get(("free trial scope", ref))
                    if trial is None:  # JAX's work on it, in one scope per
                        trial = writer.memo[("free trial scope", ref)] = \
                            empty_scope()  # entry (its bounds are cached)
                work = 0 if trial is None else trial_parse_units(
                    text, trial, path, d,
                    2.0 if constrained else FREE_TRIAL_MARGIN)
                writer.parsed[(text, ref)] = legacy_or_current_charge(
                    cost, work, constrained)
            if scope_ref and ref != scope_ref:
                raise EncodeError("symbolic dims from different scopes in one "
                                  "shape", path)
            scope_ref = ref
        else:
            raise EncodeError(f"unsupported dimension {d!r}", path)
    return tuple(dims), tuple(sym), scope_ref


def intern_array(writer, shape, dtype, flags, sharding_ref, mat, path,
                 layout=None, keep_empty_mat=False) -> int:
    """Index of the ArraySpecs entry with these parts."""
    dims, sym, scope_ref = _shape_item(writer, shape, path)
    dtype_ref = intern_dtype(writer, dtype, path + ".dtype")
    item = (dims, sym, scope_ref, dtype_ref, sharding_ref, flags,
            _mat_item(mat, keep_empty_mat),
            layout_item(writer, layout, len(dims), path + ".layout"))
    return writer.intern("arrays", item, item)


def intern_sds(writer, s, path) -> int:
    """Index of ShapeDtypeStruct ``s`` in the arrays table.  (Repeats within
    a payload are caught before this by ``sds_key``; equal entries also
    share one index through the table's own interning.)"""
    if "aval" not in writer.required:
        writer.require("aval", path)
    try:
        sharding = s.sharding
    except (TypeError, ValueError) as e:  # a PartitionSpec with no mesh set
        raise EncodeError(f"ShapeDtypeStruct sharding: {e}",
                          path + ".sharding") from None
    sharding_ref = 0
    if sharding is not None:
        if not isinstance(sharding, jax.sharding.Sharding):
            raise EncodeError(
                f"ShapeDtypeStruct sharding {sharding!r} is not a Sharding",
                path + ".sharding")
        sharding_ref = 1 + intern_sharding(writer, sharding, path + ".sharding")
    is_ref = getattr(s, "is_ref", False)
    flags = ((ArrayFlags.weak_type if s.weak_type else 0) |
             (ArrayFlags.is_ref if is_ref else 0))
    return intern_array(writer, s.shape, s.dtype, flags, sharding_ref,
                        getattr(s, "manual_axis_type", None), path,
                        getattr(s, "_dll", None), keep_empty_mat=True)


# Per-payload dedup key of a ShapeDtypeStruct: its stored attributes.  Equal
# keys intern to the same entry within one payload (a PartitionSpec sharding
# resolves against the same context mesh throughout one encode).
sds_key = operator.attrgetter("shape", "dtype", "_sharding", "_dll",
                              "weak_type", "is_ref", "manual_axis_type")


def _is_default_sharding(aval) -> bool:
    s = aval.sharding
    return s.mesh.empty and all(p is None for p in s.spec)


def intern_shaped_array(writer, aval, path) -> int:
    writer.require("aval", path)
    memo = writer.memo
    hit = memo.get(id(aval))
    if hit is not None and hit[0] is aval:
        return hit[1]
    mem = _MEMORY_FLAGS.get(aval.memory_space)
    if mem is None:
        raise EncodeError(f"unsupported memory space {aval.memory_space!r}",
                          path)
    sharding_ref = 0 if _is_default_sharding(aval) else \
        1 + intern_sharding(writer, aval.sharding, path + ".sharding")
    flags = (ArrayFlags.weak_type if aval.weak_type else 0) | mem
    i = intern_array(writer, aval.shape, aval.dtype, flags, sharding_ref,
                     aval.manual_axis_type, path)
    memo[id(aval)] = (aval, i)
    return i


def build_arrays(writer, builder, items) -> int:
    """The ArraySpecs table of all interned entries (bottom-up)."""
    extras = []
    for i, (dims, sym, scope_ref, _, _, _, mat, lay) in enumerate(items):
        if sym or mat is not None or lay is not None:
            extras.append((i, sym, scope_ref, mat, lay))
    extra_offs = []
    for i, sym, scope_ref, mat, lay in extras:
        sym_off = string_vector(builder, sym) if sym else 0
        mat_off = _build_mat(builder, mat)
        layout_off = build_layout(builder, lay) if lay is not None else 0
        fb.ArraySpecExtraStart(builder)
        fb.ArraySpecExtraAddEntry(builder, i)
        if sym_off:
            fb.ArraySpecExtraAddSymbolicDims(builder, sym_off)
        if scope_ref:
            fb.ArraySpecExtraAddScope(builder, scope_ref)
        if mat_off:
            fb.ArraySpecExtraAddManualAxisType(builder, mat_off)
        if layout_off:
            fb.ArraySpecExtraAddLayout(builder, layout_off)
        extra_offs.append(fb.ArraySpecExtraEnd(builder))
    extras_off = 0
    if extra_offs:
        extras_off = offset_vector(builder, extra_offs)
    ranks = builder.CreateByteVector(bytes(len(it[0]) for it in items))
    dims = builder.CreateNumpyVector(np.fromiter(
        itertools.chain.from_iterable(it[0] for it in items), np.int64))
    dtypes = builder.CreateNumpyVector(
        np.fromiter((it[3] for it in items), np.uint32, len(items)))
    shardings = builder.CreateNumpyVector(
        np.fromiter((it[4] for it in items), np.uint32, len(items)))
    flags = builder.CreateByteVector(bytes(it[5] for it in items))
    fb.ArraySpecsStart(builder)
    fb.ArraySpecsAddRanks(builder, ranks)
    fb.ArraySpecsAddDims(builder, dims)
    fb.ArraySpecsAddDtypes(builder, dtypes)
    fb.ArraySpecsAddShardings(builder, shardings)
    fb.ArraySpecsAddFlags(builder, flags)
    if extras_off:
        fb.ArraySpecsAddExtras(builder, extras_off)
    return fb.ArraySpecsEnd(builder)


# ------------------------------------------------------------ decoding

class ArrayColumns:
    """The checked columns of one payload's ArraySpecs table."""

    __slots__ = ("ranks", "starts", "dims", "dtypes", "shardings", "flags",
                 "extras", "path", "parsed")

    def __init__(self, t, path):
        self.path = path
        self.parsed = {}  # (symbolic dim text, scope ref) -> _DimExpr
        if t is None:
            self.ranks = self.dims = self.dtypes = self.shardings = ()
            self.flags, self.starts, self.extras = b"", (), {}
            return
        self.ranks = t.bytes(LA.ranks, path, "ranks") or b""
        n = len(self.ranks)
        self.dims = t.ints(LA.dims, "i64", path, "dims")
        self.dtypes = t.ints(LA.dtypes, "u32", path, "dtypes")
        self.shardings = t.ints(LA.shardings, "u32", path, "shardings")
        self.flags = t.bytes(LA.flags, path, "flags") or b""
        for name in ("dtypes", "shardings", "flags"):
            if len(getattr(self, name)) != n:
                raise PayloadError(
                    f"{len(getattr(self, name))} values for {n} entries",
                    f"{path}.{name}")
        self.starts = tuple(itertools.accumulate(self.ranks, initial=0))
        if self.starts[-1] != len(self.dims):
            raise PayloadError(f"ranks add up to {self.starts[-1]} but there "
                               f"are {len(self.dims)} dims", f"{path}.dims")
        self.extras = {}
        buf = t.buf
        for k, pos in enumerate(t.tables(LA.extras, path, "extras")):
            xpath = f"{path}.extras[{k}]"
            x = buf.table_at(pos, xpath)
            entry = x.scalar(LX.entry, "u32", 0, xpath, "entry")
            if entry >= n or entry in self.extras:
                raise PayloadError(f"entry {entry} is out of range or "
                                   "repeated", f"{xpath}.entry")
            self.extras[entry] = (x, xpath)

    def __len__(self):
        return len(self.ranks)


def open_arrays(reader, t, path) -> ArrayColumns:
    return ArrayColumns(t, path)


def _decode_shape(reader, cols, i, extra, path):
    dims = cols.dims[cols.starts[i]:cols.starts[i + 1]]
    n_sym = 0
    for k, d in enumerate(dims):
        if d < 0:
            if d != SYMBOLIC:
                raise PayloadError(f"negative dimension {d}",
                                   f"{cols.path}.dims[{cols.starts[i] + k}]")
            n_sym += 1
    if extra is None:
        if n_sym:
            raise PayloadError(f"{n_sym} symbolic dims but no extras entry",
                               path)
        return dims
    x, xpath = extra
    sym = x.strings(LX.symbolic_dims, xpath, "symbolic_dims")
    scope_ref = x.scalar(LX.scope, "u32", 0, xpath, "scope")
    if len(sym) != n_sym:
        raise PayloadError(f"{len(sym)} symbolic dims for {n_sym} markers",
                           f"{xpath}.symbolic_dims")
    if not n_sym:
        if scope_ref:
            raise PayloadError("a scope without symbolic dims",
                               f"{xpath}.scope")
        return dims
    if not scope_ref:
        raise PayloadError("symbolic dims without a scope", f"{xpath}.scope")
    scope = reader.get("scopes", scope_ref - 1, f"{xpath}.scope")
    it = iter(enumerate(sym))
    shape = []
    for d in dims:
        if d != SYMBOLIC:
            shape.append(d)
            continue
        k, text = next(it)
        key = (text, scope_ref)
        dim = cols.parsed.get(key)
        if dim is None:
            at = f"{xpath}.symbolic_dims[{k}]"
            parsed = parse_shape(text, scope, x.buf, at)
            if len(parsed) != 1 or not isinstance(parsed[0], _DimExpr):
                raise PayloadError(f"{text[:200]!r} is not one symbolic "
                                   "dimension", at)
            dim = cols.parsed[key] = parsed[0]
        shape.append(dim)
    return tuple(shape)


def _decode_parts(reader, cols, i, path):
    """(shape, dtype, flags, sharding ref, manual axis type, layout table
    and its path or None) of entry i."""
    flags = cols.flags[i]
    if flags & ~_KNOWN_FLAGS or (flags & _MEMORY_BITS) == _MEMORY_BITS:
        raise PayloadError(f"invalid ArrayFlags {flags:#x}", f"{path}.flags")
    extra = cols.extras.get(i)
    shape = _decode_shape(reader, cols, i, extra, path)
    dtype = reader.get("dtypes", cols.dtypes[i], f"{path}.dtype")
    mat = layout = None
    if extra is not None:
        x, xpath = extra
        mat = _decode_mat(x.table(LX.manual_axis_type, xpath,
                                  "manual_axis_type"),
                          f"{xpath}.manual_axis_type")
        t = x.table(LX.layout, xpath, "layout")
        if t is not None:
            reader.check_declared("layout", f"{xpath}.layout")
            layout = (t, f"{xpath}.layout")
    return shape, dtype, flags, cols.shardings[i], mat, layout


def decode_sds(reader, cols, i, path):
    shape, dtype, flags, sharding_ref, mat, layout = _decode_parts(
        reader, cols, i, path)
    if flags & _MEMORY_BITS:
        raise PayloadError("a ShapeDtypeStruct has no memory space",
                           f"{path}.flags")
    sharding = reader.get_optional("shardings", sharding_ref,
                                   f"{path}.sharding")
    if layout is not None:
        dll = decode_layout(layout[0], len(shape), layout[1])
        try:
            sharding = Format(dll, sharding)
        except Exception as e:  # a concrete layout needs a sharding
            raise PayloadError(f"invalid layout: {e}", layout[1]) from None
    try:
        return jax.ShapeDtypeStruct(
            shape, dtype, sharding=sharding,
            weak_type=bool(flags & ArrayFlags.weak_type),
            manual_axis_type=mat, is_ref=bool(flags & ArrayFlags.is_ref))
    except Exception as e:
        raise PayloadError(f"invalid ShapeDtypeStruct: {e}", path) from None


def decode_shaped_array(reader, cols, i, path):
    shape, dtype, flags, sharding_ref, mat, layout = _decode_parts(
        reader, cols, i, path)
    if layout is not None:
        raise PayloadError("a ShapedArray has no layout", layout[1])
    if flags & ArrayFlags.is_ref:
        raise PayloadError("a ShapedArray has no is_ref", f"{path}.flags")
    kw = {}
    sharding = reader.get_optional("shardings", sharding_ref,
                                   f"{path}.sharding")
    if sharding is not None:
        kw["sharding"] = sharding
        if mat is not None:
            kw["manual_axis_type"] = mat
    try:
        return core.ShapedArray(shape, dtype,
                                bool(flags & ArrayFlags.weak_type),
                                memory_space=_FLAGS_MEMORY[
                                    flags & _MEMORY_BITS], **kw)
    except Exception as e:
        raise PayloadError(f"invalid ShapedArray: {e}", path) from None


# ShapeDtypeStruct and ShapedArray leaves are two views of one column table.
register_columns("structs", "arrays", build_arrays, open_arrays, decode_sds)
register_columns("shaped_arrays", "arrays", None, open_arrays,
                 decode_shaped_array)
register_leaf((core.ShapedArray,), LeafKind.shaped_array, "shaped_arrays",
              intern_shaped_array)
register_leaf((jax.ShapeDtypeStruct,), LeafKind.shape_dtype_struct, "structs",
              intern_sds, key=sds_key)
