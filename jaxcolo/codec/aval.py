"""Abstract values: core.ShapedArray and jax.ShapeDtypeStruct.

Shapes may hold symbolic dimensions (jax.export shape polymorphism).  They are
written as JAX spells them and parsed back with JAX's own shape_poly parser in
a SymbolicScope rebuilt from the stored constraints.  Scopes are interned by
their constraints within a process, so a round trip in one process gives dims
that compare equal to the originals (JAX compares dims by scope identity).
"""

from __future__ import annotations

import weakref

import jax
import numpy as np
from jax._src import core
from jax._src.export import shape_poly

import jaxcolo_fb as fb
from jaxcolo_fb import LeafKind
from jaxcolo_fb import MemorySpace as FbMemorySpace
from jaxcolo.codec.core import register_leaf, register_table
from jaxcolo.codec.dtypes import build_dtype_spec, decode_dtype_spec, dtype_key
from jaxcolo.codec.pytree import _string_vector
from jaxcolo.codec.sharding import intern_sharding
from jaxcolo.errors import EncodeError, PayloadError
from jaxcolo.wire import layout

LA = layout(fb, "Aval")
LS = layout(fb, "ShapeDtypeStruct")
LM = layout(fb, "ManualAxisType")
LC = layout(fb, "SymbolicScope")

_MEM_TO_FB = {core.MemorySpace.Device: FbMemorySpace.Device,
              core.MemorySpace.Host: FbMemorySpace.Host,
              core.MemorySpace.Any: FbMemorySpace.Any}
_FB_TO_MEM = {v: k for k, v in _MEM_TO_FB.items()}
_EMPTY_MAT = core.ManualAxisType()
_DimExpr = shape_poly._DimExpr
SYMBOLIC = -1

# ----------------------------------------------------------------- scopes

_SCOPES: "weakref.WeakValueDictionary[tuple, shape_poly.SymbolicScope]" = \
    weakref.WeakValueDictionary()


def scope_constraints(scope) -> tuple:
    return tuple(c.debug_str for c in scope._explicit_constraints)


def _register_scope(scope) -> tuple:
    key = scope_constraints(scope)
    if _SCOPES.get(key) is not scope:
        _SCOPES[key] = scope  # the latest encoded scope wins
    return key


def scope_for(constraints: tuple, path: str):
    """The live scope with these constraints, or a new one."""
    scope = _SCOPES.get(constraints)
    if scope is None:
        try:
            scope = shape_poly.SymbolicScope(constraints)
        except Exception as e:
            raise PayloadError(f"invalid symbolic constraints: {e}",
                               path) from None
        _SCOPES[constraints] = scope
    return scope


def build_scope(writer, builder, constraints) -> int:
    off = _string_vector(builder, constraints)
    fb.SymbolicScopeStart(builder)
    fb.SymbolicScopeAddConstraints(builder, off)
    return fb.SymbolicScopeEnd(builder)


def decode_scope(reader, t, path):
    return scope_for(tuple(t.strings(LC.constraints, path, "constraints")),
                     f"{path}.constraints")


# ------------------------------------------------------------------- avals

def _mat_item(mat):
    if mat is None or mat == _EMPTY_MAT:
        return None
    return (sorted(mat.varying), sorted(mat.unreduced), sorted(mat.reduced))


