"""``deserialize``: JAX export payloads of every version (2..12) to
``jax.export.Exported``, through jaxcolo's bounds-checked reader.

The result equals what jax 0.10.2's own ``deserialize`` returns wherever that
succeeds.  Differences, all on inputs JAX cannot handle or checks it skips:
the 0.4.30 ``shape_assertions`` check is read as a no-op custom_call (as
0.4.35..0.8.x did); structural inconsistencies JAX would trip over later
(leaf/aval/sharding count mismatches, kept-var indices out of range, a
missing device count) are PayloadErrors here; the vjp chain is decoded
eagerly (so a corrupt one fails now, not at the first ``exp.vjp()``).
"""

from __future__ import annotations

from jax._src import core
from jax._src.export import _export as jexport

from jaxcolo.errors import PayloadError, reports_malformed
from jaxcolo.export.avals import AvalReader
from jaxcolo.export.effects import decode_check, decode_effect
from jaxcolo.export.layouts import EXPORTED as L
from jaxcolo.export.pytrees import decode_tree
from jaxcolo.export.shardings import ShardingReader, decode_abstract_mesh, \
    decode_named_sharding, is_hlo
from jaxcolo.wire import Buffer

MAX_VJP_DEPTH = 64

def as_buffer(data) -> Buffer:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(
            f"payload must be bytes, got {type(data).__name__}", "$")
    return Buffer(bytes(data))


@reports_malformed
def deserialize(data) -> jexport.Exported:
    """Decode a JAX export payload (``Exported.serialize()`` bytes).

    Raises :class:`jaxcolo.PayloadError` naming the field for anything
    malformed.  As with JAX's own reader, the result runs the payload's
    StableHLO: only deserialize payloads you trust to run.
    """
    buf = as_buffer(data)
    return _exported(buf, buf.root("$"), "$", 0)


