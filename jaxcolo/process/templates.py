"""Message templates: the cheap path for repeated calls and results.

Calls and results of one program with small inputs repeat the same message
layout with a new call id, lane and data bytes.

* An *encoder* template is a body built once by the full encoder, with the
  positions of those three fields: ``fill`` copies it and patches them in.
* A *decoder* template is a body that the full decoder accepted and that the
  full encoder writes byte for byte, with those three regions masked: a frame
  equal to it outside them has the same (checked) structure, so ``match``
  reads only the three and rebuilds the message from the template's own.

Contract: a template never changes what is written or read.  ``encode``
returns exactly the bytes the full encoder writes for the message, and a
matched decode returns a message equal to what the full decoder returns.
Both caches are bounded (``MAX_TEMPLATES`` templates of at most
``MAX_BODY`` bytes: larger messages are not templated) and thread safe.

This module knows the message layout (``jaxcolo_fb``) but not the message
codec: ``jaxcolo.process.messages`` passes its full encoder in.
"""

from __future__ import annotations

import dataclasses
import struct
import threading
import zlib
from typing import Callable

import jaxcolo_fb as fb
from jaxcolo_fb import BufferWhere, MessageKind, RootKind
from jaxcolo import envelope, versions
from jaxcolo.errors import EncodeError
from jaxcolo.wire import Buffer, layout

L = layout(fb, "Message")
LS = layout(fb, "Shards")
KINDS = frozenset((MessageKind.call, MessageKind.discover, MessageKind.result))
MAX_TEMPLATES = 256
MAX_BODY = 64 * 1024  # bodies (and in-message data) templated at most
_U64 = struct.Struct("<Q")
_ZERO8 = bytes(8)

_ENCODE: dict = {}   # template key -> _Template
_DECODE: dict = {}   # (body size, writer, min reader) -> [_Template, ...]
# (frame size, reader version) -> [(header bytes 0..11, _Template), ...]:
# the decoder templates with the uncompressed envelope header they came in
# (see match_frame)
_FRAMES: dict = {}
_PREFIX = 12  # magic, versions, root kind, flags, reserved: all but the crc
_CRC = struct.Struct("<I")
_LEARN_LOCK = threading.Lock()


def template_key(m, version):
    """The key of messages ``m`` shares a layout with, or None when ``m``
    is not templated (other fields set, or buffers outside the message)."""
    s = m.shards
    if (m.program is not None or m.segments or m.released or
            m.specs is not None or m.error_type is not None or m.stats or
            m.token is not None or m.text is not None or m.instance_id or
            m.heartbeat_ms or m.pid or m.error_pickle is not None or
            m.error_message is not None or m.error_traceback is not None):
        return None
    if s is None:
        return (m.kind, version, m.program_id, m.ordered, bool(m.lane), None)
    if any(w != BufferWhere.message for w in s.where):
        return None
    return (m.kind, version, m.program_id, m.ordered, bool(m.lane),
            tuple(s.leaf),
            tuple(s.device), tuple(s.buffer), bytes(s.where),
            bytes(s.format), tuple(s.offset), tuple(s.size), len(s.data))


def _positions(body):
    """(call_id, lane, data start, data size) positions in a body."""
    root = Buffer(bytes(body)).root("$")
    call = root._field(L.call_id, 8, "$", "call_id")
    lane = root._field(L.lane, 8, "$", "lane")
    data = (0, 0)
    st = root.table(L.shards, "$", "shards")
    if st is not None:
        data = st._vector(LS.data, 1, "$.shards", "data") or (0, 0)
    return call, lane, data[0], data[1]


