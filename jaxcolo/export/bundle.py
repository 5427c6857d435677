"""A jaxcolo-native container: a JAX Exported plus colocated spec payloads,
under the jaxcolo envelope (versioned, checksummed), root kind
``export_bundle`` (schema version 2).

    data = jaxcolo.export.bundle(exp, specs={"in": in_specs}, version=None)
    b = jaxcolo.export.unbundle(data)          # ExportBundle(exported, specs)
    b = jaxcolo.deserialize(data)              # the same, via the root kind

The Exported is stored in JAX's own format (at ``version``, default what jax
0.10.2 writes), so it can be extracted and handed to any JAX release that
reads that version.  The envelope's CRC covers it: unlike a bare JAX payload,
bit flips inside the StableHLO blob are detected.  What JAX's format drops
of the Exported's avals (their symbolic scope's constraints, weak types)
travels beside it as a spec payload (``exported_avals``, since v11) and is
put back by ``unbundle``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from jax._src import core

import jaxcolo_fb as fb
from jaxcolo_fb import RootKind
from jaxcolo import envelope, versions
from jaxcolo.codec import spec_tree, symbolic
from jaxcolo.errors import EncodeError, PayloadError
from jaxcolo.export.decode import deserialize as deserialize_exported
from jaxcolo.export.detect import serialization_version
from jaxcolo.export.encode import serialize as serialize_exported
from jaxcolo.fastbuilder import FastBuilder
from jaxcolo.wire import Buffer, layout

L = layout(fb, "ExportBundle")


# The field holding what JAX's format drops of the Exported's avals.
AVALS = "export_bundle_exported_avals"


class ExportBundle(NamedTuple):
    exported: Any          # jax.export.Exported
    specs: Any             # whatever was bundled as specs (None if absent)


def bundle(exp, specs=None, *, vjp_order: int = 0, version: int | None = None,
           spec_version: int | None = None) -> bytes:
    """Seal ``exp`` (serialized by jaxcolo.export at ``version``) and
    ``specs`` (anything jaxcolo.serialize accepts, or None) together."""
    with symbolic.noting_past_model() as past_model:
        exported = bytes(serialize_exported(exp, vjp_order, version))
    spec_bytes = spec_tree.encode_spec_tree(specs, spec_version) \
        if specs is not None else None
    writer = versions.check_writable(None)
    min_reader = versions.require("export_bundle", writer)
    if past_model:  # its readers parse the Exported's dims too
        min_reader = max(min_reader, versions.require(
            symbolic.PAST_MODEL, writer, f"$.exported{past_model[0][1:]}"))
    if spec_bytes is not None:  # a reader of the bundle reads the specs too
        min_reader = max(min_reader, envelope.nested_min_reader(
            spec_bytes, writer, "$.specs", EncodeError))
    avals = _exported_avals(exp, writer)
    if avals is not None:  # (readers before 11 skip it: no feature needed)
        min_reader = max(min_reader, envelope.nested_min_reader(
            avals, writer, "$.exported_avals", EncodeError))
    builder = FastBuilder()
    avals_off = builder.CreateByteVector(avals) if avals is not None else 0
    specs_off = builder.CreateByteVector(spec_bytes) \
        if spec_bytes is not None else 0
    exp_off = builder.CreateByteVector(exported)
    fb.ExportBundleStart(builder)
    fb.ExportBundleAddExported(builder, exp_off)
    fb.ExportBundleAddExportedVersion(builder,
                                      serialization_version(exported))
    if specs_off:
        fb.ExportBundleAddSpecs(builder, specs_off)
    if avals_off:
        fb.ExportBundleAddExportedAvals(builder, avals_off)
    builder.Finish(fb.ExportBundleEnd(builder))
    return envelope.seal(builder.Output(), RootKind.export_bundle, writer,
                         min_reader)


def _exported_avals(exp, writer: int) -> bytes | None:
    """The spec payload of ``exp``'s (in_avals, out_avals), if they hold
    what JAX's format drops (constraints of their symbolic scope, weak
    types) and ``writer`` has the field; else None."""
    if writer < versions.FEATURE_SINCE[AVALS]:
        return None
    avals = (tuple(exp.in_avals), tuple(exp.out_avals))
    if not any(_lost_by_jax_format(a) for side in avals for a in side):
        return None
    try:
        return spec_tree.encode_spec_tree(avals, writer)
    except EncodeError as e:
        raise e.under("$.exported_avals") from None


def _lost_by_jax_format(aval) -> bool:
    if getattr(aval, "weak_type", False):
        return True
    for d in getattr(aval, "shape", ()):
        scope = getattr(d, "scope", None)
        if scope is not None and scope._explicit_constraints:
            return True
    return False


def _restore_avals(exp, avals, path: str):
    """``exp`` with what payload ``avals`` keeps of its avals that JAX's
    format dropped: their shapes' dims (in their scope, with its
    constraints) and weak types.  The rest (sharding, memory space) is as
    JAX's reader derives it from the Exported's shardings.  PayloadError
    unless they are ``exp``'s avals in shape text and dtype."""
    got = spec_tree.decode_spec_tree(avals)
    ok = (type(got) is tuple and len(got) == 2 and
          all(type(side) is tuple for side in got))
    if ok:
        for side, have in zip(got, (exp.in_avals, exp.out_avals)):
            ok = ok and len(side) == len(have) and all(
                isinstance(a, core.ShapedArray) and
                isinstance(b, core.ShapedArray) and
                str(a.shape) == str(b.shape) and a.dtype == b.dtype
                for a, b in zip(side, have))
    if not ok:
        raise PayloadError("exported_avals are not the Exported's avals",
                           path)
    restored = [tuple(b.update(shape=a.shape, weak_type=a.weak_type)
                      for a, b in zip(side, have))
                for side, have in zip(got, (exp.in_avals, exp.out_avals))]
    return dataclasses.replace(exp, in_avals=restored[0],
                               out_avals=restored[1])


