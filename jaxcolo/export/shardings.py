"""Shardings in JAX's export format: HloSharding protos (up to v8) and
NamedShardings over AbstractMeshes (from v6), with abstract devices (v8) and
their platform (v11).

Encoders mirror JAX's writer of each version operation for operation;
decoders check everything and build the JAX objects JAX's reader builds.
Untrusted OpSharding protos only reach XLA through jaxcolo's strict checker
(jaxcolo/codec/opsharding.py): XLA aborts the process on some bad protos.
"""

from __future__ import annotations

import math
import struct

from jax._src import mesh as jmesh
from jax._src import named_sharding as jnamed
from jax._src import partition_spec as jps
from jax._src.export import serialization as jser
from jax._src.lib import xla_client as xc

import jaxcolo_jax_export_fb as fb
from jaxcolo.codec import opsharding
from jaxcolo.codec.mesh import CACHED_NAMES_SIZE, MAX_MESH_AXES, names_size
from jaxcolo.errors import EncodeError, PayloadError
from jaxcolo.export.layouts import DEVICE as LD, MESH as LM, NAMED as LN, \
    SHARDING as LS, SPEC as LP, SPEC_AXIS as LA

_AT = fb.AxisType
AxisType = jmesh.AxisType
_AXIS_TO_FB = {AxisType.Auto: _AT.Auto, AxisType.Explicit: _AT.Explicit,
               AxisType.Manual: _AT.Manual}
_FB_TO_AXIS = {v: k for k, v in _AXIS_TO_FB.items()}
P = jps.PartitionSpec
MAX_MESH_DEVICES = 1 << 24
_CACHE_MAX = 512


def _strings(builder, items) -> int:
    return builder.offset_vector([builder.CreateString(s) for s in items])


def _tables(builder, offs) -> int:
    return builder.offset_vector(offs)


# ------------------------------------------------------- abstract device

def encode_abstract_device(builder, dev, row, path) -> int:
    if not row.device_platform:
        inferred = inferred_platform(dev.device_kind)
        if inferred != dev.platform:
            raise EncodeError(
                f"abstract device platform {dev.platform!r} differs from the "
                f"one readers infer from device kind {dev.device_kind!r} "
                f"({inferred!r}); it needs serialization version >= 11", path)
    kind = builder.CreateString(dev.device_kind)
    platform = builder.CreateString(dev.platform) if row.device_platform \
        else 0
    fb.AbstractDeviceStart(builder)
    fb.AbstractDeviceAddDeviceKind(builder, kind)
    if dev.num_cores is not None:
        fb.AbstractDeviceAddNumCores(builder, dev.num_cores)
    if platform:
        fb.AbstractDeviceAddPlatform(builder, platform)
    return fb.AbstractDeviceEnd(builder)


def inferred_platform(device_kind):
    try:
        return jser.get_platform_from_device_kind(device_kind)
    except ValueError:
        return None


def decode_abstract_device(t, path):
    kind = t.string(LD.device_kind, path, "device_kind")
    if kind is None:
        raise PayloadError("device_kind missing", f"{path}.device_kind")
    num_cores = t.scalar(LD.num_cores, "u32", None, path, "num_cores")
    platform = t.string(LD.platform, path, "platform")
    if not platform:
        platform = inferred_platform(kind)
        if platform is None:
            raise PayloadError(f"no platform, and none can be inferred from "
                               f"device kind {kind!r}", f"{path}.platform")
    return jmesh.AbstractDevice(kind, num_cores, platform)


# ---------------------------------------------------------- abstract mesh

def encode_abstract_mesh(builder, mesh, row, path) -> int:
    if len(mesh.axis_names) > MAX_MESH_AXES:
        raise EncodeError(f"{len(mesh.axis_names)} mesh axes, more than "
                          f"{MAX_MESH_AXES}", path + ".axis_names")
    if math.prod(mesh.axis_sizes) > MAX_MESH_DEVICES:  # as the reader
        raise EncodeError(f"mesh axis sizes {mesh.axis_sizes} make more than "
                          f"{MAX_MESH_DEVICES} devices", path + ".axis_sizes")
    try:
        sizes_off = builder.uint_vector(mesh.axis_sizes, 4)
    except struct.error:
        raise EncodeError(f"mesh axis sizes {mesh.axis_sizes} do not fit "
                          "uint32", path) from None
    names_off = _strings(builder, mesh.axis_names)
    try:
        types = bytes(_AXIS_TO_FB[t] for t in mesh.axis_types)
    except KeyError as e:
        raise EncodeError(f"unsupported axis type {e.args[0]}",
                          path) from None
    types_off = builder.CreateByteVector(types)
    dev = mesh.abstract_device
    dev_off = 0
    if dev is not None and row.abstract_device:  # before v8: not written
        dev_off = encode_abstract_device(builder, dev, row,
                                         path + ".abstract_device")
    fb.AbstractMeshStart(builder)
    fb.AbstractMeshAddAxisSizes(builder, sizes_off)
    fb.AbstractMeshAddAxisNames(builder, names_off)
    fb.AbstractMeshAddAxisTypes(builder, types_off)
    if dev_off:
        fb.AbstractMeshAddAbstractDevice(builder, dev_off)
    return fb.AbstractMeshEnd(builder)


