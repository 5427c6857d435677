"""Dtypes: every JAX 0.10.2 dtype, PRNG key dtypes and numpy StringDType.

Encoded as a DTypeSpec table: the DType enum, plus the PRNG impl name for
keys of user-registered impls and the options of a StringDType.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
from jax._src import dtypes as jdtypes
from jax._src.random import prng

import jaxcolo_fb as fb
from jaxcolo_fb import DType
from jaxcolo_fb import LeafKind
from jaxcolo_fb import StringNA
from jaxcolo.codec.core import register_leaf, register_table
from jaxcolo.errors import EncodeError, PayloadError, UnregisteredError
from jaxcolo.wire import check_enum, enum_values, layout

L = layout(fb, "DTypeSpec")
_DTYPE_VALUES = enum_values(DType)
_STRING_NA_VALUES = enum_values(StringNA)

_NUMERIC: dict[int, np.dtype] = {
    DType.bool: np.dtype("bool"),
    DType.i8: np.dtype("int8"), DType.i16: np.dtype("int16"),
    DType.i32: np.dtype("int32"), DType.i64: np.dtype("int64"),
    DType.ui8: np.dtype("uint8"), DType.ui16: np.dtype("uint16"),
    DType.ui32: np.dtype("uint32"), DType.ui64: np.dtype("uint64"),
    DType.f16: np.dtype("float16"), DType.f32: np.dtype("float32"),
    DType.f64: np.dtype("float64"),
    DType.c64: np.dtype("complex64"), DType.c128: np.dtype("complex128"),
    DType.bf16: np.dtype(ml_dtypes.bfloat16),
    DType.i1: np.dtype(ml_dtypes.int1), DType.i2: np.dtype(ml_dtypes.int2),
    DType.i4: np.dtype(ml_dtypes.int4),
    DType.ui1: np.dtype(ml_dtypes.uint1), DType.ui2: np.dtype(ml_dtypes.uint2),
    DType.ui4: np.dtype(ml_dtypes.uint4),
    DType.f8_e4m3b11fnuz: np.dtype(ml_dtypes.float8_e4m3b11fnuz),
    DType.f8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    DType.f8_e4m3fnuz: np.dtype(ml_dtypes.float8_e4m3fnuz),
    DType.f8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
    DType.f8_e5m2fnuz: np.dtype(ml_dtypes.float8_e5m2fnuz),
    DType.f8_e4m3: np.dtype(ml_dtypes.float8_e4m3),
    DType.f8_e3m4: np.dtype(ml_dtypes.float8_e3m4),
    DType.f8_e8m0fnu: np.dtype(ml_dtypes.float8_e8m0fnu),
    DType.f6_e2m3fn: np.dtype(ml_dtypes.float6_e2m3fn),
    DType.f6_e3m2fn: np.dtype(ml_dtypes.float6_e3m2fn),
    DType.f4_e2m1fn: np.dtype(ml_dtypes.float4_e2m1fn),
    DType.f0: jdtypes.float0,
}
_NUMERIC_TO_KIND = {dt: kind for kind, dt in _NUMERIC.items()}
_KEY_KINDS = {"threefry2x32": DType.key_fry, "rbg": DType.key_rbg,
              "unsafe_rbg": DType.key_unsafe_rbg}
_KIND_TO_KEY = {v: k for k, v in _KEY_KINDS.items()}
_STRING_DTYPE = np.dtypes.StringDType


def dtype_key(dtype) -> tuple:
    """A hashable identity for a dtype (StringDType options included)."""
    if isinstance(dtype, _STRING_DTYPE):
        na = getattr(dtype, "na_object", _ABSENT)
        if isinstance(na, float) and math.isnan(na):
            na = ("nan",)
        return ("string", dtype.coerce, na if na is not _ABSENT else ("absent",))
    if isinstance(dtype, prng.KeyTy):
        return ("key", dtype._impl.name)
    return ("np", dtype)


_ABSENT = object()


def describe(dtype, path: str) -> tuple:
    """(kind, prng_impl_name, coerce, na_kind, na_text) for a dtype, or raise."""
    from jaxcolo.errors import EncodeError
    if isinstance(dtype, _STRING_DTYPE):
        na = getattr(dtype, "na_object", _ABSENT)
        if na is _ABSENT:
            na_kind, text = StringNA.absent, None
        elif na is None:
            na_kind, text = StringNA.none, None
        elif isinstance(na, float) and math.isnan(na):
            na_kind, text = StringNA.nan, None
        elif isinstance(na, str):
            na_kind, text = StringNA.text, na
        else:
            raise EncodeError(
                f"StringDType na_object {na!r} is not serializable (supported: "
                "absent, None, nan or a str)", path)
        return DType.string, None, bool(dtype.coerce), na_kind, text
    if isinstance(dtype, prng.KeyTy):
        name = dtype._impl.name
        if prng.prngs.get(name) is not dtype._impl:
            raise EncodeError(
                f"PRNG key dtype {dtype} uses an impl {name!r} that is not "
                "registered with jax (prng.register_prng)", path)
        kind = _KEY_KINDS.get(name, DType.key_named)
        return kind, (name if kind == DType.key_named else None), True, 0, None
    try:
        kind = _NUMERIC_TO_KIND[np.dtype(dtype)]
    except (TypeError, KeyError):
        raise EncodeError(f"unsupported dtype {dtype!r}", path) from None
    return kind, None, True, 0, None


def build_dtype_spec(builder, dtype, path: str) -> int:
    kind, impl, coerce, na_kind, text = describe(dtype, path)
    impl_off = builder.CreateSharedString(impl) if impl is not None else 0
    text_off = builder.CreateSharedString(text) if text is not None else 0
    fb.DTypeSpecStart(builder)
    fb.DTypeSpecAddKind(builder, kind)
    if impl_off:
        fb.DTypeSpecAddPrngImpl(builder, impl_off)
    if kind == DType.string:
        fb.DTypeSpecAddStringCoerce(builder, coerce)
        fb.DTypeSpecAddStringNa(builder, na_kind)
        if text_off:
            fb.DTypeSpecAddStringNaText(builder, text_off)
    return fb.DTypeSpecEnd(builder)


def decode_dtype_spec(t, path: str):
    kind = check_enum(t.scalar(L.kind, "u8", 0, path, "kind"), _DTYPE_VALUES,
                      f"{path}.kind", "DType")
    dt = _NUMERIC.get(kind)
    if dt is not None:
        return dt
    if kind == DType.string:
        coerce = bool(t.scalar(L.string_coerce, "bool", 1, path, "string_coerce"))
        na_kind = check_enum(t.scalar(L.string_na, "u8", 0, path, "string_na"),
                             _STRING_NA_VALUES, f"{path}.string_na", "StringNA")
        if na_kind == StringNA.absent:
            return _STRING_DTYPE(coerce=coerce)
        if na_kind == StringNA.none:
            return _STRING_DTYPE(na_object=None, coerce=coerce)
        if na_kind == StringNA.nan:
            return _STRING_DTYPE(na_object=np.nan, coerce=coerce)
        text = t.string(L.string_na_text, path, "string_na_text")
        if text is None:
            raise PayloadError("StringDType na text missing",
                               f"{path}.string_na_text")
        return _STRING_DTYPE(na_object=text, coerce=coerce)
    if kind == DType.key_named:
        name = t.string(L.prng_impl, path, "prng_impl")
        if name is None:
            raise PayloadError("PRNG impl name missing", f"{path}.prng_impl")
    else:
        name = _KIND_TO_KEY[kind]
    impl = prng.prngs.get(name)
    if impl is None:
        raise UnregisteredError(
            f"PRNG impl {name!r} is not registered in this process",
            f"{path}.prng_impl")
    return prng.KeyTy(impl)


# A dtype as a leaf of a spec tree.

def _build_dtype_entry(writer, builder, dtype):
    return build_dtype_spec(builder, dtype, "$")


def _decode_dtype_entry(reader, t, path):
    return decode_dtype_spec(t, path)


def intern_dtype(writer, dtype, path) -> int:
    """Index of ``dtype`` in the payload's dtypes table (EncodeError with
    ``path`` for a dtype the schema cannot express)."""
    seen = writer.dtype_refs  # dtype -> index, for this payload
    try:
        i = seen.get(dtype)
    except TypeError:
        i = None
    if i is not None:
        return i

    def make():
        describe(dtype, path)  # fail here, with the path, not when building
        return dtype
    try:
        key = dtype_key(dtype)
        hash(key)
    except TypeError:
        describe(dtype, path)
        raise EncodeError(f"unsupported dtype {dtype!r}", path) from None
    i = writer.intern("dtypes", key, make=make)
    try:
        seen[dtype] = i
    except TypeError:
        pass
    return i


def _intern_dtype_leaf(writer, dtype, path):
    writer.require("dtype", path)
    return intern_dtype(writer, dtype, path)


register_table("dtypes", _build_dtype_entry, _decode_dtype_entry)
register_leaf((np.dtype, prng.KeyTy), LeafKind.dtype, "dtypes", _intern_dtype_leaf,
              subclasses=True)


def dtype_of_kind(kind: int):
    """The dtype of a DType enum value, or None if unknown here.

    Values 0..29 are also jax.export's DType values (used by jaxcolo.export).
    """
    dt = _NUMERIC.get(kind)
    if dt is not None:
        return dt
    name = _KIND_TO_KEY.get(kind)
    impl = prng.prngs.get(name) if name is not None else None
    return prng.KeyTy(impl) if impl is not None else None
