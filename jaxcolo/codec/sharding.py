"""PartitionSpecs and shardings: NamedSharding (over a Mesh or an
AbstractMesh), SingleDeviceSharding, GSPMDSharding and bare HloShardings.

Shardings reference meshes, partition specs, device lists and HLO shardings by
index into their unique tables, so a sharding shared by a thousand leaves is
stored once.
"""

from __future__ import annotations

import jax
import numpy as np
from jax._src import mesh as jmesh
from jax._src import sharding_impls
from jax._src.lib import xla_client as xc

import jaxcolo_fb as fb
from jaxcolo_fb import LeafKind
from jaxcolo_fb import ShardingKind
from jaxcolo_fb import SpecEntry
from jaxcolo import versions
from jaxcolo.codec import opsharding
from jaxcolo.codec.core import register_leaf, register_table
from jaxcolo.codec.mesh import CACHED_NAMES_SIZE, intern_abstract_mesh, \
    intern_device_list, intern_mesh, names_size
from jaxcolo.errors import EncodeError, PayloadError
from jaxcolo.fastbuilder import string_vector
from jaxcolo.wire import layout

LP = layout(fb, "PartitionSpec")
LS = layout(fb, "Sharding")
LH = layout(fb, "HloSharding")

P = jax.sharding.PartitionSpec
UNCONSTRAINED = P.UNCONSTRAINED
NamedSharding = jax.sharding.NamedSharding
SingleDeviceSharding = jax.sharding.SingleDeviceSharding
GSPMDSharding = sharding_impls.GSPMDSharding
_SUBGROUP_MAXIMAL = xc.OpSharding.Type.MAXIMAL


# ------------------------------------------------------------ partition spec

# A PartitionSpec has an entry per array dimension it shards: at most
# aval.MAX_RANK (aval imports this module).  Each NamedSharding built over a
# shared spec walks its entries: a long spec shared by many shardings would
# cost entries x shardings, out of proportion to the payload.
MAX_SPEC_ENTRIES = 255


def _spec_item(spec, path):
    if len(spec._partitions) > MAX_SPEC_ENTRIES:
        raise EncodeError(f"PartitionSpec of {len(spec._partitions)} entries:"
                          f" more than {MAX_SPEC_ENTRIES}, the most "
                          "dimensions an array has here", path)
    entries, counts, names = bytearray(), [], []
    for e in spec._partitions:
        if e is None:
            entries.append(SpecEntry.none)
        elif e is UNCONSTRAINED:
            entries.append(SpecEntry.unconstrained)
        elif isinstance(e, str):
            entries.append(SpecEntry.axis)
            names.append(e)
        elif isinstance(e, tuple) and all(isinstance(a, str) for a in e):
            entries.append(SpecEntry.axes)
            counts.append(len(e))
            names.extend(e)
        else:
            raise EncodeError(f"unsupported PartitionSpec entry {e!r}", path)
    return (bytes(entries), counts, names, sorted(spec.reduced),
            sorted(spec.unreduced))


def build_partition_spec(writer, builder, item) -> int:
    entries, counts, names, reduced, unreduced = item
    names_off = string_vector(builder, names) if names else 0
    red_off = string_vector(builder, reduced) if reduced else 0
    unred_off = string_vector(builder, unreduced) if unreduced else 0
    counts_off = (builder.CreateNumpyVector(np.asarray(counts, np.uint32))
                  if counts else 0)
    entries_off = builder.CreateByteVector(entries)
    fb.PartitionSpecStart(builder)
    fb.PartitionSpecAddEntries(builder, entries_off)
    for add, off in ((fb.PartitionSpecAddAxesCounts, counts_off),
                     (fb.PartitionSpecAddAxisNames, names_off),
                     (fb.PartitionSpecAddReduced, red_off),
                     (fb.PartitionSpecAddUnreduced, unred_off)):
        if off:
            add(builder, off)
    return fb.PartitionSpecEnd(builder)


# Specs of up to CACHED_NAMES_SIZE entries, axis names and their characters
# are cached (a payload may hold huge ones: each would stay in the cache).
_SPEC_CACHE: dict = {}


