"""What the frozen version-12 golden payloads next to this file hold.

Frozen with the payloads: never edit.  Version 12 changed no schema: a
remote exception whose class pickles itself (an OSError, say) travels with
its cause and context, inside the error message's opaque exception pickle.
Everything version 11 wrote is written again at version 12 (this module
reuses v11's frozen module).
"""

from __future__ import annotations

import os
import sys

_TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                      "..", "..", "tools")


def _v11():
    sys.path.insert(0, os.path.abspath(_TOOLS))
    from make_spec_golden import load_objects
    return load_objects(11)


def objects() -> dict:
    """name -> spec object written with jaxcolo.serialize(obj, version=12)."""
    return dict(_v11().objects())


def symbolic_objects() -> dict:
    """name -> object whose symbolic dims compare by their text."""
    return dict(_v11().symbolic_objects())


def check_symbolic(name: str, decoded) -> None:
    _v11().check_symbolic(name, decoded)


def payloads(version: int) -> dict:
    """name -> payload of the other root kinds, written at ``version``."""
    return _v11().payloads(version)


def check_payload(name: str, decoded) -> None:
    _v11().check_payload(name, decoded)
