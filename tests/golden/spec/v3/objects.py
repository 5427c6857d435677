"""What the frozen version-3 golden payloads next to this file hold.

Frozen with the payloads: never edit.  Version 3 added one root kind, the
executor ``message`` (controller <-> worker).  Spec trees and the version-2
root kinds are as in version 2 (this module reuses v2's frozen module for
them); the messages below cover every message kind and every buffer place.
"""

from __future__ import annotations

import os
import sys

_TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                      "..", "..", "tools")
PROGRAM_ID = bytes(range(16))
DATA = bytes(range(8)) + bytes(56) + b"\x07\x00\x00\x00"


def _v2():
    sys.path.insert(0, os.path.abspath(_TOOLS))
    from make_spec_golden import load_objects
    return load_objects(2)


def objects() -> dict:
    """name -> spec object written with jaxcolo.serialize(obj, version=3)."""
    return _v2().objects()


def symbolic_objects() -> dict:
    return {}


def _shards():
    from jaxcolo.process.messages import Shards
    # leaf 0: one 8-byte shard replicated on devices 0 and 1 (in the
    # message); leaf 1: a 4-byte scalar on device 2 (in the message); leaf 2:
    # 1 MiB on device 3 in shared memory; leaf 3: 2 MiB in a frame.
    return Shards(leaf=[0, 0, 1, 2, 3], device=[0, 1, 2, 3, 4],
                  buffer=[0, 0, 1, 2, 3], where=[0, 0, 1, 2],
                  format=[0, 0, 0, 0], offset=[0, 64, 0, 0],
                  size=[8, 4, 1 << 20, 2 << 20], segment=[0, 0, 5, 0],
                  lease=[0, 0, 9, 0], data=DATA)


def messages() -> dict:
    """name -> executor Message of the version-3 golden payloads."""
    from jaxcolo.process.messages import Message, MessageKind as K
    return {
        "message_setup": Message(K.setup, heartbeat_ms=1000,
                                 text="jaxcolo-probe", token=b"t" * 16,
                                 pid=4321),
        "message_register": Message(K.register, program_id=PROGRAM_ID,
                                    program=b"program payload bytes"),
        "message_call": Message(K.call, call_id=12, lane=3,
                                program_id=PROGRAM_ID, shards=_shards(),
                                segments=[(5, "jaxcolo-c0-1", 4 << 20)],
                                ordered=True),
        "message_result": Message(K.result, call_id=12, shards=_shards(),
                                  specs=b"discovered spec payload"),
        "message_error": Message(
            K.error, call_id=12, error_type="builtins.ValueError",
            error_message="boom", error_traceback="Traceback ...",
            error_pickle=b"\x80\x05N."),
        "message_release": Message(K.release, released=[9, 10, 11]),
        "message_destroy": Message(K.destroy, lane=3, instance_id=77),
        "message_stats": Message(K.stats, call_id=5,
                                 stats={"calls": 3, "errors": 1}),
        "message_ping": Message(K.ping),
        "message_shutdown": Message(K.shutdown),
    }


def payloads(version: int) -> dict:
    """name -> payload of the other root kinds, written at ``version``."""
    from jaxcolo.process import messages as msg
    out = _v2().payloads(version)
    del out["hello"]  # always written at version 2 (old peers read it)
    for name, m in messages().items():
        out[name] = msg.encode(m, version)
    return out


def check_payload(name: str, decoded) -> None:
    """Assert that ``decoded`` (jaxcolo.deserialize of payload ``name``) is
    what ``payloads`` wrote."""
    if not name.startswith("message_"):
        _v2().check_payload(name, decoded)
        return
    want = messages()[name]
    for field in ("kind", "call_id", "lane", "program_id", "program",
                  "segments", "released", "specs", "instance_id", "ordered",
                  "error_type", "error_message", "error_traceback",
                  "error_pickle", "stats", "token", "heartbeat_ms", "pid",
                  "text"):
        got, exp = getattr(decoded, field), getattr(want, field)
        if field in ("segments", "released"):
            got, exp = [tuple(x) if isinstance(x, tuple) else x for x in got], \
                list(exp)
        assert got == exp or (not got and not exp), (name, field, got, exp)
    if want.shards is None:
        assert decoded.shards is None, name
    else:
        for field in ("leaf", "device", "buffer", "where", "format", "offset",
                      "size", "segment", "lease", "data"):
            assert list(getattr(decoded.shards, field)) == \
                list(getattr(want.shards, field)), (name, field)
