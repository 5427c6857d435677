"""Abstract values in JAX's export format: shape strings, DType, memory space.

Dtypes map through jaxcolo's dtype codec (its DType enum agrees with JAX's on
0..29).  Shapes are one string per dimension; symbolic dimensions are parsed
with JAX's own shape_poly parser in the scope shared by one Exported (JAX's
format has no room for constraints, so the scope has none, as in JAX).
"""

from __future__ import annotations

from jax._src import core
from jax._src.export import shape_poly

import jaxcolo_jax_export_fb as fb
from jaxcolo.codec.dtypes import describe, dtype_of_kind
from jaxcolo.codec.symbolic import empty_scope, parse_shape, \
    trial_parse_units, writable_text
from jaxcolo.errors import EncodeError, PayloadError
from jaxcolo.export.layouts import AVAL as L

_MS = fb.MemorySpace
_MEM_TO_FB = {core.MemorySpace.Device: _MS.Device,
              core.MemorySpace.Host: _MS.Host,
              core.MemorySpace.Any: _MS.Any}
_FB_TO_MEM = {v: k for k, v in _MEM_TO_FB.items()}
_FB_TO_MEM[_MS.Missing] = core.MemorySpace.Device

_KIND_CACHE: dict = {}   # dtype -> DType value


def dtype_kind(dtype, row, path: str) -> int:
    """JAX's DType value for ``dtype``, if version ``row`` can express it."""
    kind = _KIND_CACHE.get(dtype)
    if kind is None:
        try:
            kind = describe(dtype, path)[0]
        except EncodeError:
            kind = 255
        if kind > 29:
            raise EncodeError(f"dtype {dtype} has no JAX export encoding",
                              path)
        _KIND_CACHE[dtype] = kind
    if kind > row.max_dtype:
        raise EncodeError(f"dtype {dtype} needs a newer serialization version "
                          f"than {row.version}", path)
    return kind


# ------------------------------------------------------------------ encode

_INT64 = 1 << 63


def encode_aval(builder, aval, row, path: str = "$") -> int:
    """Build one AbstractValue table the way JAX's writer of ``row`` does."""
    dims = [str(d) for d in aval.shape]
    symbolic = False
    for d, text in zip(aval.shape, dims):
        if type(d) is int and 0 <= d < _INT64:  # digits a reader takes
            continue
        symbolic = True
        # (read back without constraints: the format has none)
        if writable_text(text, f"{path}.shape")[1]:  # a reader counts its
            trial_parse_units(text, empty_scope(), f"{path}.shape", d)  # work
    if symbolic:  # readers parse all dims as one text: judged as such too
        writable_text(",".join(dims), f"{path}.shape")  # (past the model?)
    shape_off = builder.offset_vector([builder.CreateString(t) for t in dims])
    kind = dtype_kind(aval.dtype, row, path)
    mem = _MEM_TO_FB.get(aval.memory_space)
    if mem is None:
        raise EncodeError(f"unsupported memory space {aval.memory_space}",
                          path)
    if not row.memory_space and mem != _MS.Device:
        raise EncodeError(f"memory space {aval.memory_space} needs "
                          f"serialization version >= 5", path)
    fb.AbstractValueStart(builder)
    fb.AbstractValueAddKind(builder, fb.AbstractValueKind.shapedArray)
    fb.AbstractValueAddShape(builder, shape_off)
    fb.AbstractValueAddDtype(builder, kind)
    if row.memory_space:
        fb.AbstractValueAddMemorySpace(builder, mem)
    return fb.AbstractValueEnd(builder)


# ------------------------------------------------------------------ decode

class AvalReader:
    """Decodes AbstractValue tables of one Exported, memoized by content."""

    __slots__ = ("buf", "scope", "memo")

    def __init__(self, buf):
        self.buf = buf
        self.scope = None
        self.memo: dict = {}

    def read(self, t, path: str):
        if t.scalar(L.kind, "u8", 0, path, "kind") != 0:
            raise PayloadError("only shapedArray avals exist",
                               f"{path}.kind")
        dims = tuple(t.strings(L.shape, path, "shape"))  # decoded once each
        kind = t.scalar(L.dtype, "u8", 0, path, "dtype")
        mem = t.scalar(L.memory_space, "u8", 0, path, "memory_space")
        key = (dims, kind, mem)
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        dtype = dtype_of_kind(kind) if kind <= 29 else None
        if dtype is None:
            raise PayloadError(f"unknown DType value {kind}", f"{path}.dtype")
        space = _FB_TO_MEM.get(mem)
        if space is None:
            raise PayloadError(f"unknown MemorySpace value {mem}",
                               f"{path}.memory_space")
        shape = self._shape(dims, path)
        try:
            aval = core.ShapedArray(shape, dtype, memory_space=space)
        except Exception as e:
            raise PayloadError(f"invalid aval: {e}", path) from None
        self.memo[key] = aval
        return aval

    def _shape(self, dims, path):
        shape = []
        symbolic = False
        for i, d in enumerate(dims):
            if d.isascii() and d.isdigit() and len(d) < 19:
                shape.append(int(d))
            else:
                symbolic = True
                break
        if not symbolic:
            return tuple(shape)
        # Charged before the join: dims may all be one long shared string.
        self.buf.charge_parse(sum(map(len, dims)) + len(dims), f"{path}.shape")
        text = ",".join(dims)
        if self.scope is None:
            self.scope = shape_poly.SymbolicScope(())
        shape = parse_shape(text, self.scope, self.buf, f"{path}.shape")
        if len(shape) != len(dims):
            raise PayloadError(f"shape {text!r} does not have {len(dims)} "
                               "dimensions", f"{path}.shape")
        for d in shape:
            if isinstance(d, int) and d < 0:
                raise PayloadError(f"negative dimension {d}", f"{path}.shape")
        return shape