def decode_partition_spec(reader, t, path):
    entries = t.bytes(LP.entries, path, "entries") or b""
    if len(entries) > MAX_SPEC_ENTRIES:
        raise PayloadError(f"{len(entries)} entries: more than "
                           f"{MAX_SPEC_ENTRIES}, the most dimensions an array "
                           "has", f"{path}.entries")
    counts = t.ints(LP.axes_counts, "u32", path, "axes_counts")
    names = t.strings(LP.axis_names, path, "axis_names")
    reduced = t.strings(LP.reduced, path, "reduced")
    unreduced = t.strings(LP.unreduced, path, "unreduced")
    key = (entries, counts, tuple(names), tuple(reduced), tuple(unreduced))
    hit = _SPEC_CACHE.get(key)
    if hit is not None:
        return hit
    parts, ni, ci = [], 0, 0
    for i, e in enumerate(entries):
        if e == SpecEntry.none:
            parts.append(None)
        elif e == SpecEntry.unconstrained:
            parts.append(UNCONSTRAINED)
        elif e == SpecEntry.axis:
            if ni >= len(names):
                raise PayloadError("axis name list too short",
                                   f"{path}.axis_names")
            parts.append(names[ni])
            ni += 1
        elif e == SpecEntry.axes:
            if ci >= len(counts):
                raise PayloadError("axes count missing", f"{path}.axes_counts")
            c = counts[ci]
            ci += 1
            if ni + c > len(names):
                raise PayloadError("axis name list too short",
                                   f"{path}.axis_names")
            parts.append(tuple(names[ni:ni + c]))
            ni += c
        else:
            raise PayloadError(f"unknown SpecEntry value {e}",
                               f"{path}.entries[{i}]")
    if ni != len(names) or ci != len(counts):
        raise PayloadError("unused axis names or counts", path)
    try:
        spec = P(*parts, reduced=frozenset(reduced),
                 unreduced=frozenset(unreduced))
    except Exception as e:
        raise PayloadError(f"invalid PartitionSpec: {e}", path) from None
    if len(entries) + names_size(names) + names_size(reduced) + \
            names_size(unreduced) <= CACHED_NAMES_SIZE:
        if len(_SPEC_CACHE) > 1024:
            _SPEC_CACHE.clear()
        _SPEC_CACHE[key] = spec
    return spec


def intern_partition_spec(writer, spec, path) -> int:
    writer.require("partition_spec", path)
    return writer.intern_obj("partition_specs", spec,
                             lambda s: _spec_item(s, path))


# -------------------------------------------------------------- hlo sharding

def build_hlo_sharding(writer, builder, blob) -> int:
    off = builder.CreateByteVector(blob)
    fb.HloShardingStart(builder)
    fb.HloShardingAddOpSharding(builder, off)
    return fb.HloShardingEnd(builder)


def decode_hlo_sharding(reader, t, path):
    blob = t.bytes(LH.op_sharding, path, "op_sharding") or b""
    hlo, proto = opsharding.parse_proto(blob, f"{path}.op_sharding")
    if proto.last_tile_dims:  # read under any header: late version-4
        versions.note_used("hlo_last_tile_dims")  # writers stamped it 1
    return hlo


def intern_hlo_sharding(writer, hlo, path) -> int:
    writer.require("hlo_sharding", path)
    proto = opsharding.canonical_proto(hlo, path)
    if proto.last_tile_dims:  # readers before version 5 cannot parse them
        writer.require("hlo_last_tile_dims", path)
    blob = proto.SerializeToString()
    return writer.intern("hlo_shardings", blob, blob)


# ----------------------------------------------------------------- sharding

def _named_item(writer, s, path):
    mesh = s.mesh
    if isinstance(mesh, jax.sharding.Mesh):
        mesh_ref, amesh_ref = 1 + intern_mesh(writer, mesh, path + ".mesh"), 0
    elif isinstance(mesh, jmesh.AbstractMesh):
        mesh_ref = 0
        amesh_ref = 1 + intern_abstract_mesh(writer, mesh, path + ".mesh")
    else:
        raise EncodeError(f"unsupported mesh type {type(mesh).__name__}", path)
    spec_ref = intern_partition_spec(writer, s.spec, path + ".spec")
    if getattr(s, "_logical_device_ids", None) is not None:
        raise EncodeError("NamedSharding with _logical_device_ids is not "
                          "serializable", path)
    return (ShardingKind.named, mesh_ref, amesh_ref, spec_ref, s.memory_kind,
            0, 0)


def _unusable_over(hs, n: int) -> str | None:
    """Why HLO sharding ``hs`` over a list of ``n`` devices makes a
    GSPMDSharding JAX cannot use (it asserts the tile count equals the
    device count, divides by the tile count, indexes the list with a
    maximal sharding's device, and has no placement for maximal
    subgroups), or None."""
    if hs.is_unknown():
        return "an unknown HLO sharding places no array on devices"
    if hs.is_maximal():  # (also true of replicated and manual ones)
        devs = hs.tile_assignment_devices()
        if len(devs) == 1 and not 0 <= devs[0] < n:
            return (f"the maximal HLO sharding's device {devs[0]} is not in "
                    f"its device list of {n}")
        return None
    if hs.is_tiled():
        if hs.num_devices() != n:
            return (f"the HLO sharding tiles {hs.num_devices()} devices but "
                    f"its device list has {n}")
        if _SUBGROUP_MAXIMAL in hs.subgroup_types():
            return "JAX cannot place arrays by maximal subgroups"
    return None