_MESHES: dict = {}


def decode_abstract_mesh(t, path):
    n = t.vector_length(LM.axis_names, 4, path, "axis_names")
    if n > MAX_MESH_AXES:
        raise PayloadError(f"{n} mesh axes, more than {MAX_MESH_AXES}",
                           f"{path}.axis_names")
    sizes = t.ints(LM.axis_sizes, "u32", path, "axis_sizes")
    names = tuple(t.strings(LM.axis_names, path, "axis_names"))
    types = t.bytes(LM.axis_types, path, "axis_types") or b""
    dev_t = t.table(LM.abstract_device, path, "abstract_device")
    dev = decode_abstract_device(dev_t, f"{path}.abstract_device") \
        if dev_t is not None else None
    key = (sizes, names, types, dev)
    hit = _MESHES.get(key)
    if hit is not None:
        return hit
    if len(sizes) != len(names) or len(types) != len(names):
        raise PayloadError(f"{len(sizes)} axis sizes and {len(types)} axis "
                           f"types for {len(names)} axis names", path)
    if len(set(names)) != len(names):
        raise PayloadError(f"duplicate axis names {names}",
                           f"{path}.axis_names")
    total = 1
    for s in sizes:
        total *= s
        if s < 1 or total > MAX_MESH_DEVICES:
            raise PayloadError(f"bad mesh axis sizes {sizes}",
                               f"{path}.axis_sizes")
    try:
        axis_types = tuple(_FB_TO_AXIS[b] for b in types)
    except KeyError as e:
        raise PayloadError(f"unknown AxisType value {e.args[0]}",
                           f"{path}.axis_types") from None
    try:
        mesh = jmesh.AbstractMesh(sizes, names, axis_types,
                                  abstract_device=dev)
    except Exception as e:
        raise PayloadError(f"invalid abstract mesh: {e}", path) from None
    if names_size(names) <= CACHED_NAMES_SIZE:  # (huge names: not kept)
        if len(_MESHES) >= _CACHE_MAX:
            _MESHES.clear()
        _MESHES[key] = mesh
    return mesh


# --------------------------------------------------------- partition spec

def encode_partition_spec(builder, spec, path) -> int:
    parts = []
    for p in spec._partitions:
        if p is None:
            axes = ()
        elif isinstance(p, str):
            axes = (p,)
        elif isinstance(p, tuple) and all(isinstance(a, str) for a in p):
            axes = p
        else:
            raise EncodeError(f"PartitionSpec entry {p!r} has no JAX export "
                              "encoding", path)
        axes_off = _strings(builder, axes)
        fb.PartitionSpecOneAxisStart(builder)
        fb.PartitionSpecOneAxisAddAxes(builder, axes_off)
        parts.append(fb.PartitionSpecOneAxisEnd(builder))
    parts_off = _tables(builder, parts)
    reduced = _strings(builder, spec.reduced)
    unreduced = _strings(builder, spec.unreduced)
    fb.PartitionSpecStart(builder)
    fb.PartitionSpecAddPartitions(builder, parts_off)
    fb.PartitionSpecAddReduced(builder, reduced)
    fb.PartitionSpecAddUnreduced(builder, unreduced)
    return fb.PartitionSpecEnd(builder)


def decode_partition_spec(buf, t, path):
    parts = []
    for i, pos in enumerate(t.tables(LP.partitions, path, "partitions")):
        ppath = f"{path}.partitions[{i}]"
        axes = buf.table_at(pos, ppath).strings(LA.axes, ppath, "axes")
        parts.append(None if not axes else
                     axes[0] if len(axes) == 1 else tuple(axes))
    reduced = frozenset(t.strings(LP.reduced, path, "reduced"))
    unreduced = frozenset(t.strings(LP.unreduced, path, "unreduced"))
    try:
        return P(*parts, reduced=reduced, unreduced=unreduced)
    except Exception as e:
        raise PayloadError(f"invalid PartitionSpec: {e}", path) from None


