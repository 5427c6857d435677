"""A corpus of spec objects covering every kind and every dtype."""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np
from jax import export
from jax._src import core
from jax._src import mesh as jmesh
from jax._src import sharding_impls
from jax._src.random import prng
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from jax.experimental.layout import Format, Layout

ALL_DTYPES = [
    np.dtype(t) for t in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
        "uint64", "float16", "float32", "float64", "complex64", "complex128")
] + [np.dtype(getattr(ml_dtypes, n)) for n in (
    "bfloat16", "int1", "int2", "int4", "uint1", "uint2", "uint4",
    "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn",
    "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn")] + [
    jax.dtypes.float0,
    np.dtypes.StringDType(),
    np.dtypes.StringDType(na_object=None),
    np.dtypes.StringDType(na_object="<NA>", coerce=False),
    jax.random.key(0).dtype,
    jax.random.key(0, impl="rbg").dtype,
    jax.random.key(0, impl="unsafe_rbg").dtype,
    prng.KeyTy(prng.prngs["philox4x32"]),
]


def _user_prng():
    """A PRNG impl registered here, as users register their own (JAX's are
    all built in): payloads name it, and a reader must have it too."""
    name = "jaxcolo_tests.user_prng"
    if name not in prng.prngs:
        base = prng.prngs["threefry2x32"]
        prng.register_prng(prng.PRNGImpl(
            key_shape=base.key_shape, seed=base.seed, split=base.split,
            random_bits=base.random_bits, fold_in=base.fold_in, name=name,
            tag="jxu"))
    return prng.prngs[name]


USER_PRNG = _user_prng()
ALL_DTYPES.append(prng.KeyTy(USER_PRNG))


class Point(NamedTuple):
    x: object
    y: object


class Registered(NamedTuple):
    a: object
    b: object


export.register_namedtuple_serialization(
    Registered, serialized_name="tests.corpus.Registered")


@dataclasses.dataclass
class Custom:
    children: list
    tag: str


jax.tree_util.register_pytree_node(
    Custom, lambda c: (c.children, c.tag),
    lambda tag, ch: Custom(list(ch), tag))
export.register_pytree_node_serialization(
    Custom, serialized_name="tests.corpus.Custom",
    serialize_auxdata=lambda tag: tag.encode(),
    deserialize_auxdata=lambda b: b.decode())


class Tagged(NamedTuple):
    """A namedtuple registered as a custom node: one child, tag as auxdata."""
    x: object
    tag: str


class Swapped(NamedTuple):
    """A custom node of as many children as fields, in reverse order."""
    x: object
    y: object


jax.tree_util.register_pytree_node(
    Tagged, lambda t: ((t.x,), t.tag), lambda tag, ch: Tagged(ch[0], tag))
jax.tree_util.register_pytree_node(
    Swapped, lambda t: ((t.y, t.x), "swapped"),
    lambda aux, ch: Swapped(ch[1], ch[0]) if aux == "swapped" else
    Swapped(*ch))
for _t in (Tagged, Swapped):
    jax.export.register_pytree_node_serialization(
        _t, serialized_name=f"tests.corpus.{_t.__name__}",
        serialize_auxdata=str.encode, deserialize_auxdata=bytes.decode)


def meshes():
    devs = np.array(jax.devices())
    out = [Mesh(devs, ("x",)),
           Mesh(devs.reshape(2, 4), ("x", "y")),
           Mesh(devs.reshape(2, 2, 2), ("a", "b", "c")),
           Mesh(devs[::-1].reshape(4, 2), ("p", "q")),
           Mesh(devs[:3], ("z",))]
    types = (AxisType.Auto, AxisType.Explicit, AxisType.Manual)
    for t in types:
        out.append(Mesh(devs.reshape(2, 2, 2), ("a", "b", "c"),
                        axis_types=(t, types[(types.index(t) + 1) % 3],
                                    types[(types.index(t) + 2) % 3])))
    return out


def shardings():
    m2 = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    m3 = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("a", "b", "c"))
    m3e = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("a", "b", "c"),
               axis_types=(AxisType.Explicit,) * 3)
    am = jmesh.AbstractMesh((2, 4), ("x", "y"),
                            (AxisType.Explicit, AxisType.Auto))
    amd = jmesh.AbstractMesh((8,), ("d",), abstract_device=jmesh.AbstractDevice(
        "cpu", None, "cpu"))
    amd2 = jmesh.AbstractMesh((2,), ("d",), abstract_device=jmesh.AbstractDevice(
        "TPU v5", 2, "tpu"))
    hlo = NamedSharding(m2, P("x", "y"))._to_xla_hlo_sharding(2)
    return [
        NamedSharding(m2, P("x", "y")),
        NamedSharding(m2, P(("x", "y"))),
        NamedSharding(m2, P(None, "y"), memory_kind="pinned_host"),
        NamedSharding(m2, P()),
        NamedSharding(m3, P("a", P.UNCONSTRAINED, ("b", "c"))),
        NamedSharding(m3e, P("a", reduced={"b"}, unreduced={"c"})),
        NamedSharding(am, P("x")),
        NamedSharding(amd, P("d")),
        NamedSharding(amd2, P(None, "d")),
        jax.sharding.SingleDeviceSharding(jax.devices()[3]),
        jax.sharding.SingleDeviceSharding(jax.devices()[5],
                                          memory_kind="unpinned_host"),
        sharding_impls.GSPMDSharding(tuple(jax.devices()), hlo),
    ]


