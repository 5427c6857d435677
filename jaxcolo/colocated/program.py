"""Program payloads: one specialised colocated Python program as bytes.

A program payload is a jaxcolo envelope (root kind ``program``, schema version
2) around the ``Program`` table of ``schema/colocated.fbs``:

* ``body``: cloudpickle bytes (the function, or ``(class, init args, init
  kwargs)`` for a method).  It is the only pickled field, and decoding a
  program never unpickles it: :func:`decode_program` returns it as bytes; an
  executor loads it (``jaxcolo.colocated.body.loads_body``) when it runs the
  program.
* ``in_specs`` / ``out_specs``: complete spec payloads (``jaxcolo.serialize``
  of ``ShapeDtypeStruct`` trees), decoded with the spec codec.  ``in_specs``
  is the ``(args, kwargs)`` tree; ``out_specs`` is absent until discovered.
* ``device_ids``: the execution devices, resolved through the reader's device
  resolver like every device id in jaxcolo.

Executors receive a :class:`ProgramRef`: the payload bytes and their content
id (so a remote executor can register a program once and refer to it by id).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import numpy as np
from jax._src import tree_util as jtu

import jaxcolo_fb as fb
from jaxcolo_fb import ProgramKind, RootKind
from jaxcolo import envelope, versions
from jaxcolo.codec import spec_tree
from jaxcolo.codec.mesh import make_resolver
from jaxcolo.errors import EncodeError, PayloadError
from jaxcolo.fastbuilder import FastBuilder
from jaxcolo.wire import Buffer, check_enum, enum_values, layout

L = layout(fb, "Program")
KINDS = {"function": ProgramKind.function, "method": ProgramKind.method}
KIND_NAMES = {v: k for k, v in KINDS.items()}
_KIND_VALUES = enum_values(ProgramKind)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ProgramRef:
    """A program payload as executors receive it.

    ``id`` is the payload's content id (BLAKE2b-128 of the bytes): equal
    payloads have equal ids, so an executor may cache whatever it derives
    from a payload under its id.
    """

    id: bytes
    payload: bytes

    @classmethod
    def of(cls, payload: bytes) -> "ProgramRef":
        return cls(hashlib.blake2b(payload, digest_size=16).digest(), payload)

    def __repr__(self):
        return f"ProgramRef({self.id.hex()}, {len(self.payload)} bytes)"


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A decoded program payload.  ``body`` is still pickle bytes."""

    name: str
    kind: str                    # "function" | "method"
    body: bytes
    in_specs: Any                # (args, kwargs) tree of ShapeDtypeStruct
    out_specs: Any               # output tree of ShapeDtypeStruct, or None
    has_out_specs: bool          # False: the executor discovers them
    devices: tuple               # resolved jax devices, in order
    device_ids: tuple            # as in the payload
    method_name: str | None
    instance_id: int | None
    source_info: str | None
    writer_version: int

    @property
    def in_treedef(self):
        return jtu.tree_structure(self.in_specs)

    @property
    def in_leaves(self) -> list:
        return jtu.tree_leaves(self.in_specs)


# ----------------------------------------------------------------- encode