# --------------------------------------------------------- named sharding

def encode_named_sharding(builder, s, mesh_idx, row, path) -> int:
    """``mesh_idx``: index into unique_abstract_meshes (v10+), else None."""
    mesh_off = encode_abstract_mesh(builder, s.mesh.abstract_mesh, row,
                                    path + ".mesh")
    spec_off = encode_partition_spec(builder, s.spec, path + ".spec")
    mk = builder.CreateString(s.memory_kind) \
        if s.memory_kind is not None else 0
    fb.NamedShardingStart(builder)
    fb.NamedShardingAddMesh(builder, mesh_off)
    fb.NamedShardingAddSpec(builder, spec_off)
    if mk:
        fb.NamedShardingAddMemoryKind(builder, mk)
    if mesh_idx is not None:
        fb.NamedShardingAddAbstractMeshIdx(builder, mesh_idx)
    return fb.NamedShardingEnd(builder)


def decode_named_sharding(buf, t, path, meshes):
    """``meshes``: the decoded unique_abstract_meshes (may be empty)."""
    if meshes:
        idx = t.scalar(LN.abstract_mesh_idx, "u32", 0, path,
                       "abstract_mesh_idx")
        if idx >= len(meshes):
            raise PayloadError(f"reference {idx} out of range: there are "
                               f"{len(meshes)} abstract meshes",
                               f"{path}.abstract_mesh_idx")
        mesh = meshes[idx]
    else:
        mt = t.table(LN.mesh, path, "mesh")
        if mt is None:
            raise PayloadError("named sharding without mesh", f"{path}.mesh")
        mesh = decode_abstract_mesh(mt, f"{path}.mesh")
    st = t.table(LN.spec, path, "spec")
    if st is None:
        raise PayloadError("named sharding without spec", f"{path}.spec")
    spec = decode_partition_spec(buf, st, f"{path}.spec")
    memory_kind = t.string(LN.memory_kind, path, "memory_kind")
    try:
        return jnamed.NamedSharding(mesh, spec, memory_kind=memory_kind)
    except Exception as e:
        raise PayloadError(f"invalid NamedSharding: {e}", path) from None


# ---------------------------------------------- Sharding (per-entry, <v10)

def encode_sharding(builder, named, hlo, has_named, row, path) -> int:
    """One Sharding table as JAX's writer of ``row`` builds it."""
    named_off = hlo_off = 0
    if row.named_shardings and has_named and named is not None:
        named_off = encode_named_sharding(
            builder, named, None, row, path + ".named_sharding")
    kind = fb.ShardingKind.unspecified
    if row.hlo_shardings:
        unspecified = named is None if has_named else hlo is None
        if not unspecified:
            kind = fb.ShardingKind.hlo_sharding
        if hlo is not None:
            proto = hlo.to_proto()
            if not named_off:  # (else readers read the named sharding)
                opsharding.check_writable(proto,
                                          path + ".hlo_sharding_proto")
            hlo_off = builder.CreateByteVector(proto.SerializeToString())
    fb.ShardingStart(builder)
    if row.hlo_shardings:
        fb.ShardingAddKind(builder, kind)
    if hlo_off:
        fb.ShardingAddHloShardingProto(builder, hlo_off)
    if named_off:
        fb.ShardingAddNamedSharding(builder, named_off)
    return fb.ShardingEnd(builder)


class ShardingReader:
    """Decodes per-entry Sharding tables, memoized by their bytes' content."""

    def __init__(self, buf, meshes):
        self.buf = buf
        self.meshes = meshes
        self.hlo: dict = {}

    def read(self, t, path):
        """None, an xc.HloSharding or a NamedSharding (like JAX's reader)."""
        nt = t.table(LS.named_sharding, path, "named_sharding")
        if nt is not None:
            return decode_named_sharding(self.buf, nt, f"{path}.named_sharding",
                                         self.meshes)
        kind = t.scalar(LS.kind, "u8", 0, path, "kind")
        if kind not in (0, 1, 2):
            raise PayloadError(f"unknown ShardingKind value {kind}",
                               f"{path}.kind")
        blob = t.bytes(LS.hlo_sharding_proto, path, "hlo_sharding_proto")
        if blob is None:
            return None
        hit = self.hlo.get(blob)
        if hit is None:
            hit = self.hlo[blob] = opsharding.parse_foreign(
                blob, f"{path}.hlo_sharding_proto")
        return hit


def is_hlo(s) -> bool:
    return isinstance(s, xc.HloSharding)
