"""What the frozen version-7 golden payloads next to this file hold.

Frozen with the payloads: never edit.  Version 7 added the executor message
kind ``resume`` (a worker whose part of a multi-host call failed holds its
later multi-host calls until the controller says every host is done with
it).  Everything version 6 wrote is written again at version 7 (this module
reuses v6's frozen module); ``message_resume`` is the new message.
"""

from __future__ import annotations

import os
import sys

_TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                      "..", "..", "tools")


def _v6():
    sys.path.insert(0, os.path.abspath(_TOOLS))
    from make_spec_golden import load_objects
    return load_objects(6)


def objects() -> dict:
    """name -> spec object written with jaxcolo.serialize(obj, version=7)."""
    return dict(_v6().objects())


def symbolic_objects() -> dict:
    """name -> object whose symbolic dims compare by their text."""
    return dict(_v6().symbolic_objects())


def check_symbolic(name: str, decoded) -> None:
    _v6().check_symbolic(name, decoded)


def payloads(version: int) -> dict:
    """name -> payload of the other root kinds, written at ``version``."""
    from jaxcolo.process import messages as msg
    out = _v6().payloads(version)
    out["message_resume"] = msg.encode(
        msg.Message(msg.MessageKind.resume, call_id=2**40 + 3), version)
    return out


def check_payload(name: str, decoded) -> None:
    if name == "message_resume":
        from jaxcolo.process import messages as msg
        assert decoded.kind == msg.MessageKind.resume, decoded.kind
        assert decoded.call_id == 2**40 + 3, decoded.call_id
        assert decoded.shards is None and not decoded.ordered
        return
    _v6().check_payload(name, decoded)
