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
from jaxcolo.codec.symbolic import FREE_TRIAL_MARGIN, empty_scope, \
    legacy_or_current_charge, parse_shape, trial_parse_units, \
    trial_shape_units, writable_cost
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


class ShapeCharges:
    """The parse units readers will charge for the symbolic shapes of one
    JAX export payload, to hold against their budget for its size (see
    :func:`jaxcolo.wire.parse_budget`): each Exported of the vjp chain has
    its own AvalReader, which parses the dims of each distinct aval once, as
    one text.  Trial parses are made once per text."""

    def __init__(self):
        self.per_exported: list[dict] = []  # (dims, kind, mem) -> units
        self.checked: dict = {}  # dim text checked -> its trial's units

    def exported(self) -> dict:
        """The charges of the next Exported written."""
        self.per_exported.append({})
        return self.per_exported[-1]

    def total(self) -> int:
        return sum(sum(c.values()) for c in self.per_exported)


def _reader_parses(text: str) -> bool:
    """Whether a reader parses dim ``text`` (see AvalReader._shape)."""
    return not (text.isascii() and text.isdigit() and len(text) < 19)


def _shape_units(aval, dims, charges, path: str) -> int:
    """The units a reader charges for parsing ``aval``'s ``dims`` (0 if it
    reads them as plain integers); EncodeError if it would refuse or
    misread them (after the first time a text is seen: ``charges``)."""
    for d, text in zip(aval.shape, dims):
        if type(d) is int and 0 <= d < _INT64 or text in charges.checked:
            continue  # digits a reader takes, or already checked
        # (read back without constraints: the format has none)
        if writable_cost(text, f"{path}.shape").work_counted:  # a reader
            charges.checked[text] = trial_parse_units(  # counts its work
                text, empty_scope(), f"{path}.shape", d, FREE_TRIAL_MARGIN)
        else:
            charges.checked[text] = None
    if not any(map(_reader_parses, dims)):
        return 0
    # Readers parse all dims as one text: judged (and charged) as such.
    text = ",".join(dims)
    cost = writable_cost(text, f"{path}.shape")
    work = 0
    if cost.work_counted:  # JAX's work on it is counted too
        work = charges.checked.get(text)  # (one dim: its own trial)
        if work is None:
            work = trial_shape_units(text, f"{path}.shape", FREE_TRIAL_MARGIN)
    return sum(map(len, dims)) + len(dims) + \
        legacy_or_current_charge(cost, work, False)


def encode_aval(builder, aval, row, path: str = "$",
                charges: dict | None = None,
                all_charges: ShapeCharges | None = None) -> int:
    """Build one AbstractValue table the way JAX's writer of ``row`` does;
    its readers' parse charges go to ``charges`` (those of its Exported,
    from ``all_charges.exported()``)."""
    if all_charges is None:
        all_charges = ShapeCharges()
    if charges is None:
        charges = all_charges.exported()
    dims = [str(d) for d in aval.shape]
    shape_off = builder.offset_vector([builder.CreateString(t) for t in dims])
    kind = dtype_kind(aval.dtype, row, path)
    mem = _MEM_TO_FB.get(aval.memory_space)
    if mem is None:
        raise EncodeError(f"unsupported memory space {aval.memory_space}",
                          path)
    key = (tuple(dims), kind, mem)
    if key not in charges:
        charges[key] = _shape_units(aval, dims, all_charges, path)
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