def _build_mat(builder, item) -> int:
    if item is None:
        return 0
    offs = [_string_vector(builder, v) if v else 0 for v in item]
    fb.ManualAxisTypeStart(builder)
    for add, off in zip((fb.ManualAxisTypeAddVarying, fb.ManualAxisTypeAddUnreduced,
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


def _shape_item(writer, shape, path):
    dims, sym, scope_ref = [], [], 0
    for d in shape:
        if type(d) is int or isinstance(d, (int, np.integer)):
            if d < 0:
                raise EncodeError(f"negative dimension {d}", path)
            dims.append(int(d))
        elif isinstance(d, _DimExpr):
            dims.append(SYMBOLIC)
            sym.append(str(d))
            key = _register_scope(d.scope)
            ref = 1 + writer.intern("scopes", key, key)
            if scope_ref and ref != scope_ref:
                raise EncodeError("symbolic dims from different scopes in one "
                                  "shape", path)
            scope_ref = ref
        else:
            raise EncodeError(f"unsupported dimension {d!r}", path)
    return dims, sym, scope_ref


def aval_item(writer, shape, dtype, weak_type, memory_space, sharding_ref,
              mat, path):
    dims, sym, scope_ref = _shape_item(writer, shape, path)
    mem = _MEM_TO_FB.get(memory_space)
    if mem is None:
        raise EncodeError(f"unsupported memory space {memory_space!r}", path)
    return (dims, sym, scope_ref, dtype, bool(weak_type), mem, sharding_ref,
            _mat_item(mat))


def build_aval(writer, builder, item) -> int:
    dims, sym, scope_ref, dtype, weak_type, mem, sharding_ref, mat = item
    dtype_off = build_dtype_spec(builder, dtype, "$.avals")
    sym_off = _string_vector(builder, sym) if sym else 0
    mat_off = _build_mat(builder, mat)
    dims_off = builder.CreateNumpyVector(np.asarray(dims, np.int64))
    fb.AvalStart(builder)
    fb.AvalAddDims(builder, dims_off)
    if sym_off:
        fb.AvalAddSymbolicDims(builder, sym_off)
    fb.AvalAddScope(builder, scope_ref)
    fb.AvalAddDtype(builder, dtype_off)
    fb.AvalAddWeakType(builder, weak_type)
    fb.AvalAddMemorySpace(builder, mem)
    fb.AvalAddSharding(builder, sharding_ref)
    if mat_off:
        fb.AvalAddManualAxisType(builder, mat_off)
    return fb.AvalEnd(builder)


def _decode_shape(reader, t, path):
    dims = t.ints(LA.dims, "i64", path, "dims")
    n_sym = dims.count(SYMBOLIC)
    if not n_sym:
        for d in dims:
            if d < 0:
                raise PayloadError(f"negative dimension {d}", f"{path}.dims")
        return dims
    sym = t.strings(LA.symbolic_dims, path, "symbolic_dims")
    if len(sym) != n_sym:
        raise PayloadError(f"{len(sym)} symbolic dims for {n_sym} markers",
                           f"{path}.symbolic_dims")
    scope_ref = t.scalar(LA.scope, "u32", 0, path, "scope")
    scope = (reader.get("scopes", scope_ref - 1, f"{path}.scope")
             if scope_ref else scope_for((), path))
    it = iter(sym)
    shape = []
    for i, d in enumerate(dims):
        if d == SYMBOLIC:
            text = next(it)
            try:
                parsed = shape_poly.symbolic_shape(text, scope=scope)
            except Exception as e:  # syntax errors, absurd nesting
                raise PayloadError(f"invalid symbolic dim {text!r}: {e}",
                                   f"{path}.symbolic_dims") from None
            if len(parsed) != 1:
                raise PayloadError(f"{text!r} is not one dimension",
                                   f"{path}.symbolic_dims")
            shape.append(parsed[0])
        elif d < 0:
            raise PayloadError(f"negative dimension {d}", f"{path}.dims[{i}]")
        else:
            shape.append(d)
    return tuple(shape)


def decode_aval_parts(reader, t, path):
    """(shape, dtype, weak_type, memory_space, sharding, manual_axis_type)."""
    shape = _decode_shape(reader, t, path)
    dt = t.table(LA.dtype, path, "dtype")
    if dt is None:
        raise PayloadError("dtype missing", f"{path}.dtype")
    dtype = decode_dtype_spec(dt, f"{path}.dtype")
    weak = bool(t.scalar(LA.weak_type, "bool", 0, path, "weak_type"))
    mem_raw = t.scalar(LA.memory_space, "u8", 0, path, "memory_space")
    mem = _FB_TO_MEM.get(mem_raw)
    if mem is None:
        raise PayloadError(f"unknown MemorySpace value {mem_raw}",
                           f"{path}.memory_space")
    sharding = reader.get_optional(
        "shardings", t.scalar(LA.sharding, "u32", 0, path, "sharding"),
        f"{path}.sharding")
    mat = _decode_mat(t.table(LA.manual_axis_type, path, "manual_axis_type"),
                      f"{path}.manual_axis_type")
    return shape, dtype, weak, mem, sharding, mat


def decode_shaped_array(reader, t, path):
    shape, dtype, weak, mem, sharding, mat = decode_aval_parts(reader, t, path)
    kw = {}
    if sharding is not None:
        kw["sharding"] = sharding
        if mat is not None:
            kw["manual_axis_type"] = mat
    try:
        return core.ShapedArray(shape, dtype, weak, memory_space=mem, **kw)
    except Exception as e:
        raise PayloadError(f"invalid ShapedArray: {e}", path) from None


def _is_default_sharding(aval) -> bool:
    s = aval.sharding
    return s.mesh.empty and all(p is None for p in s.spec)


def intern_shaped_array(writer, aval, path) -> int:
    writer.require("aval", path)

    def make(a):
        sharding_ref = 0 if _is_default_sharding(a) else \
            1 + intern_sharding(writer, a.sharding, path + ".sharding")
        return aval_item(writer, a.shape, a.dtype, a.weak_type,
                         a.memory_space, sharding_ref, a.manual_axis_type, path)
    return writer.intern_obj("avals", aval, make)


# ------------------------------------------------------- ShapeDtypeStruct

def build_sds(writer, builder, item) -> int:
    aval_ref, sharding_ref, is_ref, mat = item
    mat_off = _build_mat(builder, mat)
    fb.ShapeDtypeStructStart(builder)
    fb.ShapeDtypeStructAddAval(builder, aval_ref)
    fb.ShapeDtypeStructAddSharding(builder, sharding_ref)
    fb.ShapeDtypeStructAddIsRef(builder, is_ref)
    if mat_off:
        fb.ShapeDtypeStructAddManualAxisType(builder, mat_off)
    return fb.ShapeDtypeStructEnd(builder)


def decode_sds(reader, t, path):
    aval_ref = t.scalar(LS.aval, "u32", 0, path, "aval")
    shape, dtype, weak, _, _, _ = reader.get("aval_parts", aval_ref,
                                             f"{path}.aval")
    sharding = reader.get_optional(
        "shardings", t.scalar(LS.sharding, "u32", 0, path, "sharding"),
        f"{path}.sharding")
    is_ref = bool(t.scalar(LS.is_ref, "bool", 0, path, "is_ref"))
    mat = _decode_mat(t.table(LS.manual_axis_type, path, "manual_axis_type"),
                      f"{path}.manual_axis_type")
    try:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding,
                                    weak_type=weak, manual_axis_type=mat,
                                    is_ref=is_ref)
    except Exception as e:
        raise PayloadError(f"invalid ShapeDtypeStruct: {e}", path) from None


def intern_sds(writer, s, path) -> int:
    writer.require("aval", path)

    def make(s):
        try:
            key = ("sds", tuple(s.shape), dtype_key(s.dtype), bool(s.weak_type))
            hash(key)
        except TypeError:
            raise EncodeError(f"unhashable shape {s.shape!r}", path) from None
        aval_ref = writer.intern("avals", key, make=lambda: aval_item(
            writer, s.shape, s.dtype, s.weak_type, core.MemorySpace.Device,
            0, None, path))
        sharding = s.sharding
        sharding_ref = 0
        if sharding is not None:
            if not isinstance(sharding, jax.sharding.Sharding):
                raise EncodeError(
                    f"ShapeDtypeStruct sharding {sharding!r} is not a "
                    "Sharding", path + ".sharding")
            sharding_ref = 1 + intern_sharding(writer, sharding,
                                               path + ".sharding")
        return (aval_ref, sharding_ref, bool(getattr(s, "is_ref", False)),
                _mat_item(getattr(s, "manual_axis_type", None)))
    return writer.intern_obj("structs", s, make)


# The aval table serves two readers: ShapedArray leaves decode the whole
# aval, ShapeDtypeStructs only its shape/dtype/weak_type parts.  Both are
# memoized per entry; "aval_parts" reads the same vector as "avals".

register_table("avals", build_aval, decode_shaped_array)
register_table("aval_parts", None, decode_aval_parts, field="avals")
register_table("scopes", build_scope, decode_scope)
register_table("structs", build_sds, decode_sds)
register_leaf((core.ShapedArray,), LeafKind.shaped_array, "avals",
              intern_shaped_array)
register_leaf((jax.ShapeDtypeStruct,), LeafKind.shape_dtype_struct, "structs",
              intern_sds)
