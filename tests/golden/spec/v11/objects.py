"""What the frozen version-11 golden payloads next to this file hold.

Frozen with the payloads: never edit.  Version 11 added
``ExportBundle.exported_avals``: the bundled Exported's avals as a spec
payload, holding what JAX's format drops (the constraints of their symbolic
scope, weak types), which readers put back.  Everything version 10 wrote is
written again at version 11 (this module reuses v10's frozen module);
``export_bundle_constraints`` is the new payload.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np

_TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                      "..", "..", "tools")


def _v10():
    sys.path.insert(0, os.path.abspath(_TOOLS))
    from make_spec_golden import load_objects
    return load_objects(10)


def objects() -> dict:
    """name -> spec object written with jaxcolo.serialize(obj, version=11)."""
    return dict(_v10().objects())


def symbolic_objects() -> dict:
    """name -> object whose symbolic dims compare by their text."""
    return dict(_v10().symbolic_objects())


def check_symbolic(name: str, decoded) -> None:
    _v10().check_symbolic(name, decoded)


def _constrained_export():
    a, b = jax.export.symbolic_shape("a, b", constraints=("a >= b",))

    def f(x, y, w):
        return x.sum(0) + y[:, 0].sum() * w, x * 2.0
    return jax.export.export(jax.jit(f))(
        jax.ShapeDtypeStruct((a, b), np.float32),
        jax.ShapeDtypeStruct((b, 2), np.float32), 1.0), (a, b)


def payloads(version: int) -> dict:
    """name -> payload of the other root kinds, written at ``version``."""
    from jaxcolo.export import bundle
    out = _v10().payloads(version)
    exp, (a, b) = _constrained_export()
    out["export_bundle_constraints"] = bundle(
        exp, specs={"x": jax.ShapeDtypeStruct((a, b), np.float32)})
    return out


def check_payload(name: str, decoded) -> None:
    if name == "export_bundle_constraints":
        exp = decoded.exported
        a, b = exp.in_avals[0].shape
        assert a >= b  # the constraint came back (JAX's format drops it)
        assert [x.weak_type for x in exp.in_avals] == [False, False, True]
        assert decoded.specs["x"].shape[0] - a == 0  # one scope
        x, y = np.ones((5, 3), np.float32), np.ones((3, 2), np.float32)
        got = exp.call(x, y, 2.0)
        np.testing.assert_allclose(got[0], np.full(3, 11.0))
        np.testing.assert_allclose(got[1], x * 2)
        return
    _v10().check_payload(name, decoded)