def _exported(buf, t, path, depth):
    if depth > MAX_VJP_DEPTH:
        raise PayloadError(f"vjp chain longer than {MAX_VJP_DEPTH}", path)
    avals = AvalReader(buf)
    meshes = [decode_abstract_mesh(buf.table_at(p, f"{path}.unique_abstract"
                                                f"_meshes[{i}]"),
                                   f"{path}.unique_abstract_meshes[{i}]")
              for i, p in enumerate(t.tables(L.unique_abstract_meshes, path,
                                             "unique_abstract_meshes"))]
    shard_reader = ShardingReader(buf, meshes)

    fun_name = t.string(L.function_name, path, "function_name")
    if fun_name is None:
        raise PayloadError("function_name missing", f"{path}.function_name")
    nr_devices = t.scalar(L.nr_devices, "u32", 0, path, "nr_devices") or \
        t.scalar(L.nr_devices_short, "i16", 0, path, "nr_devices_short")
    if nr_devices < 1:
        raise PayloadError(f"nr_devices is {nr_devices}", f"{path}.nr_devices")

    in_sh = _shardings(buf, t, path, "in", shard_reader, meshes)
    out_sh = _shardings(buf, t, path, "out", shard_reader, meshes)
    has_named = not any(is_hlo(s) for s in in_sh) and \
        not any(is_hlo(s) for s in out_sh)

    unique_avals = None
    if t.vector_length(L.in_avals_idxs, 4, path, "in_avals_idxs") or \
            t.vector_length(L.out_avals_idxs, 4, path, "out_avals_idxs"):
        unique_avals = [
            avals.read(buf.table_at(p, f"{path}.unique_avals[{i}]"),
                       f"{path}.unique_avals[{i}]")
            for i, p in enumerate(t.tables(L.unique_avals, path,
                                           "unique_avals"))]
    in_avals = _avals(buf, t, path, "in", avals, unique_avals)
    out_avals = _avals(buf, t, path, "out", avals, unique_avals)
    if has_named:
        in_avals, in_hlo = _apply(in_avals, in_sh, path, "in")
        out_avals, out_hlo = _apply(out_avals, out_sh, path, "out")
    else:
        _same_length(in_avals, in_sh, path, "in")
        _same_length(out_avals, out_sh, path, "out")
        _no_named_among_hlo(in_sh, path, "in")
        _no_named_among_hlo(out_sh, path, "out")
        in_avals, out_avals = tuple(in_avals), tuple(out_avals)
        in_hlo, in_sh = tuple(in_sh), (None,) * len(in_sh)
        out_hlo, out_sh = tuple(out_sh), (None,) * len(out_sh)

    in_tree = _tree(buf, t, path, "in_tree", in_avals)
    _check_args_kwargs(in_tree, f"{path}.in_tree")
    out_tree = _tree(buf, t, path, "out_tree", out_avals)

    platforms = tuple(t.strings(L.platforms, path, "platforms"))
    ordered = tuple(
        decode_effect(buf.table_at(p, f"{path}.ordered_effects[{i}]"),
                      f"{path}.ordered_effects[{i}]")
        for i, p in enumerate(t.tables(L.ordered_effects, path,
                                       "ordered_effects")))
    unordered = tuple(
        decode_effect(buf.table_at(p, f"{path}.unordered_effects[{i}]"),
                      f"{path}.unordered_effects[{i}]")
        for i, p in enumerate(t.tables(L.unordered_effects, path,
                                       "unordered_effects")))
    checks = tuple(
        decode_check(buf.table_at(p, f"{path}.disabled_checks[{i}]"),
                     f"{path}.disabled_checks[{i}]")
        for i, p in enumerate(t.tables(L.disabled_checks, path,
                                       "disabled_checks")))
    module = t.bytes(L.mlir_module_serialized, path, "mlir_module_serialized")
    if module is None:
        raise PayloadError("mlir_module_serialized missing",
                           f"{path}.mlir_module_serialized")
    ccv = t.scalar(L.calling_convention_version, "u16", 0, path,
                   "calling_convention_version")
    kept = t.ints(L.module_kept_var_idx, "u16", path, "module_kept_var_idx")
    n_in = len(in_avals)
    for i, k in enumerate(kept):
        if k >= n_in or (i and k <= kept[i - 1]):
            raise PayloadError(
                f"kept variable index {k} is out of order or not below the "
                f"{n_in} inputs", f"{path}.module_kept_var_idx[{i}]")
    uses_global = bool(t.scalar(L.uses_global_constants, "bool", 0, path,
                                "uses_global_constants"))
    get_vjp = None
    vjp_t = t.table(L.vjp, path, "vjp")
    if vjp_t is not None:
        vjp = _exported(buf, vjp_t, f"{path}.vjp", depth + 1)
        get_vjp = lambda _: vjp  # noqa: E731
    try:
        return jexport.Exported(
            fun_name=fun_name, in_tree=in_tree, in_avals=in_avals,
            out_tree=out_tree, out_avals=out_avals, nr_devices=nr_devices,
            in_shardings_hlo=in_hlo, out_shardings_hlo=out_hlo,
            _has_named_shardings=has_named, _in_named_shardings=tuple(in_sh),
            _out_named_shardings=tuple(out_sh), platforms=platforms,
            ordered_effects=ordered, unordered_effects=unordered,
            disabled_safety_checks=checks, mlir_module_serialized=module,
            calling_convention_version=ccv, module_kept_var_idx=tuple(kept),
            uses_global_constants=uses_global, _get_vjp=get_vjp)
    except Exception as e:
        raise PayloadError(f"inconsistent Exported: {e}", path) from None