def encode_program(*, name: str, kind: str, body: bytes,
                   in_specs: bytes, out_specs: bytes | None,
                   device_ids, method_name: str | None = None,
                   instance_id: int | None = None,
                   source_info: str | None = None,
                   version: int | None = None) -> bytes:
    """Encode a program payload.

    ``in_specs``/``out_specs`` are spec payloads (``jaxcolo.serialize``
    output) written at ``version`` or older.  Raises EncodeError when
    ``version`` predates programs (schema version 2).
    """
    version = versions.check_writable(version)
    min_reader = versions.require("program", version, "$")
    if kind not in KINDS:
        raise EncodeError(f"unknown program kind {kind!r}", "$.kind")
    if (kind == "method") != (method_name is not None):
        raise EncodeError("method_name is given exactly for kind 'method'",
                          "$.method_name")
    for field, nested in (("in_specs", in_specs), ("out_specs", out_specs)):
        if nested is None:
            continue
        h = envelope.read_header(nested, check_crc=False)
        if h.root_kind != RootKind.spec_tree or h.writer_version > version:
            raise EncodeError(
                f"{field} must be a spec payload of version <= {version}, got "
                f"root kind {h.root_kind} version {h.writer_version}",
                f"$.{field}")
        min_reader = max(min_reader, h.min_reader_version)
    if kind == "method" and not instance_id:
        raise EncodeError("a method program needs a nonzero instance_id",
                          "$.instance_id")
    ids = np.asarray(list(device_ids), np.int64)
    if ids.size == 0:
        raise EncodeError("a program needs at least one device", "$.device_ids")
    b = FastBuilder(256 + len(body) + len(in_specs) + len(out_specs or b""))
    offs = {
        "name": b.CreateString(name),
        "body": b.CreateByteVector(body),
        "in_specs": b.CreateByteVector(in_specs),
        "device_ids": b.CreateNumpyVector(ids),
    }
    if out_specs is not None:
        offs["out_specs"] = b.CreateByteVector(out_specs)
    if method_name is not None:
        offs["method_name"] = b.CreateString(method_name)
    if source_info:
        offs["source_info"] = b.CreateString(source_info)
    fb.ProgramStart(b)
    for field, off in offs.items():
        getattr(fb, "ProgramAdd" + "".join(
            p.capitalize() for p in field.split("_")))(b, off)
    fb.ProgramAddKind(b, KINDS[kind])
    if instance_id is not None:
        fb.ProgramAddInstanceId(b, instance_id)
    b.Finish(fb.ProgramEnd(b))
    return envelope.seal(b.Output(), RootKind.program, version, min_reader)


# ----------------------------------------------------------------- decode

@dataclasses.dataclass(frozen=True)
class RawProgram:
    """The fields of a program payload, nothing decoded beyond the table."""

    header: envelope.Header
    name: str
    kind: str
    body: bytes
    in_specs: bytes
    out_specs: bytes | None
    device_ids: tuple
    method_name: str | None
    instance_id: int | None
    source_info: str | None


@envelope.shares_inflation
def read_program(data, reader_version: int | None = None) -> RawProgram:
    """Check the envelope and the Program table; decode no nested payload."""
    header = envelope.read_header(data)
    envelope.check_readable(header, reader_version)
    if header.root_kind != RootKind.program:
        raise PayloadError(f"root kind {header.root_kind} is not a program",
                           "$.header.root_kind")
    buf = Buffer(envelope.open_body(data, header))
    root = buf.root("$")
    name = root.string(L.name, "$", "name")
    if not name:
        raise PayloadError("program name missing", "$.name")
    kind = KIND_NAMES[check_enum(root.scalar(L.kind, "u8", 0, "$", "kind"),
                                 _KIND_VALUES, "$.kind", "ProgramKind")]
    body = root.bytes(L.body, "$", "body")
    if not body:
        raise PayloadError("program body missing", "$.body")
    in_specs = root.bytes(L.in_specs, "$", "in_specs")
    if in_specs is None:
        raise PayloadError("in_specs missing", "$.in_specs")
    out_specs = root.bytes(L.out_specs, "$", "out_specs")
    for field, nested in (("in_specs", in_specs), ("out_specs", out_specs)):
        if nested is not None:
            envelope.check_nested_declared(nested, header, f"$.{field}")
    ids = root.ints(L.device_ids, "i64", "$", "device_ids")
    if not ids:
        raise PayloadError("a program needs at least one device",
                           "$.device_ids")
    if len(set(ids)) != len(ids):
        raise PayloadError(f"duplicate device ids {list(ids)}", "$.device_ids")
    method_name = root.string(L.method_name, "$", "method_name")
    instance_id = root.scalar(L.instance_id, "i64", None, "$", "instance_id")
    if kind == "method":
        if not method_name:
            raise PayloadError("a method program needs method_name",
                               "$.method_name")
        if instance_id is None:
            raise PayloadError("a method program needs instance_id",
                               "$.instance_id")
    elif method_name is not None or instance_id is not None:
        raise PayloadError("a function program has no method_name or "
                           "instance_id", "$.method_name")
    source_info = root.string(L.source_info, "$", "source_info")
    return RawProgram(header, name, kind, body, in_specs, out_specs, ids,
                      method_name, instance_id, source_info)


def _decode_specs(data: bytes, field: str, resolver, writer_version: int, *,
                  args_kwargs: bool):
    try:
        check_nested_writer(data, writer_version)
        tree = spec_tree.decode_spec_tree(data, resolver)
        check_spec_shape(tree, args_kwargs)
    except PayloadError as e:
        raise type(e)(e.reason, f"$.{field}{e.path[1:]}") from None
    return tree