class _Template:
    __slots__ = ("head", "body", "call", "lane", "data", "size", "proto",
                 "spans")

    def __init__(self, body, header_of, proto):
        self.body = bytes(body)
        self.call, self.lane, self.data, self.size = _positions(body)
        self.head = header_of
        self.proto = proto
        self.spans = None  # (start, bytes) outside the masked regions

    def _mask_spans(self) -> None:
        cuts = sorted([(self.call, 8)] + ([(self.lane, 8)] if self.lane
                                          else []) +
                      ([(self.data, self.size)] if self.size else []))
        spans, pos = [], 0
        for start, n in cuts:
            if start > pos:
                spans.append((pos, self.body[pos:start]))
            pos = max(pos, start + n)
        if pos < len(self.body):
            spans.append((pos, self.body[pos:]))
        self.spans = tuple(spans)

    def fill(self, m) -> bytes:
        return self.fill_fields(m.call_id, m.lane,
                                m.shards.data if self.size else b"")

    def fill_fields(self, call_id: int, lane: int, data) -> bytes:
        body = bytearray(self.body)
        _U64.pack_into(body, self.call, call_id)
        if self.lane:
            _U64.pack_into(body, self.lane, lane)
        if self.size:
            body[self.data:self.data + self.size] = data
        return envelope.seal(body, RootKind.message, *self.head)

    def match(self, body, base: int = 0):
        # (body: bytes of the template's size, from ``base`` on) equal
        # outside the masked regions, compared in place
        for start, part in self.spans:
            if not body.startswith(part, start + base):
                return None
        call = _U64.unpack_from(body, self.call + base)[0]
        lane = _U64.unpack_from(body, self.lane + base)[0] if self.lane else 0
        data = body[self.data + base:self.data + base + self.size] \
            if self.size else b""
        p = self.proto
        s = p.shards
        if s is not None:  # columns shared with the template: read-only
            s = type(s)(s.leaf, s.device, s.buffer, s.where, s.format,
                        s.offset, s.size, s.segment, s.lease, data)
        return type(p)(p.kind, call, lane, p.program_id, None, s,
                       ordered=p.ordered)


def encode(m, version, encode_full: Callable) -> bytes | None:
    """``m`` encoded through its template (made with ``encode_full`` on
    first use), or None when ``m`` is not templated."""
    if m.kind not in KINDS or not m.call_id:
        return None
    if m.shards is not None and len(m.shards.data) > MAX_BODY:
        return None
    key = template_key(m, version)
    if key is None:
        return None
    t = _ENCODE.get(key)
    if t is None:
        version = versions.check_writable(version)
        since = versions.require("message", version, "$")
        probe = dataclasses.replace(m, call_id=1, lane=1 if m.lane else 0)
        if m.shards is not None:
            probe.shards = dataclasses.replace(
                m.shards, data=bytes(len(m.shards.data)))
        data = encode_full(probe, version)
        t = _Template(data[envelope.HEADER_SIZE:], (version, since), None)
        if len(t.body) > MAX_BODY:  # (many shard columns): not kept
            return t.fill(m)
        if len(_ENCODE) >= MAX_TEMPLATES:
            _ENCODE.clear()
        _ENCODE[key] = t
    return t.fill(m)


_INLINE: dict = {}  # inline key -> _Template (see encode_inline)


def encode_inline(key, call_id: int, lane: int, data) -> bytes | None:
    """The message of inline key ``key`` (``packing.inline_shards``'s
    signature with the message's kind, version, program id, ordered flag
    and whether it has a lane) with this call id, lane and in-message data,
    through the template its first message left (``remember_inline``);
    None before that.  Exactly the bytes ``encode`` writes for it."""
    t = _INLINE.get(key)
    if t is None or len(data) != t.size or bool(lane) != bool(t.lane):
        return None
    return t.fill_fields(call_id, lane, data)


def remember_inline(key, m, version, data) -> None:
    """After ``m`` (inline key ``key``, in-message data ``data``) was
    encoded: keep its encoder template for ``encode_inline``, if ``m``'s
    shards are the ones the key describes."""
    s = m.shards
    if s is None or bytes(s.data) != bytes(data) or \
            list(zip(s.device, s.size)) != list(key[-1]):
        return
    t = _ENCODE.get(template_key(m, version))
    if t is not None:
        if len(_INLINE) >= MAX_TEMPLATES:
            _INLINE.clear()
        _INLINE[key] = t