@envelope.shares_inflation
def open_bundle(data, reader_version=None):
    """(exported bytes, spec payload bytes or None), envelope checked."""
    return _open_bundle(data, reader_version)[:2]


def _open_bundle(data, reader_version=None):
    """(exported bytes, spec payload or None, exported_avals payload or
    None), envelope checked."""
    header = envelope.read_header(data)
    envelope.check_readable(header, reader_version)
    if header.root_kind != RootKind.export_bundle:
        raise PayloadError(f"root kind {header.root_kind} is not an export "
                           "bundle", "$.header.root_kind")
    buf = Buffer(envelope.open_body(data, header))
    root = buf.root("$")
    exported = root.bytes(L.exported, "$", "exported")
    if exported is None:
        raise PayloadError("exported missing", "$.exported")
    specs = root.bytes(L.specs, "$", "specs")
    if specs is not None:
        envelope.check_nested_declared(specs, header, "$.specs")
    avals = root.bytes(L.exported_avals, "$", "exported_avals")
    if avals is not None:
        envelope.check_nested_declared(avals, header, "$.exported_avals")
    return exported, specs, avals


@envelope.shares_inflation
def unbundle(data, device_resolver=None) -> ExportBundle:
    """Decode a bundle.  PayloadError (with the inner field path, e.g.
    ``$.exported.in_tree``) for anything malformed."""
    exported, specs, avals = _open_bundle(data)
    nested = envelope.decode_nested
    exp = nested(deserialize_exported, exported, "$.exported")
    if avals is not None:
        exp = nested(lambda d: _restore_avals(exp, d, "$"), avals,
                     "$.exported_avals")
    spec_obj = None
    if specs is not None:
        spec_obj = nested(spec_tree.decode_spec_tree, specs, "$.specs",
                          device_resolver)
    return ExportBundle(exp, spec_obj)


def inspect_bundle(data, header) -> dict:
    from jaxcolo.export.inspection import inspect_jax_export
    from jaxcolo.inspection import inspect_nested_spec_tree
    exported, specs, avals = _open_bundle(data, header.min_reader_version)
    nested = envelope.decode_nested
    out = {"exported": nested(lambda d: inspect_jax_export(d, nested=True),
                              exported, "$.exported")}
    if specs is not None:
        out["specs"] = nested(inspect_nested_spec_tree, specs, "$.specs")[0]
    if avals is not None:
        out["exported_avals"] = nested(inspect_nested_spec_tree, avals,
                                       "$.exported_avals")[0]
    return out


def _register():
    from jaxcolo.inspection import register_inspector
    from jaxcolo.payload import register_root
    register_root(RootKind.export_bundle, unbundle)
    register_inspector(RootKind.export_bundle, inspect_bundle)


_register()