def check_nested_writer(data: bytes, writer_version: int) -> None:
    """PayloadError unless spec payload ``data`` is no newer than the
    program (of ``writer_version``) holding it."""
    nested = envelope.read_header(data, check_crc=False)
    if nested.writer_version > writer_version:
        raise PayloadError(
            f"spec payload of version {nested.writer_version} inside a "
            f"program of version {writer_version}", "$.header.writer_version")


def check_spec_shape(tree, args_kwargs: bool) -> None:
    """PayloadError (at "$") unless ``tree`` is what a program holds: an
    ``(args tuple, kwargs dict)`` pair (``args_kwargs``) whose leaves, like
    out specs' leaves, are ShapeDtypeStructs with shardings."""
    if args_kwargs and not (isinstance(tree, tuple) and len(tree) == 2 and
                            isinstance(tree[0], tuple) and
                            isinstance(tree[1], dict)):
        raise PayloadError("in_specs must be an (args tuple, kwargs dict) "
                           f"pair, got {type(tree).__name__}", "$")
    leaves = jtu.tree_leaves(tree)
    for i, leaf in enumerate(leaves):
        if type(leaf) is not jax.ShapeDtypeStruct or leaf.sharding is None:
            raise PayloadError(
                f"leaf {i} is {type(leaf).__name__}, expected a "
                "ShapeDtypeStruct with a sharding", "$")


@envelope.shares_inflation
def decode_program(data, device_resolver=None) -> Program:
    """Decode a program payload without unpickling its body.

    Raises PayloadError (with the field path, nested spec payload paths
    prefixed by their field: ``$.in_specs.meshes[0]``) for bad bytes or
    device ids the resolver does not know.
    """
    raw = read_program(data)
    resolver = make_resolver(device_resolver)
    version = raw.header.writer_version
    in_specs = _decode_specs(raw.in_specs, "in_specs", resolver, version,
                             args_kwargs=True)
    out_specs = None if raw.out_specs is None else _decode_specs(
        raw.out_specs, "out_specs", resolver, version, args_kwargs=False)
    devices = tuple(resolver.devices(raw.device_ids, "$.device_ids"))
    return Program(raw.name, raw.kind, raw.body, in_specs, out_specs,
                   raw.out_specs is not None, devices, raw.device_ids,
                   raw.method_name, raw.instance_id, raw.source_info,
                   raw.header.writer_version)


# ---------------------------------------------------------------- inspect

def inspect_program(data, header) -> dict:
    """``jaxcolo.inspect`` content of a program payload (body not loaded)."""
    from jaxcolo.inspection import UNAVAILABLE, inspect_nested_spec_tree

    raw = read_program(data, header.min_reader_version)

    def specs(nested, field):  # refusing what decode_program refuses
        try:
            check_nested_writer(nested, raw.header.writer_version)
            info, tree = inspect_nested_spec_tree(nested)
            if tree is not UNAVAILABLE:
                check_spec_shape(tree, field == "in_specs")
        except PayloadError as e:
            raise type(e)(e.reason, f"$.{field}{e.path[1:]}") from None
        keep = ("writer_version", "size", "structure", "num_leaves", "leaves",
                "devices_unavailable", "content_unavailable")
        return {k: info[k] for k in keep if k in info}

    out = {"name": raw.name, "kind": raw.kind, "device_ids": list(raw.device_ids),
           "body_size": len(raw.body), "body_format": "cloudpickle (not loaded)",
           "in_specs": specs(raw.in_specs, "in_specs"),
           "out_specs": (specs(raw.out_specs, "out_specs")
                         if raw.out_specs is not None else
                         "absent: discovered at the first call")}
    if raw.kind == "method":
        out["method_name"] = raw.method_name
        out["instance_id"] = raw.instance_id
    if raw.source_info:
        out["source_info"] = raw.source_info
    return out


def _register() -> None:
    """Make this root kind known to jaxcolo.deserialize / jaxcolo.inspect."""
    from jaxcolo.inspection import register_inspector
    from jaxcolo.payload import register_root
    register_root(RootKind.program, decode_program)
    register_inspector(RootKind.program, inspect_program)


_register()