def match(body, header, frame=None, reader_version=None):
    """The message of ``body`` if a decoder template matches it, else
    None.  ``frame``: the whole payload ``body`` came in, when it passed
    the header checks for ``reader_version``: its header is remembered
    with the template (for match_frame)."""
    key = (len(body), header.writer_version, header.min_reader_version)
    body = bytes(body)
    for t in _DECODE.get(key, ()):
        m = t.match(body)
        if m is not None:
            if frame is not None:
                _remember_frame(frame, header, len(body), reader_version, t)
            return m
    return None


def _remember_frame(frame, header, body_size: int, reader_version,
                    t) -> None:
    """Keep ``t`` (a decoder template ``frame``'s body matched) with the
    header of ``frame``, if that is an uncompressed payload (bytes)."""
    if type(frame) is not bytes or header.flags or \
            len(frame) != envelope.HEADER_SIZE + body_size:
        return
    key = (len(frame), reader_version)
    prefix = frame[:_PREFIX]
    with _LEARN_LOCK:
        if len(_FRAMES) >= MAX_TEMPLATES:
            _FRAMES.clear()
        entries = _FRAMES.setdefault(key, [])
        if len(entries) < 8 and not any(p == prefix and e is t
                                        for p, e in entries):
            entries.append((prefix, t))


def match_frame(frame: bytes, reader_version):
    """The message of a whole frame (envelope and body) if a decoder
    template learned from a frame with the same header matches it, else
    None.  Exactly what the full decode (``messages.decode``) returns for
    it: the header's bytes other than the checksum are those of a frame
    that passed every header check for this reader, the checksum is
    checked here, and the body is then compared as ``match`` does.  (The
    caller sets the message's inflation budget.)"""
    entries = _FRAMES.get((len(frame), reader_version))
    if entries is None:
        return None
    for prefix, t in entries:
        if frame.startswith(prefix):
            if zlib.crc32(memoryview(frame)[envelope.HEADER_SIZE:]) != \
                    _CRC.unpack_from(frame, _PREFIX)[0]:
                return None  # corrupt: the full decode says so
            m = t.match(frame, envelope.HEADER_SIZE)
            if m is not None:
                return m
    return None


def learn(body, header, m, encode_full: Callable, frame=None,
          reader_version=None) -> None:
    """Keep ``body`` (fully decoded as ``m``) as a decoder template, if it is
    templated and exactly what ``encode_full`` writes for ``m``: then the
    masked regions (call id, lane, data) are separate fields and overlap
    nothing else.  ``frame``: the whole payload ``body`` came in, when it
    passed the header checks for ``reader_version`` (for match_frame)."""
    version = header.writer_version
    if m.kind not in KINDS or not m.call_id or len(body) > MAX_BODY or \
            template_key(m, version) is None:
        return
    try:
        canonical = encode_full(m, version)
    except (EncodeError, struct.error, OverflowError, ValueError):
        return
    if canonical[envelope.HEADER_SIZE:] != bytes(body):
        return
    t = _Template(body, None, m)
    masked = bytearray(body)
    masked[t.call:t.call + 8] = _ZERO8
    if t.lane:
        masked[t.lane:t.lane + 8] = _ZERO8
    if t.size:
        masked[t.data:t.data + t.size] = bytes(t.size)
    t.body = bytes(masked)
    t._mask_spans()
    key = (len(body), version, header.min_reader_version)
    with _LEARN_LOCK:  # readers of several links learn at once
        if sum(map(len, _DECODE.values())) >= MAX_TEMPLATES:
            _DECODE.clear()
            _FRAMES.clear()
        lst = _DECODE.setdefault(key, [])
        if len(lst) < 8:
            lst.append(t)
    if frame is not None:
        _remember_frame(frame, header, len(body), reader_version, t)
