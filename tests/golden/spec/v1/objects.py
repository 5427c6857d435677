"""The spec objects whose version-1 payloads are frozen next to this file.

Frozen with the payloads: never edit (a later version gets its own vN/
directory and objects module).  Built only from JAX and numpy, so the corpus
used by the other tests can evolve freely.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np
from jax import export
from jax._src import core
from jax._src import debugging
from jax._src import mesh as jmesh
from jax._src import sharding_impls
from jax._src.lib import xla_client as xc
from jax._src.random import prng
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P


class GoldenPair(NamedTuple):
    first: object
    second: object


class GoldenNode:
    """A custom pytree node with auxdata."""

    def __init__(self, children, tag):
        self.children, self.tag = list(children), tag

    def __eq__(self, other):
        return (type(other) is GoldenNode and self.tag == other.tag and
                self.children == other.children)


def register() -> None:
    """Register the pytree types (once per process)."""
    if getattr(register, "done", False):
        return
    export.register_namedtuple_serialization(
        GoldenPair, serialized_name="jaxcolo.golden.v1.GoldenPair")
    jax.tree_util.register_pytree_node(
        GoldenNode, lambda n: (n.children, n.tag),
        lambda tag, ch: GoldenNode(ch, tag))
    export.register_pytree_node_serialization(
        GoldenNode, serialized_name="jaxcolo.golden.v1.GoldenNode",
        serialize_auxdata=lambda tag: tag.encode(),
        deserialize_auxdata=lambda b: b.decode())
    register.done = True


def objects() -> dict:
    """name -> object (needs 8 CPU devices)."""
    register()
    devs = np.array(jax.devices())
    m1 = Mesh(devs, ("x",))
    m2 = Mesh(devs.reshape(2, 4), ("x", "y"))
    m3 = Mesh(devs.reshape(2, 2, 2), ("a", "b", "c"),
              axis_types=(AxisType.Explicit, AxisType.Auto, AxisType.Manual))
    am = jmesh.AbstractMesh((2, 4), ("x", "y"),
                            (AxisType.Explicit, AxisType.Auto))
    amd = jmesh.AbstractMesh((2,), ("d",), abstract_device=jmesh.AbstractDevice(
        "TPU v5", 2, "tpu"))
    s2 = NamedSharding(m2, P("x", "y"))
    hlo = s2._to_xla_hlo_sharding(2)
    dtypes = [np.dtype(t) for t in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
        "uint64", "float16", "float32", "float64", "complex64", "complex128")]
    dtypes += [np.dtype(getattr(ml_dtypes, n)) for n in (
        "bfloat16", "int1", "int2", "int4", "uint1", "uint2", "uint4",
        "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn",
        "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn")]
    dtypes += [jax.dtypes.float0, np.dtypes.StringDType(),
               np.dtypes.StringDType(na_object=None),
               np.dtypes.StringDType(na_object="<NA>", coerce=False),
               prng.KeyTy(prng.prngs["threefry2x32"]),
               prng.KeyTy(prng.prngs["rbg"]),
               prng.KeyTy(prng.prngs["unsafe_rbg"]),
               prng.KeyTy(prng.prngs["philox4x32"])]
    leaf = jax.ShapeDtypeStruct((2,), np.float32)
    return {
        "dtypes": dtypes,
        "meshes": [m1, m2, m3, Mesh(devs[::-1].reshape(4, 2), ("p", "q")), am,
                   amd],
        "shardings": [
            s2, NamedSharding(m2, P(("x", "y"))),
            NamedSharding(m2, P(None, "y"), memory_kind="pinned_host"),
            NamedSharding(m3, P("a", P.UNCONSTRAINED, ("b", "c"))),
            NamedSharding(Mesh(devs.reshape(2, 2, 2), ("a", "b", "c"),
                               axis_types=(AxisType.Explicit,) * 3),
                          P("a", reduced={"b"}, unreduced={"c"})),
            NamedSharding(am, P("x")), NamedSharding(amd, P(None, "d")),
            jax.sharding.SingleDeviceSharding(jax.devices()[3]),
            sharding_impls.GSPMDSharding(tuple(jax.devices()), hlo), hlo],
        "arrays": [
            jax.ShapeDtypeStruct((), np.float32),
            jax.ShapeDtypeStruct((0, 3), np.int8),
            jax.ShapeDtypeStruct((8, 16), np.float32, sharding=s2),
            jax.ShapeDtypeStruct((8,), jax.numpy.bfloat16, weak_type=True),
            jax.ShapeDtypeStruct((4,), np.dtypes.StringDType()),
            jax.ShapeDtypeStruct((3,), prng.KeyTy(prng.prngs["threefry2x32"])),
            jax.ShapeDtypeStruct((5,), np.float32, is_ref=True),
            core.ShapedArray((2, 3), np.float32, weak_type=True),
            core.ShapedArray((2,), np.float32,
                             memory_space=core.MemorySpace.Host),
            core.ShapedArray((8, 4), np.float32,
                             sharding=NamedSharding(am, P("x")))],
        "pytrees": [
            None, (), [], {}, [leaf, None, (leaf, [leaf])],
            {"b": leaf, "a": {"c": [leaf], "d": None}}, {1: leaf, 7: (leaf,)},
            collections.OrderedDict([("z", leaf), ("a", leaf)]),
            collections.defaultdict(list, {"k": leaf}),
            GoldenPair(leaf, (leaf, None)), GoldenNode([leaf, leaf], "tagged"),
            jax.tree_util.tree_structure({"x": [1, 2], "y": (3, None)})],
        "misc": [
            P("x", None), P(), xc.DeviceList(tuple(jax.devices()[2:5])),
            jax.devices()[6], tuple(jax.devices()), prng.prngs["rbg"],
            debugging.debug_effect, debugging.ordered_debug_effect],
        "spec_tree_1000": {
            "params": [jax.ShapeDtypeStruct((8 * (i % 5 + 1), 16), np.float32,
                                            sharding=s2) for i in range(500)],
            "opt_state": tuple(jax.ShapeDtypeStruct((i % 7 + 1,), np.int32)
                               for i in range(500))},
    }


def symbolic_objects() -> dict:
    """name -> object whose symbolic dims compare by their text."""
    a, b = export.symbolic_shape("a, b", constraints=("a >= b", "b >= 2"))
    (c,) = export.symbolic_shape("c")
    return {"symbolic": [jax.ShapeDtypeStruct((a, 2 * b + 1, 4), np.float32),
                         jax.ShapeDtypeStruct((c, c * c), np.int32),
                         core.ShapedArray((a, 3), np.float32)]}