def _shardings(buf, t, path, side, reader, meshes):
    idx_name = f"{side}_shardings_idxs"
    idxs = t.ints(getattr(L, idx_name), "u32", path, idx_name)
    if idxs:
        positions = t.tables(L.unique_named_shardings, path,
                             "unique_named_shardings")
        named = {}
        out = []
        for i, k in enumerate(idxs):
            if k == 0:
                out.append(None)
                continue
            s = named.get(k)
            if s is None:
                if k > len(positions):
                    raise PayloadError(
                        f"reference {k} out of range: there are "
                        f"{len(positions)} named shardings",
                        f"{path}.{idx_name}[{i}]")
                npath = f"{path}.unique_named_shardings[{k - 1}]"
                s = named[k] = decode_named_sharding(
                    buf, buf.table_at(positions[k - 1], npath), npath, meshes)
            out.append(s)
        return out
    name = f"{side}_shardings"
    read = reader.read
    return [read(buf.table_at(p, f"{path}.{name}[{i}]"),
                 f"{path}.{name}[{i}]")
            for i, p in enumerate(t.tables(getattr(L, name), path, name))]


def _avals(buf, t, path, side, reader, unique):
    idx_name = f"{side}_avals_idxs"
    idxs = t.ints(getattr(L, idx_name), "u32", path, idx_name)
    if idxs:
        n = len(unique)
        for i, k in enumerate(idxs):
            if k >= n:
                raise PayloadError(f"reference {k} out of range: there are "
                                   f"{n} unique avals",
                                   f"{path}.{idx_name}[{i}]")
        return [unique[k] for k in idxs]
    name = f"{side}_avals"
    read = reader.read
    return [read(buf.table_at(p, f"{path}.{name}[{i}]"), f"{path}.{name}[{i}]")
            for i, p in enumerate(t.tables(getattr(L, name), path, name))]


def _same_length(avals, shardings, path, side):
    if len(shardings) != len(avals):
        raise PayloadError(f"{len(shardings)} shardings for {len(avals)} "
                           f"avals", f"{path}.{side}_shardings")


def _no_named_among_hlo(shardings, path, side):
    """PayloadError for a named sharding in an Exported whose shardings
    are HloShardings (some entry is one): JAX writes either kind
    throughout, and a mix reached JAX as an HloSharding that is not one."""
    for i, s in enumerate(shardings):
        if s is not None and not is_hlo(s):
            raise PayloadError(
                "a named sharding in an Exported whose other shardings are "
                "HloShardings (a writer uses one kind throughout)",
                f"{path}.{side}_shardings[{i}]")


def _apply(avals, shardings, path, side):
    """Avals with their named shardings applied, and the HloShardings (as
    JAX's reader computes them), memoized per (aval, sharding)."""
    _same_length(avals, shardings, path, side)
    memo = {}
    out_avals, hlos = [], []
    for i, (a, s) in enumerate(zip(avals, shardings)):
        if s is None:
            out_avals.append(a)
            hlos.append(None)
            continue
        key = (id(a), id(s))
        hit = memo.get(key)
        if hit is None:
            try:
                hit = memo[key] = (core.update_aval_with_sharding(a, s),
                                   jexport.named_to_hlo_sharding(s, a))
            except Exception as e:
                raise PayloadError(
                    f"sharding {s} does not fit aval {a}: {e}",
                    f"{path}.{side}_shardings[{i}]") from None
        out_avals.append(hit[0])
        hlos.append(hit[1])
    return tuple(out_avals), tuple(hlos)


def _check_args_kwargs(tree, path):
    """PayloadError unless ``tree`` is that of an ``(args tuple, kwargs
    dict)`` pair, as JAX's ``in_tree`` always is (exp.call indexes it so)."""
    node = tree.node_data()
    kids = tree.children()
    if node is None or node[0] is not tuple or len(kids) != 2 or \
            (kids[0].node_data() or (None,))[0] is not tuple or \
            (kids[1].node_data() or (None,))[0] is not dict:
        raise PayloadError(f"in_tree is {tree}, not that of an (args "
                           "tuple, kwargs dict) pair", path)


def _tree(buf, t, path, name, avals):
    tt = t.table(getattr(L, name), path, name)
    if tt is None:
        raise PayloadError(f"{name} missing", f"{path}.{name}")
    return decode_tree(buf, tt, f"{path}.{name}", avals)
