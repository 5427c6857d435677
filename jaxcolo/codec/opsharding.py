"""Strict checking of untrusted OpSharding proto bytes.

``xla_client.HloSharding.from_proto`` aborts the whole process (a C++ CHECK)
on some inconsistent protos, so bytes from a payload are never handed to it
directly: the visible fields are parsed and checked here, a clean proto is
rebuilt from them, and the payload bytes must equal that clean proto's
serialization (jaxcolo writes exactly that canonical form).
"""

from __future__ import annotations

from jax._src.lib import xla_client as xc

from jaxcolo.errors import EncodeError, PayloadError
from jaxcolo.wire import bounded_product

T = xc.OpSharding.Type
MAX_TILES = 1 << 20


def canonical_proto(hlo, path: str = "$"):
    """The canonical OpSharding proto of an HloSharding (jaxcolo writes its
    bytes); EncodeError unless a reader accepts it and it holds all of
    ``hlo``."""
    clean = _clean(hlo.to_proto())
    try:
        _check(clean, path)
    except PayloadError as e:
        raise EncodeError(f"HloSharding {hlo} is not supported: {e.reason}",
                          path) from None
    if xc.HloSharding.from_proto(clean) != hlo:  # e.g. shard groups
        raise EncodeError(f"HloSharding {hlo} has parts the schema cannot "
                          "express (only the tile assignment, subgroup types "
                          "and replication are stored)", path)
    return clean


def check_writable(op, path: str = "$") -> None:
    """EncodeError unless readers accept OpSharding proto ``op`` (as
    ``parse_foreign`` checks it): what a writer puts in a foreign-format
    payload must read back."""
    try:
        _check(op, path)
    except PayloadError as e:
        raise EncodeError(f"the HloSharding cannot be read back: {e.reason}",
                          path) from None


def _clean(op):
    clean = xc.OpSharding()
    clean.type = op.type
    clean.tile_assignment_dimensions = list(op.tile_assignment_dimensions)
    clean.tile_assignment_devices = list(op.tile_assignment_devices)
    clean.iota_reshape_dims = list(op.iota_reshape_dims)
    clean.iota_transpose_perm = list(op.iota_transpose_perm)
    clean.replicate_on_last_tile_dim = op.replicate_on_last_tile_dim
    # The repeated enum reads back as ints but only takes enum members.
    clean.last_tile_dims = [T(t) for t in op.last_tile_dims]
    return clean


def _check(op, path: str) -> None:
    kind = op.type
    dims = list(op.tile_assignment_dimensions)
    devs = list(op.tile_assignment_devices)
    iota = list(op.iota_reshape_dims)
    perm = list(op.iota_transpose_perm)
    last = list(op.last_tile_dims)
    if list(op.tuple_shardings):
        raise PayloadError("tuple OpShardings are not array shardings", path)
    if kind in (T.REPLICATED, T.MANUAL, T.UNREDUCED, T.UNKNOWN):
        if dims or devs or iota or perm or last or op.replicate_on_last_tile_dim:
            raise PayloadError(f"{kind} sharding with tile assignment", path)
        return
    if kind == T.MAXIMAL:
        if len(devs) != 1 or devs[0] < 0 or dims or iota or perm:
            raise PayloadError("maximal sharding needs exactly one device",
                               path)
        if last or op.replicate_on_last_tile_dim:
            raise PayloadError("maximal sharding with subgroups", path)
        return
    if kind != T.OTHER:
        raise PayloadError(f"unsupported OpSharding type {kind}", path)
    if not dims or any(d < 1 for d in dims):
        raise PayloadError(f"bad tile assignment dimensions {dims[:16]}",
                           path)
    n = bounded_product(dims, MAX_TILES)
    if n is None:
        raise PayloadError(f"tile assignment dimensions {dims[:16]} make "
                           f"more than {MAX_TILES} tiles", path)
    if devs:
        if iota or perm:
            raise PayloadError("both device list and iota tile assignment",
                               path)
        if len(devs) != n or sorted(devs) != list(range(n)):
            raise PayloadError(
                f"tile assignment devices must be a permutation of 0..{n - 1}",
                path)
    else:
        if not iota or any(d < 1 for d in iota) or \
                bounded_product(iota, n) != n:
            raise PayloadError(f"iota dims {iota[:16]} do not cover {n} "
                               "tiles", path)
        if sorted(perm) != list(range(len(iota))):
            raise PayloadError(f"iota transpose {perm} is not a permutation",
                               path)
    extra = len(last) + (1 if op.replicate_on_last_tile_dim else 0)
    if op.replicate_on_last_tile_dim and last:
        raise PayloadError("both replicate_on_last_tile_dim and "
                           "last_tile_dims", path)
    if extra >= len(dims) and not (extra == len(dims) == 1
                                   and op.replicate_on_last_tile_dim):
        raise PayloadError("more subgroup dims than tile dims", path)
    if any(t not in (T.REPLICATED, T.MANUAL, T.MAXIMAL, T.UNREDUCED)
           for t in last):
        raise PayloadError(f"bad last tile dim types {last}", path)


def _parse_checked(blob: bytes, path: str):
    """The OpSharding proto in ``blob``, structurally checked."""
    op = xc.OpSharding()
    try:
        op.ParseFromString(blob)
    except Exception as e:
        raise PayloadError(f"invalid OpSharding proto: {e}", path) from None
    try:
        _check(op, path)
    except PayloadError:
        raise
    except ValueError as e:  # e.g. an enum value outside OpSharding.Type
        raise PayloadError(f"invalid OpSharding: {e}", path) from None
    return op


def parse_proto(blob: bytes, path: str):
    """(HloSharding, its checked canonical OpSharding proto) from canonical
    OpSharding bytes, or PayloadError."""
    clean = _clean(_parse_checked(blob, path))
    if clean.SerializeToString() != blob:
        raise PayloadError("OpSharding has fields jaxcolo does not accept "
                           "(not in canonical form)", path)
    try:
        return xc.HloSharding.from_proto(clean), clean
    except Exception as e:
        raise PayloadError(f"invalid OpSharding: {e}", path) from None


def parse_foreign(blob: bytes, path: str):
    """An HloSharding from OpSharding bytes written by someone else (JAX).

    Same checks as :func:`parse_proto`, but fields jaxcolo does not write (e.g.
    metadata) are dropped instead of rejected: the sharding is rebuilt from
    the checked fields only, so ``from_proto`` never sees unchecked input.
    """
    op = _parse_checked(blob, path)
    clean = _clean(op)
    if op.is_shard_group:  # kept: JAX reads it (shard_as / shard_like)
        try:
            kind = op.shard_group_type
        except ValueError as e:  # a value outside ShardGroupType
            raise PayloadError(f"invalid OpSharding shard group: {e}",
                               path) from None
        clean.is_shard_group = True
        clean.shard_group_id = op.shard_group_id
        clean.shard_group_type = kind
    try:
        return xc.HloSharding.from_proto(clean)
    except Exception as e:
        raise PayloadError(f"invalid OpSharding: {e}", path) from None
