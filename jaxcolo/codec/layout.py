"""Array layouts: the ``Layout`` of a ShapeDtypeStruct built with
``sharding=jax.experimental.layout.Format(layout, sharding)`` (schema v4).

A layout travels as an ``ArrayLayout`` table inside the array entry's
``ArraySpecExtra``: a concrete ``Layout`` (major-to-minor permutation,
optional tiling, sub-byte element size); JAX does not allow ``Layout.AUTO``
in a ShapeDtypeStruct.  Writing one at a
version before 4 is an EncodeError, never a silent drop.
"""

from __future__ import annotations

import numpy as np
from jax._src.layout import Layout
import jaxcolo_fb as fb
from jaxcolo.errors import EncodeError, PayloadError
from jaxcolo.fastbuilder import offset_vector
from jaxcolo.wire import layout as field_layout

LL = field_layout(fb, "ArrayLayout")
LT = field_layout(fb, "LayoutTile")
MAX_TILES = 16
MAX_TILE_RANK = 16
_I64 = (-(1 << 63), (1 << 63) - 1)
_I32 = (-(1 << 31), (1 << 31) - 1)


def _int(x, lo_hi, what, path) -> int:
    if isinstance(x, bool) or not hasattr(x, "__index__"):
        raise EncodeError(f"layout {what} {x!r} is not an integer", path)
    x = int(x)
    if not lo_hi[0] <= x <= lo_hi[1]:
        raise EncodeError(f"layout {what} {x} is out of range", path)
    return x


def layout_item(writer, dll, rank: int, path: str):
    """The hashable item of layout ``dll`` for an array of ``rank``
    (None for no layout); EncodeError if it cannot be written."""
    if dll is None:
        return None
    writer.require("layout", path)
    if not isinstance(dll, Layout):
        raise EncodeError(f"unsupported layout {dll!r}", path)
    m2m = tuple(_int(d, (0, rank - 1) if rank else (0, -1), "dimension",
                     path) for d in dll.major_to_minor)
    if sorted(m2m) != list(range(rank)):
        raise EncodeError(f"major_to_minor {m2m} is not a permutation of "
                          f"the {rank} dims", path)
    tiling = None
    if dll.tiling is not None:
        if len(dll.tiling) > MAX_TILES:  # what decode_layout refuses
            raise EncodeError(f"{len(dll.tiling)} tiles (at most "
                              f"{MAX_TILES})", f"{path}.tiling")
        for k, tile in enumerate(dll.tiling):
            if len(tile) > MAX_TILE_RANK:
                raise EncodeError(f"tile of rank {len(tile)} (at most "
                                  f"{MAX_TILE_RANK})", f"{path}.tiling[{k}]")
        tiling = tuple(tuple(_int(d, _I64, "tile size", path) for d in tile)
                       for tile in dll.tiling)
    sub_byte = _int(dll.sub_byte_element_size_in_bits, _I32,
                    "sub_byte_element_size_in_bits", path)
    return (m2m, tiling, sub_byte)


def build_layout(builder, item) -> int:
    """The ArrayLayout table of a non-None layout item (bottom-up)."""
    m2m, tiling, sub_byte = item
    tiles_off = 0
    if tiling is not None:
        offs = []
        for tile in tiling:
            dims = builder.CreateNumpyVector(_array(tile, "<i8"))
            fb.LayoutTileStart(builder)
            fb.LayoutTileAddDims(builder, dims)
            offs.append(fb.LayoutTileEnd(builder))
        tiles_off = offset_vector(builder, offs)
    m2m_off = builder.CreateNumpyVector(_array(m2m, "<u4"))
    fb.ArrayLayoutStart(builder)
    fb.ArrayLayoutAddMajorToMinor(builder, m2m_off)
    if tiling is not None:
        fb.ArrayLayoutAddHasTiling(builder, True)
        fb.ArrayLayoutAddTiling(builder, tiles_off)
    fb.ArrayLayoutAddSubByteElementSizeInBits(builder, sub_byte)
    return fb.ArrayLayoutEnd(builder)


def _array(values, dtype):
    return np.asarray(values, np.dtype(dtype)).reshape(-1)


def decode_layout(t, rank: int, path: str):
    """The Layout of ArrayLayout table ``t`` for an array of ``rank``;
    PayloadError naming the field if it is malformed."""
    m2m = t.ints(LL.major_to_minor, "u32", path, "major_to_minor")
    if sorted(m2m) != list(range(rank)):
        raise PayloadError(f"major_to_minor {tuple(m2m)} is not a "
                           f"permutation of the {rank} dims",
                           f"{path}.major_to_minor")
    tiling = None
    tile_pos = t.tables(LL.tiling, path, "tiling")
    if t.scalar(LL.has_tiling, "bool", False, path, "has_tiling"):
        if len(tile_pos) > MAX_TILES:
            raise PayloadError(f"{len(tile_pos)} tiles (at most {MAX_TILES})",
                               f"{path}.tiling")
        tiles = []
        for k, pos in enumerate(tile_pos):
            tpath = f"{path}.tiling[{k}]"
            dims = t.buf.table_at(pos, tpath).ints(LT.dims, "i64", tpath,
                                                   "dims")
            if len(dims) > MAX_TILE_RANK:
                raise PayloadError(f"tile of rank {len(dims)} (at most "
                                   f"{MAX_TILE_RANK})", f"{tpath}.dims")
            tiles.append(tuple(dims))
        tiling = tuple(tiles)
    elif tile_pos:
        raise PayloadError("tiles given but has_tiling is false",
                           f"{path}.tiling")
    sub_byte = t.scalar(LL.sub_byte_element_size_in_bits, "i32", 0, path,
                        "sub_byte_element_size_in_bits")
    return Layout(tuple(m2m), tiling, sub_byte)
