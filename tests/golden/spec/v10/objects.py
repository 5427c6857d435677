"""What the frozen version-10 golden payloads next to this file hold.

Frozen with the payloads: never edit.  Version 10 made readers rebuild a
custom node with its registered ``from_children`` (as jax.export does), so
auxdata that its unflatten normalises reads back equal; readers before 10
made the node of the auxdata as read.  Everything version 9 wrote is
written again at version 10 (this module reuses v9's frozen module);
``rebuilt_custom_nodes`` is the new payload, with such a class defined and
registered here.  (The version also marks symbolic text past the parse
cost model as a feature of 9: ``past_model_dims``.)
"""

from __future__ import annotations

import json
import os
import sys

import jax

_TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                      "..", "..", "tools")


class Config:
    """Children, and meta as a tuple that JSON reads back as a list; the
    registered unflatten makes it a tuple again."""

    def __init__(self, children, meta):
        self.children, self.meta = list(children), tuple(meta)

    def __eq__(self, other):
        return type(other) is Config and self.children == other.children \
            and self.meta == other.meta

    def __hash__(self):
        return hash(self.meta)


jax.tree_util.register_pytree_node(
    Config, lambda c: (c.children, c.meta),
    lambda meta, children: Config(children, tuple(meta)))
jax.export.register_pytree_node_serialization(
    Config, serialized_name="jaxcolo_golden.v10.Config",
    serialize_auxdata=lambda meta: json.dumps(list(meta)).encode(),
    deserialize_auxdata=json.loads)


def _v9():
    sys.path.insert(0, os.path.abspath(_TOOLS))
    from make_spec_golden import load_objects
    return load_objects(9)


def objects() -> dict:
    """name -> spec object written with jaxcolo.serialize(obj, version=10)."""
    out = dict(_v9().objects())
    s = jax.ShapeDtypeStruct((2, 3), "float32")
    out["rebuilt_custom_nodes"] = {
        "config": Config([s, None], ("relu", 3)),
        "nested": [Config([Config([s], ("inner",))], ())],
        "structure": jax.tree_util.tree_structure(Config([1, 2], ("a", 1))),
    }
    return out


def symbolic_objects() -> dict:
    """name -> object whose symbolic dims compare by their text."""
    out = dict(_v9().symbolic_objects())
    a, = jax.export.symbolic_shape("a")
    nested, = jax.export.symbolic_shape(
        "max(n0, max(n1, max(n2, max(n3, max(n4, n5)))))")
    out["past_model_dims"] = [jax.ShapeDtypeStruct((a ** 17, 2), "float32"),
                              jax.ShapeDtypeStruct((nested,), "int8")]
    return out


def check_symbolic(name: str, decoded) -> None:
    if name == "past_model_dims":
        assert [str(s.shape) for s in decoded] == \
            ["(a^17, 2)", "(max(n0, max(n1, max(n2, max(n3, max(n4, n5))))),)"
             ], decoded
        return
    _v9().check_symbolic(name, decoded)


def payloads(version: int) -> dict:
    """name -> payload of the other root kinds, written at ``version``."""
    return _v9().payloads(version)


def check_payload(name: str, decoded) -> None:
    _v9().check_payload(name, decoded)
