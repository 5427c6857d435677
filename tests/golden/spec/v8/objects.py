"""What the frozen version-8 golden payloads next to this file hold.

Frozen with the payloads: never edit.  Version 8 made a namedtuple class
registered as a custom pytree node a custom node (its registered name and
auxdata) where earlier writers wrote a plain namedtuple node.  Everything
version 7 wrote is written again at version 8 (this module reuses v7's frozen
module); ``namedtuple_custom_nodes`` is the new payload, with two such
classes defined and registered here.
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

import jax

_TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                      "..", "..", "tools")


class Tagged(NamedTuple):
    """One child; ``tag`` travels as auxdata."""
    x: object
    tag: str


class Swapped(NamedTuple):
    """As many children as fields, flattened in reverse order."""
    x: object
    y: object


jax.tree_util.register_pytree_node(
    Tagged, lambda t: ((t.x,), t.tag), lambda tag, ch: Tagged(ch[0], tag))
jax.tree_util.register_pytree_node(
    Swapped, lambda t: ((t.y, t.x), "swapped"),
    lambda aux, ch: Swapped(ch[1], ch[0]))
for _t in (Tagged, Swapped):
    jax.export.register_pytree_node_serialization(
        _t, serialized_name=f"jaxcolo_golden.v8.{_t.__name__}",
        serialize_auxdata=str.encode, deserialize_auxdata=bytes.decode)


def _v7():
    sys.path.insert(0, os.path.abspath(_TOOLS))
    from make_spec_golden import load_objects
    return load_objects(7)


def objects() -> dict:
    """name -> spec object written with jaxcolo.serialize(obj, version=8)."""
    out = dict(_v7().objects())
    s = jax.ShapeDtypeStruct((2, 3), "float32")
    out["namedtuple_custom_nodes"] = {
        "tagged": Tagged(s, "first"),
        "swapped": Swapped(jax.ShapeDtypeStruct((4,), "int8"), s),
        "nested": [Tagged(Swapped(s, None), "inner"), Tagged((s,), "")],
        "structure": jax.tree_util.tree_structure(Swapped(1, Tagged(2, "t"))),
    }
    return out


def symbolic_objects() -> dict:
    """name -> object whose symbolic dims compare by their text."""
    return dict(_v7().symbolic_objects())


def check_symbolic(name: str, decoded) -> None:
    _v7().check_symbolic(name, decoded)


def payloads(version: int) -> dict:
    """name -> payload of the other root kinds, written at ``version``."""
    return _v7().payloads(version)


def check_payload(name: str, decoded) -> None:
    _v7().check_payload(name, decoded)
