"""What the frozen version-4 golden payloads next to this file hold.

Frozen with the payloads: never edit.  Version 4 added ShapeDtypeStruct
layouts (``sharding=Format(Layout(...), sharding)``).  Everything version 3
wrote is written again at version 4 (this module reuses v3's frozen module);
``layouts`` adds every layout shape: plain permutation, tiling with sub-byte
size, empty tiling, rank 0, over named and single-device shardings.
"""

from __future__ import annotations

import os
import sys

_TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                      "..", "..", "tools")


def _v3():
    sys.path.insert(0, os.path.abspath(_TOOLS))
    from make_spec_golden import load_objects
    return load_objects(3)


def _layouts() -> list:
    import jax
    import ml_dtypes
    import numpy as np
    from jax.experimental.layout import Format, Layout
    from jax.sharding import (Mesh, NamedSharding, PartitionSpec as P,
                              SingleDeviceSharding)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    named = NamedSharding(mesh, P("x", None))
    one = SingleDeviceSharding(jax.devices()[5])
    return [
        jax.ShapeDtypeStruct((8, 16), np.float32,
                             sharding=Format(Layout((0, 1)), named)),
        jax.ShapeDtypeStruct((8, 256), ml_dtypes.int4, sharding=Format(
            Layout((1, 0), tiling=((8, 128), (2,)),
                   sub_byte_element_size_in_bits=4), named)),
        jax.ShapeDtypeStruct((4, 2, 3), np.float32,
                             sharding=Format(Layout((2, 0, 1), tiling=()), one)),
        jax.ShapeDtypeStruct((), np.int32, sharding=Format(Layout(()), one)),
        jax.ShapeDtypeStruct((4, 2), np.float32, sharding=one),
    ]


def objects() -> dict:
    """name -> spec object written with jaxcolo.serialize(obj, version=4)."""
    out = dict(_v3().objects())
    out["layouts"] = {"layouts": _layouts()}
    return out


def symbolic_objects() -> dict:
    return {}


def payloads(version: int) -> dict:
    """name -> payload of the other root kinds, written at ``version``."""
    return _v3().payloads(version)


def check_payload(name: str, decoded) -> None:
    _v3().check_payload(name, decoded)
