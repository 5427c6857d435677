"""What the frozen version-2 golden payloads next to this file hold.

Frozen with the payloads: never edit.  Version 2 added three root kinds
(colocated program, export bundle, executor hello); spec trees are as in
version 1 (this module reuses v1's frozen objects for them).
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np

_TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                      "..", "..", "tools")
BODY = b"\x80\x05N."  # a pickle of None: program bodies are never loaded here


def _v1():
    sys.path.insert(0, os.path.abspath(_TOOLS))
    from make_spec_golden import load_objects
    return load_objects(1)


def objects() -> dict:
    """name -> spec object written with jaxcolo.serialize(obj, version=2)."""
    v1 = _v1().objects()
    return {k: v1[k] for k in ("arrays", "shardings", "pytrees")}


def symbolic_objects() -> dict:
    return {}


def _specs():
    s = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2),
                          ("x", "y")), jax.sharding.PartitionSpec("x"))
    return (((jax.ShapeDtypeStruct((4, 2), np.float32, sharding=s),), {}),
            {"out": jax.ShapeDtypeStruct((4, 2), np.float32, sharding=s)})


def _exported():
    return jax.export.export(jax.jit(lambda x: jax.numpy.sin(x) * 2))(
        jax.ShapeDtypeStruct((3,), np.float32))


def payloads(version: int) -> dict:
    """name -> payload of the other root kinds, written at ``version``."""
    import jaxcolo
    from jaxcolo.colocated.program import encode_program
    from jaxcolo.export import bundle
    from jaxcolo.transport import handshake
    ins, outs = _specs()
    common = dict(body=BODY, device_ids=[0, 1, 2, 3], version=version,
                  in_specs=jaxcolo.serialize(ins, version=version))
    return {
        "program_function": encode_program(
            name="f", kind="function",
            out_specs=jaxcolo.serialize(outs, version=version), **common),
        "program_method_discovery": encode_program(
            name="C.m", kind="method", method_name="m", instance_id=7,
            out_specs=None, **common),
        "hello": handshake.encode_hello(handshake.Hello(
            1, version, "worker", "golden", 1, (4, 5, 6, 7))),
        "export_bundle": bundle(_exported(), specs=ins),
    }


def check_payload(name: str, decoded) -> None:
    """Assert that ``decoded`` (jaxcolo.deserialize of payload ``name``) is
    what ``payloads`` wrote."""
    ins, outs = _specs()
    if name.startswith("program_"):
        assert decoded.body == BODY and decoded.device_ids == (0, 1, 2, 3)
        assert decoded.in_specs == ins
        if name == "program_function":
            assert (decoded.name, decoded.kind) == ("f", "function")
            assert decoded.out_specs == outs
        else:
            assert (decoded.name, decoded.method_name,
                    decoded.instance_id) == ("C.m", "m", 7)
            assert not decoded.has_out_specs
    elif name == "hello":
        assert (decoded.role, decoded.host_index,
                decoded.device_ids) == ("worker", 1, (4, 5, 6, 7))
    elif name == "export_bundle":
        x = np.arange(3, dtype=np.float32)
        np.testing.assert_allclose(decoded.exported.call(x), np.sin(x) * 2,
                                   rtol=1e-6)
        assert decoded.specs == ins
    else:
        raise AssertionError(f"unknown golden payload {name}")