def sharding_item(writer, s, path):
    if isinstance(s, NamedSharding):
        return _named_item(writer, s, path)
    if isinstance(s, SingleDeviceSharding):
        dl = intern_device_list(writer, list(s.device_set), path + ".device")
        return (ShardingKind.single_device, 0, 0, 0, s.memory_kind, dl, 0)
    if isinstance(s, GSPMDSharding):
        dl = intern_device_list(writer, s._devices, path + ".devices")
        hs = intern_hlo_sharding(writer, s._hlo_sharding, path + ".hlo")
        problem = _unusable_over(s._hlo_sharding, len(s._devices))
        if problem:  # (a reader refuses it: JAX cannot use it)
            raise EncodeError(problem, path + ".hlo")
        return (ShardingKind.gspmd, 0, 0, 0, s.memory_kind, dl, hs)
    raise EncodeError(f"unsupported sharding type {type(s).__name__}", path)


def build_sharding(writer, builder, item) -> int:
    kind, mesh_ref, amesh_ref, spec_ref, memory_kind, dl, hs = item
    mk = builder.CreateSharedString(memory_kind) if memory_kind is not None else 0
    fb.ShardingStart(builder)
    fb.ShardingAddKind(builder, kind)
    fb.ShardingAddMesh(builder, mesh_ref)
    fb.ShardingAddAbstractMesh(builder, amesh_ref)
    fb.ShardingAddSpec(builder, spec_ref)
    if mk:
        fb.ShardingAddMemoryKind(builder, mk)
    fb.ShardingAddDeviceList(builder, dl)
    fb.ShardingAddHloSharding(builder, hs)
    return fb.ShardingEnd(builder)


def decode_sharding(reader, t, path):
    kind = t.scalar(LS.kind, "u8", 0, path, "kind")
    memory_kind = t.string(LS.memory_kind, path, "memory_kind")
    try:
        if kind == ShardingKind.named:
            mesh_ref = t.scalar(LS.mesh, "u32", 0, path, "mesh")
            amesh_ref = t.scalar(LS.abstract_mesh, "u32", 0, path,
                                 "abstract_mesh")
            if bool(mesh_ref) == bool(amesh_ref):
                raise PayloadError(
                    "a named sharding needs exactly one of mesh and "
                    "abstract_mesh", path)
            mesh = (reader.get("meshes", mesh_ref - 1, f"{path}.mesh")
                    if mesh_ref else
                    reader.get("abstract_meshes", amesh_ref - 1,
                               f"{path}.abstract_mesh"))
            spec = reader.get("partition_specs",
                              t.scalar(LS.spec, "u32", 0, path, "spec"),
                              f"{path}.spec")
            return NamedSharding(mesh, spec, memory_kind=memory_kind)
        if kind == ShardingKind.single_device:
            dl = reader.get("device_lists",
                            t.scalar(LS.device_list, "u32", 0, path,
                                     "device_list"), f"{path}.device_list")
            if len(dl) != 1:
                raise PayloadError(
                    f"single-device sharding with {len(dl)} devices",
                    f"{path}.device_list")
            return SingleDeviceSharding(dl[0], memory_kind=memory_kind)
        if kind == ShardingKind.gspmd:
            dl = reader.get("device_lists",
                            t.scalar(LS.device_list, "u32", 0, path,
                                     "device_list"), f"{path}.device_list")
            hs = reader.get("hlo_shardings",
                            t.scalar(LS.hlo_sharding, "u32", 0, path,
                                     "hlo_sharding"), f"{path}.hlo_sharding")
            problem = _unusable_over(hs, len(dl))
            if problem:
                raise PayloadError(problem, f"{path}.hlo_sharding")
            return GSPMDSharding(dl, hs, memory_kind=memory_kind)
    except PayloadError:
        raise
    except Exception as e:  # JAX rejects the combination
        raise PayloadError(f"invalid sharding: {e}", path) from None
    raise PayloadError(f"unknown ShardingKind value {kind}", f"{path}.kind")


def intern_sharding(writer, s, path) -> int:
    writer.require("sharding", path)
    return writer.intern_obj("shardings", s,
                             lambda s: sharding_item(writer, s, path))


register_table("partition_specs", build_partition_spec, decode_partition_spec)
register_table("hlo_shardings", build_hlo_sharding, decode_hlo_sharding)
register_table("shardings", build_sharding, decode_sharding)
register_leaf((P,), LeafKind.partition_spec, "partition_specs",
              intern_partition_spec)
register_leaf((xc.HloSharding,), LeafKind.hlo_sharding, "hlo_shardings",
              intern_hlo_sharding)
register_leaf((NamedSharding, SingleDeviceSharding, GSPMDSharding),
              LeafKind.sharding, "shardings", intern_sharding)
