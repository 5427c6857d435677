"""``serialize``: a ``jax.export.Exported`` in JAX's wire format, at any
serialization version 2..12.

The writer of each version builds the same flatbuffer, operation for
operation, as the JAX release whose newest version it is (see
jaxcolo/export/versions.py for the layouts), so ``version=None`` (11) gives
the bytes jax 0.10.2 gives.  Everything a version cannot express raises
:class:`jaxcolo.EncodeError` naming the field, with two conversions into an older
version's own vocabulary (what the releases of that version wrote for the
same function): before version 6 a NamedSharding is written as the
HloSharding JAX derives from it (``named_to_hlo_sharding``), and before
version 8 an AbstractMesh is written without its abstract device (the
readers of those versions have no such field).  Versions 6 and 8 write
that derived HloSharding next to the NamedSharding, as 0.9.x did.
Deliberate differences from the JAX releases: version 5 omits ``nr_devices_short`` when the device count
does not fit an int16 (0.8.x raised); version 12 (JAX main, no release yet)
stores 3 like 11 and writes this process's ``jax.__version__``.
"""

from __future__ import annotations

import itertools
import struct

import jax
from jax._src.export import _export as jexport

import jaxcolo_jax_export_fb as fb
from jaxcolo.errors import EncodeError
from jaxcolo.export import versions
from jaxcolo.versions import integer
from jaxcolo.wire import parse_budget
from jaxcolo.export.avals import ShapeCharges, encode_aval
from jaxcolo.export.effects import encode_check, encode_effect
from jaxcolo.export.pytrees import encode_tree
from jaxcolo.export.shardings import encode_abstract_mesh, \
    encode_named_sharding, encode_sharding
from jaxcolo.export.builder import ExportBuilder

MAX_VJP_ORDER = 64


def serialize(exp, vjp_order: int = 0, version: int | None = None
              ) -> bytearray:
    """Serialize ``exp`` as JAX's ``Exported.serialize(vjp_order)`` does.

    ``version=None`` writes what jax 0.10.2 writes (version 11, byte for
    byte); ``version=N`` writes what the newest JAX release whose newest
    serialization version is N reads (older releases of version 3 know
    fewer dtypes: ``readable_by`` and ``jaxcolo check`` say which).  Raises
    EncodeError (a ValueError) if ``exp`` uses something version N cannot
    express.
    """
    row = versions.check_writable(version)
    try:
        order = integer(vjp_order, "vjp_order")
    except TypeError:
        order = -1
    if not 0 <= order <= MAX_VJP_ORDER:
        raise EncodeError(f"vjp_order must be an int in 0..{MAX_VJP_ORDER}, "
                          f"got {vjp_order!r}")
    vjp_order = order
    builder = ExportBuilder()
    charges = ShapeCharges()
    try:
        builder.Finish(_exported(builder, exp, vjp_order, row, "$", charges))
    except (struct.error, OverflowError, UnicodeEncodeError, TypeError) as e:
        # A field of the wrong type or out of its wire range (a str that is
        # not one, a count past uint32, unpaired surrogates).
        raise EncodeError(f"cannot encode {type(exp).__name__}: "
                          f"{type(e).__name__}: {e}", "$") from None
    out = builder.Output()
    cost = charges.total()
    if cost > parse_budget(len(out)):
        raise EncodeError(
            f"the symbolic shapes cost {cost} parse units, more than a reader "
            f"allows a {len(out)}-byte payload ({parse_budget(len(out))}): "
            "use fewer distinct nested max/min expressions or long products",
            "$")
    return bytearray(out)


def _vector(builder, offs) -> int:
    return builder.offset_vector(offs)


class _Uniques:
    """The unique tables of version 10+, in JAX's insertion order."""

    def __init__(self, exp):
        self.avals: dict = {}
        self.meshes: dict = {}
        self.named: dict = {}
        for a in itertools.chain(exp.in_avals, exp.out_avals):
            if a not in self.avals:
                self.avals[a] = len(self.avals)
        for s in itertools.chain(exp._in_named_shardings,
                                 exp._out_named_shardings):
            if s is None:
                continue
            m = s.mesh.abstract_mesh
            if m is not None and m not in self.meshes:
                self.meshes[m] = len(self.meshes)
            if s not in self.named:
                self.named[s] = len(self.named)