def avals():
    s = NamedSharding(Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y")),
                      P("x"))
    a, b = export.symbolic_shape("a, b", constraints=("a >= b", "b >= 2"))
    (c,) = export.symbolic_shape("c")
    out = [jax.ShapeDtypeStruct((), np.float32),
           jax.ShapeDtypeStruct((0, 3), np.int8),
           jax.ShapeDtypeStruct((8, 16), np.float32, sharding=s),
           jax.ShapeDtypeStruct((8,), jax.numpy.bfloat16, weak_type=True),
           jax.ShapeDtypeStruct((a, 2 * b + 1, 4), np.float32),
           jax.ShapeDtypeStruct((c, c * c), np.int32),
           jax.ShapeDtypeStruct((4,), np.dtypes.StringDType()),
           jax.ShapeDtypeStruct((3,), jax.random.key(0).dtype),
           jax.ShapeDtypeStruct((5,), np.float32, is_ref=True),
           jax.ShapeDtypeStruct((5,), np.float32,
                                manual_axis_type=core.ManualAxisType()),
           *layouts(s),
           core.ShapedArray((2, 3), np.float32),
           core.ShapedArray((2, 3), np.float32, weak_type=True),
           core.ShapedArray((2,), np.float32,
                            memory_space=core.MemorySpace.Host),
           core.ShapedArray((a, 3), np.float32),
           core.ShapedArray((8, 4), np.float32,
                            sharding=NamedSharding(s.mesh.abstract_mesh, P("x"))),
           ]
    out += [jax.ShapeDtypeStruct((2, 3), dt) for dt in ALL_DTYPES]
    return out


def layouts(s):
    """ShapeDtypeStructs with a Format layout (schema v4)."""
    one = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    return [
        jax.ShapeDtypeStruct((8, 16), np.float32,
                             sharding=Format(Layout((0, 1)), s)),
        jax.ShapeDtypeStruct((8, 16), ml_dtypes.int4, sharding=Format(
            Layout((1, 0), tiling=((8, 128), (2,)),
                   sub_byte_element_size_in_bits=4), s)),
        jax.ShapeDtypeStruct((4, 2, 3), np.float32,
                             sharding=Format(Layout((2, 0, 1), tiling=()), one)),
        jax.ShapeDtypeStruct((), np.int32, sharding=Format(Layout(()), one)),
    ]


def pytrees():
    leaf = jax.ShapeDtypeStruct((2,), np.float32)
    return [
        leaf, None, (), [], {}, (leaf,), [leaf, None, (leaf, [leaf])],
        {"b": leaf, "a": {"c": [leaf], "d": None}},
        {1: leaf, 7: (leaf,)},
        collections.OrderedDict([("z", leaf), ("a", leaf)]),
        collections.defaultdict(list, {"k": leaf}),
        Point(leaf, (leaf, None)),
        Registered(a=leaf, b=[leaf]),
        Custom([leaf, leaf], "tagged"),
        jax.tree_util.tree_structure({"x": [1, 2], "y": (3, None)}),
        jax.tree_util.tree_structure(Point(1, Custom([2], "t"))),
    ]


def misc():
    from jax._src.lib import xla_client as xc
    from jax._src import debugging
    return [
        P("x", None), P(), P(("x", "y"), P.UNCONSTRAINED),
        xc.DeviceList(tuple(jax.devices()[2:5])),
        jax.devices()[6],
        tuple(jax.devices()),
        prng.prngs["threefry2x32"], prng.prngs["rbg"], USER_PRNG,
        debugging.debug_effect, debugging.ordered_debug_effect,
        NamedSharding(Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y")),
                      P("x"))._to_xla_hlo_sharding(2),
        jmesh.AbstractMesh((2, 4), ("x", "y")),
        jmesh.AbstractMesh((2,), ("x",), abstract_device=jmesh.AbstractDevice(
            "cpu", None, "")),
        manual_subgroup_sharding(),
    ] + ALL_DTYPES


def manual_subgroup_sharding():
    """An HloSharding with last_tile_dims (shard_map's manual subgroups)."""
    from jax._src.lib import xla_client as xc
    op = xc.OpSharding()
    op.type = xc.OpSharding.Type.OTHER
    op.tile_assignment_dimensions = [2, 2, 2]
    op.iota_reshape_dims = [8]
    op.iota_transpose_perm = [0]
    op.last_tile_dims = [xc.OpSharding.Type.MANUAL]
    return xc.HloSharding.from_proto(op)


def everything():
    return {"meshes": meshes(), "shardings": shardings(), "avals": avals(),
            "pytrees": pytrees(), "misc": misc()}


def shard_group_opsharding(group_id: int):
    """A tiled 2x4 OpSharding in a shard_as group (shard groups are outside
    jaxcolo's own schema; JAX payloads may carry them)."""
    from jax._src.lib import xla_client as xc
    op = xc.OpSharding()
    op.type = xc.OpSharding.Type.OTHER
    op.tile_assignment_dimensions = [2, 4]
    op.iota_reshape_dims = [8]
    op.iota_transpose_perm = [0]
    op.is_shard_group = True
    op.shard_group_id = group_id
    op.shard_group_type = xc.OpSharding.ShardGroupType.AS
    return op
