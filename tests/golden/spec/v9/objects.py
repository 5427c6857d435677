"""What the frozen version-9 golden payloads next to this file hold.

Frozen with the payloads: never edit.  Version 9 added the executor message
kind ``forget`` and the field ``Message.forgotten`` (the controller tells a
worker which programs will not be called again, so it drops them).
Everything version 8 wrote is written again at version 9 (this module reuses
v8's frozen module); ``message_forget`` is the new message.
"""

from __future__ import annotations

import os
import sys

_TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                      "..", "..", "tools")
_IDS = [bytes(range(16)), bytes(range(100, 116)), b"\xff" * 16]


def _v8():
    sys.path.insert(0, os.path.abspath(_TOOLS))
    from make_spec_golden import load_objects
    return load_objects(8)


def objects() -> dict:
    """name -> spec object written with jaxcolo.serialize(obj, version=9)."""
    return dict(_v8().objects())


def symbolic_objects() -> dict:
    """name -> object whose symbolic dims compare by their text."""
    return dict(_v8().symbolic_objects())


def check_symbolic(name: str, decoded) -> None:
    _v8().check_symbolic(name, decoded)


def payloads(version: int) -> dict:
    """name -> payload of the other root kinds, written at ``version``."""
    from jaxcolo.process import messages as msg
    out = _v8().payloads(version)
    out["message_forget"] = msg.encode(
        msg.Message(msg.MessageKind.forget, forgotten=list(_IDS)), version)
    return out


def check_payload(name: str, decoded) -> None:
    if name == "message_forget":
        from jaxcolo.process import messages as msg
        assert decoded.kind == msg.MessageKind.forget, decoded.kind
        assert decoded.forgotten == _IDS, decoded.forgotten
        assert decoded.program_id is None and decoded.shards is None
        return
    _v8().check_payload(name, decoded)