def _shardings(builder, exp, side, row, uniques, path):
    named = getattr(exp, f"_{side}_named_shardings")
    hlos = getattr(exp, f"{side}_shardings_hlo")
    if row.hlo_shardings:
        hlos = [_derived_hlo(s, h, a, f"{path}.{side}_shardings[{i}]")
                for i, (s, h, a) in enumerate(zip(
                    named, hlos, getattr(exp, f"{side}_avals")))]
    has_named = exp._has_named_shardings and row.named_shardings
    offs = []
    if uniques is not None:
        for i, s in enumerate(named):
            p = f"{path}.{side}_shardings[{i}]"
            named_off = 0
            if s is not None:
                named_off = encode_named_sharding(
                    builder, s, uniques.meshes[s.mesh.abstract_mesh], row,
                    p + ".named_sharding")
            fb.ShardingStart(builder)
            if named_off:
                fb.ShardingAddNamedSharding(builder, named_off)
            offs.append(fb.ShardingEnd(builder))
        return _vector(builder, offs)
    pairs = zip(named, hlos) if row.named_shardings else \
        ((None, h) for h in hlos)
    for i, (s, h) in enumerate(pairs):
        offs.append(encode_sharding(builder, s, h, has_named, row,
                                    f"{path}.{side}_shardings[{i}]"))
    return _vector(builder, offs)


def _derived_hlo(named, hlo, aval, path):
    """The HloSharding to write: ``hlo``, or for Exporteds that only carry
    NamedShardings (JAX >= 0.9.2 exports) the one JAX derives from ``named``."""
    if hlo is not None or named is None:
        return hlo
    try:
        return jexport.named_to_hlo_sharding(named, aval)
    except Exception as e:  # JAX's own conversion refused this sharding
        raise EncodeError(f"cannot derive an HloSharding from {named} for "
                          f"this version: {e}", path) from None


