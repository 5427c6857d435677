"""Executor messages: the payloads a controller and its workers exchange.

Every frame after the Hello is one jaxcolo payload of root kind ``message``
(``schema/executor.fbs``): an envelope around a ``Message`` table.  This
module encodes :class:`Message` objects and decodes bytes back into them,
checking every field (through ``jaxcolo.wire``) so that a malformed frame is
a :class:`~jaxcolo.PayloadError` naming the field, never a crash.

Array shards travel as :class:`Shards` columns (see the schema); their bytes
are in the message (small), in the sender's shared memory, or in frames that
follow the message.  Nothing here is pickle except ``error_pickle``, the
exception object of a failed call, which only the controller loads.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

import jaxcolo_fb as fb
from jaxcolo_fb import BufferFormat, BufferWhere, MessageKind, RootKind
from jaxcolo import envelope, versions
from jaxcolo.errors import EncodeError, PayloadError
from jaxcolo.fastbuilder import FastBuilder, offset_vector
from jaxcolo.process import templates
from jaxcolo.wire import Buffer, check_enum, enum_values, layout

L = layout(fb, "Message")
LS = layout(fb, "Shards")
LG = layout(fb, "Segment")
KINDS = enum_values(MessageKind)
KIND_NAMES = {v: k for k, v in vars(MessageKind).items()
              if not k.startswith("_") and isinstance(v, int)}
_WHERE = enum_values(BufferWhere)
_FORMAT = enum_values(BufferFormat)
PROGRAM_ID_SIZE = 16
MAX_LIST = 1 << 24


@dataclasses.dataclass
class Shards:
    """Shard and buffer columns (see ``table Shards`` in the schema).

    Shard columns: ``leaf``, ``device``, ``buffer`` (one entry per shard).
    Buffer columns: ``where``, ``format``, ``offset``, ``size``, ``segment``,
    ``lease`` (one entry per buffer).  ``data``: bytes of in-message buffers.
    """

    leaf: list = dataclasses.field(default_factory=list)
    device: list = dataclasses.field(default_factory=list)
    buffer: list = dataclasses.field(default_factory=list)
    where: list = dataclasses.field(default_factory=list)
    format: list = dataclasses.field(default_factory=list)
    offset: list = dataclasses.field(default_factory=list)
    size: list = dataclasses.field(default_factory=list)
    segment: list = dataclasses.field(default_factory=list)
    lease: list = dataclasses.field(default_factory=list)
    data: bytes = b""

    @property
    def num_buffers(self) -> int:
        return len(self.where)


@dataclasses.dataclass
class Message:
    kind: int
    call_id: int = 0
    lane: int = 0
    program_id: bytes | None = None
    program: bytes | None = None
    shards: Shards | None = None
    segments: list = dataclasses.field(default_factory=list)  # (id, name, size)
    released: list = dataclasses.field(default_factory=list)
    specs: bytes | None = None
    instance_id: int = 0
    ordered: bool = False
    error_type: str | None = None
    error_message: str | None = None
    error_traceback: str | None = None
    error_pickle: bytes | None = None
    stats: dict | None = None
    token: bytes | None = None
    heartbeat_ms: int = 0
    pid: int = 0
    text: str | None = None
    forgotten: list = dataclasses.field(default_factory=list)  # program ids
    # the inflation budget of this message's decode (envelope.Inflation):
    # the payloads nested in it (a program, specs) decoded later share it
    inflation: object = dataclasses.field(default=None, compare=False,
                                          repr=False)

    @property
    def kind_name(self) -> str:
        return KIND_NAMES.get(self.kind, str(self.kind))


# ------------------------------------------------------------------ encode

def _u64(b, values) -> int:
    return b.CreateNumpyVector(np.asarray(values, np.uint64))


def _u32(b, values) -> int:
    return b.CreateNumpyVector(np.asarray(values, np.uint32))


def _strings(b, values) -> int:
    return offset_vector(b, [b.CreateString(s) for s in values])


def _build_shards(b, s: Shards) -> int:
    offs = (_u32(b, s.leaf), _u32(b, s.device), _u32(b, s.buffer),
            b.CreateByteVector(bytes(s.where)),
            b.CreateByteVector(bytes(s.format)), _u64(b, s.offset),
            _u64(b, s.size), _u64(b, s.segment), _u64(b, s.lease),
            b.CreateByteVector(s.data) if s.data else 0)
    fb.ShardsStart(b)
    for add, off in zip((fb.ShardsAddLeaf, fb.ShardsAddDevice,
                         fb.ShardsAddBuffer, fb.ShardsAddWhere,
                         fb.ShardsAddFormat, fb.ShardsAddOffset,
                         fb.ShardsAddSize, fb.ShardsAddSegment,
                         fb.ShardsAddLease, fb.ShardsAddData), offs):
        if off:
            add(b, off)
    return fb.ShardsEnd(b)


def _build_segments(b, segments) -> int:
    offs = []
    for sid, name, size in segments:
        n = b.CreateString(name)
        fb.SegmentStart(b)
        fb.SegmentAddId(b, sid)
        fb.SegmentAddName(b, n)
        fb.SegmentAddSize(b, size)
        offs.append(fb.SegmentEnd(b))
    return offset_vector(b, offs)


def encode(m: Message, version: int | None = None) -> bytes:
    """The payload of message ``m`` (written at ``version``, >= 2)."""
    data = templates.encode(m, version, _encode)
    return data if data is not None else _encode(m, version)


def _encode(m: Message, version: int | None = None) -> bytes:
    version = versions.check_writable(version)
    since = versions.require("message", version, "$")
    feature = _KIND_FEATURES.get(m.kind)
    if feature is not None:
        since = max(since, versions.require(feature, version, "$.kind"))
    if m.forgotten:
        since = max(since, versions.require("message_forget", version,
                                            "$.forgotten"))
        if any(type(p) is not bytes or len(p) != PROGRAM_ID_SIZE
               for p in m.forgotten):
            raise EncodeError(f"forgotten: program ids are "
                              f"{PROGRAM_ID_SIZE} bytes each", "$.forgotten")
    for field, nested in (("program", m.program), ("specs", m.specs)):
        if nested is not None:  # readers of the message read these too
            since = max(since, envelope.nested_min_reader(
                nested, version, f"$.{field}", EncodeError))
    data_size = len(m.shards.data) if m.shards is not None else 0
    b = FastBuilder(256 + data_size + len(m.program or b""))
    offs = {}
    if m.program_id is not None:
        offs[fb.MessageAddProgramId] = b.CreateByteVector(m.program_id)
    if m.program is not None:
        offs[fb.MessageAddProgram] = b.CreateByteVector(m.program)
    if m.shards is not None:
        offs[fb.MessageAddShards] = _build_shards(b, m.shards)
    if m.segments:
        offs[fb.MessageAddSegments] = _build_segments(b, m.segments)
    if m.released:
        offs[fb.MessageAddReleased] = _u64(b, m.released)
    if m.specs is not None:
        offs[fb.MessageAddSpecs] = b.CreateByteVector(m.specs)
    for add, text in ((fb.MessageAddErrorType, m.error_type),
                      (fb.MessageAddErrorMessage, m.error_message),
                      (fb.MessageAddErrorTraceback, m.error_traceback),
                      (fb.MessageAddText, m.text)):
        if text is not None:
            offs[add] = b.CreateString(text)
    if m.error_pickle is not None:
        offs[fb.MessageAddErrorPickle] = b.CreateByteVector(m.error_pickle)
    if m.stats:
        offs[fb.MessageAddStatNames] = _strings(b, list(m.stats))
        offs[fb.MessageAddStatValues] = b.CreateNumpyVector(
            np.asarray(list(m.stats.values()), np.int64))
    if m.token is not None:
        offs[fb.MessageAddToken] = b.CreateByteVector(m.token)
    if m.forgotten:
        offs[fb.MessageAddForgotten] = b.CreateByteVector(
            b"".join(m.forgotten))
    fb.MessageStart(b)
    fb.MessageAddKind(b, m.kind)
    if m.call_id:
        fb.MessageAddCallId(b, m.call_id)
    if m.lane:
        fb.MessageAddLane(b, m.lane)
    if m.instance_id:
        fb.MessageAddInstanceId(b, m.instance_id)
    if m.ordered:
        fb.MessageAddOrdered(b, True)
    if m.heartbeat_ms:
        fb.MessageAddHeartbeatMs(b, m.heartbeat_ms)
    if m.pid:
        fb.MessageAddPid(b, m.pid)
    for add, off in offs.items():
        add(b, off)
    b.Finish(fb.MessageEnd(b))
    return envelope.seal(b.Output(), RootKind.message, version, since)


# ------------------------------------------------------------------ decode

def _column(t, voff, kind, path, name, n=None):
    values = t.ints(voff, kind, path, name)
    if n is not None and len(values) != n:
        raise PayloadError(f"{len(values)} entries, expected {n}",
                           f"{path}.{name}")
    return values


def _read_shards(t, path) -> Shards:
    leaf = _column(t, LS.leaf, "u32", path, "leaf")
    n = len(leaf)
    device = _column(t, LS.device, "u32", path, "device", n)
    buffer = _column(t, LS.buffer, "u32", path, "buffer", n)
    where = t.bytes(LS.where, path, "where") or b""
    m = len(where)
    fmt = t.bytes(LS.format, path, "format") or b""
    if len(fmt) != m:
        raise PayloadError(f"{len(fmt)} entries, expected {m}",
                           f"{path}.format")
    offset = _column(t, LS.offset, "u64", path, "offset", m)
    size = _column(t, LS.size, "u64", path, "size", m)
    segment = _column(t, LS.segment, "u64", path, "segment", m)
    lease = _column(t, LS.lease, "u64", path, "lease", m)
    data = t.bytes(LS.data, path, "data") or b""
    for i, j in enumerate(buffer):
        if j >= m:
            raise PayloadError(f"buffer {j} out of range ({m} buffers)",
                               f"{path}.buffer[{i}]")
    for j in range(m):
        check_enum(where[j], _WHERE, f"{path}.where[{j}]", "BufferWhere")
        check_enum(fmt[j], _FORMAT, f"{path}.format[{j}]", "BufferFormat")
        if size[j] < 0 or offset[j] < 0:
            raise PayloadError("negative size or offset", f"{path}.size[{j}]")
        if where[j] == BufferWhere.message and offset[j] + size[j] > len(data):
            raise PayloadError(
                f"buffer {j} ({offset[j]}+{size[j]} bytes) exceeds the "
                f"{len(data)} data bytes", f"{path}.offset[{j}]")
    return Shards(leaf, device, buffer, where, fmt, offset, size, segment,
                  lease, data)


def _read_segments(root) -> list:
    out = []
    for i, pos in enumerate(root.tables(L.segments, "$", "segments")):
        path = f"$.segments[{i}]"
        t = root.buf.table_at(pos, path)
        name = t.string(LG.name, path, "name")
        if name is None or not _SEGMENT_NAME.fullmatch(name):
            raise PayloadError(f"invalid segment name {name!r:.80}",
                               f"{path}.name")
        sid = t.scalar(LG.id, "u64", 0, path, "id")
        size = t.scalar(LG.size, "u64", 0, path, "size")
        if not 0 < size <= MAX_SEGMENT:
            raise PayloadError(f"invalid segment size {size}",
                               f"{path}.size")
        out.append((sid, name, size))
    return out


# What blobs.SegmentPool names its segments (a file name under /dev/shm).
_SEGMENT_NAME = re.compile(r"jaxcolo-[0-9A-Za-z_-]{1,200}")
MAX_SEGMENT = 1 << 46


# Message kinds newer than messages themselves: the feature each needs.
_KIND_FEATURES = {MessageKind.resume: "message_resume",
                  MessageKind.forget: "message_forget"}


def decode(data, reader_version: int | None = None) -> Message:
    """Decode a message payload; PayloadError for anything malformed."""
    if type(data) is bytes:  # a repeated call or result: its template
        m = templates.match_frame(data, reader_version)
        if m is not None:  # the budget a full decode leaves it
            budget = envelope.current_inflation()
            if budget is None:
                budget = envelope.Inflation(envelope.initial_budget(
                    len(data) - envelope.HEADER_SIZE))
            elif budget.left is None:
                budget.left = envelope.initial_budget(
                    len(data) - envelope.HEADER_SIZE)
            m.inflation = budget
            return m
    return _decode(data, reader_version)


@envelope.shares_inflation
def _decode(data, reader_version: int | None = None) -> Message:
    header = envelope.read_header(data)
    envelope.check_readable(header, reader_version)
    if header.root_kind != RootKind.message:
        raise PayloadError(f"root kind {header.root_kind} is not a message",
                           "$.header.root_kind")
    body = envelope.open_body(data, header)
    m = templates.match(body, header, data, reader_version)
    if m is not None:
        m.inflation = envelope.current_inflation()
        return m
    m = _decode_body(body)
    feature = _KIND_FEATURES.get(m.kind)
    if m.forgotten:
        feature = "message_forget"
    if feature is not None and \
            header.min_reader_version < versions.FEATURE_SINCE[feature]:
        raise PayloadError(
            f"{feature} needs reader version >= "
            f"{versions.FEATURE_SINCE[feature]}, but the header declares "
            f"min_reader_version {header.min_reader_version}",
            "$.header.min_reader_version")
    for field, nested in (("program", m.program), ("specs", m.specs)):
        if nested is not None:
            envelope.check_nested_declared(nested, header, f"$.{field}")
    templates.learn(body, header, m, _encode, data, reader_version)
    m.inflation = envelope.current_inflation()
    return m


def _decode_body(body) -> Message:
    root = Buffer(body).root("$")
    kind = check_enum(root.scalar(L.kind, "u8", 0, "$", "kind"), KINDS,
                      "$.kind", "MessageKind")
    if kind == MessageKind.invalid:
        raise PayloadError("message kind missing", "$.kind")
    m = Message(kind)
    m.call_id = root.scalar(L.call_id, "u64", 0, "$", "call_id")
    m.lane = root.scalar(L.lane, "u64", 0, "$", "lane")
    m.program_id = root.bytes(L.program_id, "$", "program_id")
    if m.program_id is not None and len(m.program_id) != PROGRAM_ID_SIZE:
        raise PayloadError(f"program id of {len(m.program_id)} bytes",
                           "$.program_id")
    m.program = root.bytes(L.program, "$", "program")
    st = root.table(L.shards, "$", "shards")
    if st is not None:
        m.shards = _read_shards(st, "$.shards")
    m.segments = _read_segments(root)
    m.released = list(root.ints(L.released, "u64", "$", "released"))
    m.specs = root.bytes(L.specs, "$", "specs")
    m.instance_id = root.scalar(L.instance_id, "i64", 0, "$", "instance_id")
    m.ordered = bool(root.scalar(L.ordered, "u8", 0, "$", "ordered"))
    m.error_type = root.string(L.error_type, "$", "error_type")
    m.error_message = root.string(L.error_message, "$", "error_message")
    m.error_traceback = root.string(L.error_traceback, "$", "error_traceback")
    m.error_pickle = root.bytes(L.error_pickle, "$", "error_pickle")
    names = root.strings(L.stat_names, "$", "stat_names")
    if names:
        values = root.ints(L.stat_values, "i64", "$", "stat_values")
        if len(values) != len(names):
            raise PayloadError(f"{len(values)} stat values for {len(names)} "
                               "names", "$.stat_values")
        if len(set(names)) != len(names):
            raise PayloadError("duplicate stat names", "$.stat_names")
        m.stats = dict(zip(names, values))
    m.token = root.bytes(L.token, "$", "token")
    m.heartbeat_ms = root.scalar(L.heartbeat_ms, "u32", 0, "$", "heartbeat_ms")
    m.pid = root.scalar(L.pid, "u32", 0, "$", "pid")
    m.text = root.string(L.text, "$", "text")
    ids = root.bytes(L.forgotten, "$", "forgotten")
    if ids:
        if len(ids) % PROGRAM_ID_SIZE:
            raise PayloadError(f"{len(ids)} bytes, not a whole number of "
                               f"{PROGRAM_ID_SIZE}-byte program ids",
                               "$.forgotten")
        m.forgotten = [bytes(ids[i:i + PROGRAM_ID_SIZE])
                       for i in range(0, len(ids), PROGRAM_ID_SIZE)]
    return m


def decode_with_resolver(data, device_resolver=None) -> Message:
    """``jaxcolo.deserialize`` of a message: shard device ids stay ids; the
    jaxcolo payloads nested in it (a program, specs) are decoded as their
    receivers decode them, refusing what those refuse (paths under
    ``$.program`` / ``$.specs``), and kept as bytes.  Nested bytes that are
    no jaxcolo payload are opaque here, as to the writer (their receiver
    judges them)."""
    from jaxcolo.codec import spec_tree
    from jaxcolo.colocated.program import decode_program
    m = decode(data)
    with envelope.inflation_scope(m.inflation):
        if m.program is not None and envelope.is_envelope(m.program):
            envelope.decode_nested(decode_program, m.program, "$.program",
                                   device_resolver)
        if m.specs is not None and envelope.is_envelope(m.specs):
            envelope.decode_nested(spec_tree.decode_spec_tree, m.specs,
                                   "$.specs", device_resolver)
    return m


def _inspect_program(data) -> dict:
    from jaxcolo.inspection import inspect
    header = envelope.read_header(data)
    if header.root_kind != RootKind.program:
        raise PayloadError(f"root kind {header.root_kind} is not a program",
                           "$.header.root_kind")
    return inspect(data)


def inspect_message(data, header) -> dict:
    """``jaxcolo.inspect`` content of a message payload (nested payloads
    inspected too, refusing what decoders refuse)."""
    m = decode(data, header.min_reader_version
               if header.min_reader_version > 1 else None)
    out = {"kind": m.kind_name}
    for field in ("call_id", "lane", "instance_id", "heartbeat_ms", "pid"):
        value = getattr(m, field)
        if value:
            out[field] = value
    if m.ordered:
        out["ordered"] = True
    if m.program_id is not None:
        out["program_id"] = m.program_id.hex()
    if m.program is not None:
        out["program_size"] = len(m.program)
        if envelope.is_envelope(m.program):
            out["program"] = envelope.decode_nested(
                _inspect_program, m.program, "$.program")
    if m.shards is not None:
        out["shards"] = len(m.shards.leaf)
        out["buffers"] = {KIND_WHERE.get(w, str(w)): sum(
            1 for x in m.shards.where if x == w) for w in set(m.shards.where)}
        out["buffer_bytes"] = int(sum(m.shards.size))
    for field in ("segments", "released"):
        if getattr(m, field):
            out[field] = len(getattr(m, field))
    if m.forgotten:
        out["forgotten"] = [p.hex() for p in m.forgotten]
    if m.specs is not None:
        from jaxcolo.inspection import inspect_nested_spec_tree
        out["specs_size"] = len(m.specs)
        if envelope.is_envelope(m.specs):
            out["specs"] = envelope.decode_nested(
                inspect_nested_spec_tree, m.specs, "$.specs")[0]
    for field in ("error_type", "error_message", "text"):
        if getattr(m, field) is not None:
            out[field] = getattr(m, field)
    if m.error_pickle is not None:
        out["error_pickle_size"] = len(m.error_pickle)
    if m.stats:
        out["stats"] = dict(m.stats)
    return out


KIND_WHERE = {v: k for k, v in vars(BufferWhere).items()
              if not k.startswith("_") and isinstance(v, int)}


def _register() -> None:
    """Make this root kind known to jaxcolo.deserialize / jaxcolo.inspect."""
    from jaxcolo.inspection import register_inspector
    from jaxcolo.payload import register_root
    register_root(RootKind.message, decode_with_resolver)
    register_inspector(RootKind.message, inspect_message)


_register()
