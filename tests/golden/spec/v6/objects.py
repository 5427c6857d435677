"""What the frozen version-6 golden payloads next to this file hold.

Frozen with the payloads: never edit.  Version 6 added ``SymbolicScope.token``
(scope identity): two distinct scopes with equal constraints stay two scopes.
Everything version 5 wrote is written again at version 6 (this module reuses
v5's frozen module); ``two_scopes`` adds shapes from separately made scopes,
two with no constraints and one with constraints, which a reader must keep
apart (``check_symbolic``).
"""

from __future__ import annotations

import os
import sys

_TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                      "..", "..", "tools")


def _v5():
    sys.path.insert(0, os.path.abspath(_TOOLS))
    from make_spec_golden import load_objects
    return load_objects(5)


def objects() -> dict:
    """name -> spec object written with jaxcolo.serialize(obj, version=6)."""
    return dict(_v5().objects())


def symbolic_objects() -> dict:
    """name -> object whose symbolic dims compare by their text."""
    import jax
    import numpy as np
    from jax import export
    (b1,) = export.symbolic_shape("b")
    (b2,) = export.symbolic_shape("b")
    n1, m1 = export.symbolic_shape("n, m", constraints=("n >= m",))
    out = dict(_v5().symbolic_objects())
    out["two_scopes"] = {
        "x": jax.ShapeDtypeStruct((b1, 4), np.float32),
        "y": jax.ShapeDtypeStruct((b2, 8), np.float32),
        "z": [jax.ShapeDtypeStruct((b1, 2), np.int32),
              jax.ShapeDtypeStruct((n1, m1), np.float32)]}
    return out


def check_symbolic(name: str, decoded) -> None:
    """What a reader must keep of the symbolic objects' scopes."""
    if name != "two_scopes":
        return
    x, y = decoded["x"].shape[0], decoded["y"].shape[0]
    z0, z1 = (s.shape for s in decoded["z"])
    assert x.scope is not y.scope
    assert x.scope is z0[0].scope and x == z0[0]
    assert z1[0].scope is not x.scope
    assert z1[0] >= z1[1]  # the constraint holds in the decoded scope


def payloads(version: int) -> dict:
    """name -> payload of the other root kinds, written at ``version``."""
    return _v5().payloads(version)


def check_payload(name: str, decoded) -> None:
    _v5().check_payload(name, decoded)