def _exported(builder, exp, vjp_order, row, path, charges) -> int:
    if not row.hlo_shardings and not exp._has_named_shardings:
        hlo_versions = [r.version for r in versions.HISTORY
                        if r.hlo_shardings]
        raise EncodeError(
            f"this Exported has HloShardings, not NamedShardings; version "
            f"{row.version} can only express NamedShardings (versions with "
            f"HloShardings: {hlo_versions})", path)
    nr = exp.nr_devices
    if row.nr_devices_short and not row.nr_devices_long and \
            not 0 <= nr < 1 << 15:
        raise EncodeError(f"{nr} devices need serialization version >= 5",
                          f"{path}.nr_devices")
    uniques = _Uniques(exp) if row.unique_tables else None
    mine = charges.exported()  # (its reader's: one per Exported)
    # Bottom-up, in JAX's order.
    name_off = builder.CreateString(exp.fun_name)
    in_tree = encode_tree(builder, exp.in_tree, row.custom_pytree,
                          f"{path}.in_tree")
    in_avals = _vector(builder, [
        encode_aval(builder, a, row, f"{path}.in_avals[{i}]", mine, charges)
        for i, a in enumerate(exp.in_avals)])
    out_tree = encode_tree(builder, exp.out_tree, row.custom_pytree,
                           f"{path}.out_tree")
    out_avals = _vector(builder, [
        encode_aval(builder, a, row, f"{path}.out_avals[{i}]", mine,
                    charges)
        for i, a in enumerate(exp.out_avals)])
    in_sh = _shardings(builder, exp, "in", row, uniques, path)
    out_sh = _shardings(builder, exp, "out", row, uniques, path)
    ordered = _vector(builder, [
        encode_effect(builder, e, f"{path}.ordered_effects[{i}]")
        for i, e in enumerate(exp.ordered_effects)])
    unordered = _vector(builder, [
        encode_effect(builder, e, f"{path}.unordered_effects[{i}]")
        for i, e in enumerate(exp.unordered_effects)])
    checks = _vector(builder, [
        encode_check(builder, c, f"{path}.disabled_checks[{i}]")
        for i, c in enumerate(exp.disabled_safety_checks)])
    platforms = _vector(builder, [builder.CreateString(p)
                                  for p in exp.platforms])
    module = builder.CreateByteVector(exp.mlir_module_serialized)
    kept = exp.module_kept_var_idx
    if any(not 0 <= k < 1 << 16 for k in kept):
        raise EncodeError("kept variable indices must fit uint16",
                          f"{path}.module_kept_var_idx")
    kept_off = builder.uint_vector(kept, 2)
    vjp = 0
    if vjp_order > 0:
        if not exp.has_vjp():
            raise EncodeError(f"vjp_order={vjp_order} but this Exported has "
                              "no vjp", f"{path}.vjp")
        vjp = _exported(builder, exp.vjp(), vjp_order - 1, row,
                        f"{path}.vjp", charges)
    if uniques is not None:
        u_avals = _vector(builder, [
            encode_aval(builder, a, row, f"{path}.unique_avals[{i}]", mine,
                        charges)
            for i, a in enumerate(uniques.avals)])
        u_meshes = _vector(builder, [
            encode_abstract_mesh(builder, m, row,
                                 f"{path}.unique_abstract_meshes[{i}]")
            for i, m in enumerate(uniques.meshes)])
        u_named = _vector(builder, [
            encode_named_sharding(builder, s, uniques.meshes[
                s.mesh.abstract_mesh], row,
                f"{path}.unique_named_shardings[{i}]")
            for i, s in enumerate(uniques.named)])
        amap, nmap = uniques.avals, uniques.named
        idxs = [builder.uint_vector(v, 4) for v in (
            [amap[a] for a in exp.in_avals],
            [amap[a] for a in exp.out_avals],
            [0 if s is None else 1 + nmap[s]
             for s in exp._in_named_shardings],
            [0 if s is None else 1 + nmap[s]
             for s in exp._out_named_shardings])]
    jax_version = builder.CreateString(jax.__version__) \
        if row.jax_version else 0

    fb.ExportedStart(builder)
    fb.ExportedAddSerializationVersion(builder, row.stored)
    fb.ExportedAddFunctionName(builder, name_off)
    fb.ExportedAddInTree(builder, in_tree)
    fb.ExportedAddInAvals(builder, in_avals)
    fb.ExportedAddOutTree(builder, out_tree)
    fb.ExportedAddOutAvals(builder, out_avals)
    if row.nr_devices_long:
        fb.ExportedAddNrDevices(builder, nr)
    if row.nr_devices_short and -1 << 15 <= nr < 1 << 15:
        fb.ExportedAddNrDevicesShort(builder, nr)
    fb.ExportedAddInShardings(builder, in_sh)
    fb.ExportedAddOutShardings(builder, out_sh)
    fb.ExportedAddPlatforms(builder, platforms)
    fb.ExportedAddOrderedEffects(builder, ordered)
    fb.ExportedAddUnorderedEffects(builder, unordered)
    fb.ExportedAddDisabledChecks(builder, checks)
    fb.ExportedAddMlirModuleSerialized(builder, module)
    fb.ExportedAddCallingConventionVersion(builder,
                                           exp.calling_convention_version)
    fb.ExportedAddModuleKeptVarIdx(builder, kept_off)
    fb.ExportedAddUsesGlobalConstants(builder, exp.uses_global_constants)
    if vjp:
        fb.ExportedAddVjp(builder, vjp)
    if uniques is not None:
        fb.ExportedAddUniqueAvals(builder, u_avals)
        fb.ExportedAddUniqueAbstractMeshes(builder, u_meshes)
        fb.ExportedAddUniqueNamedShardings(builder, u_named)
        fb.ExportedAddInAvalsIdxs(builder, idxs[0])
        fb.ExportedAddOutAvalsIdxs(builder, idxs[1])
        fb.ExportedAddInShardingsIdxs(builder, idxs[2])
        fb.ExportedAddOutShardingsIdxs(builder, idxs[3])
    if jax_version:
        fb.ExportedAddJaxVersion(builder, jax_version)
    return fb.ExportedEnd(builder)
