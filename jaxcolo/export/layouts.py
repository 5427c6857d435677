"""Field layouts (vtable offsets) of JAX's Exported format, read off the
flatc-generated package ``jaxcolo_jax_export_fb`` (see jaxcolo/wire.py)."""

from __future__ import annotations

import jaxcolo_jax_export_fb as fb
from jaxcolo.wire import enum_values, layout

EXPORTED = layout(fb, "Exported")
TREE = layout(fb, "PyTreeDef")
AVAL = layout(fb, "AbstractValue")
SHARDING = layout(fb, "Sharding")
NAMED = layout(fb, "NamedSharding")
MESH = layout(fb, "AbstractMesh")
DEVICE = layout(fb, "AbstractDevice")
SPEC = layout(fb, "PartitionSpec")
SPEC_AXIS = layout(fb, "PartitionSpecOneAxis")
EFFECT = layout(fb, "Effect")
CHECK = layout(fb, "DisabledSafetyCheck")

TREE_KINDS = enum_values(fb.PyTreeDefKind)
DTYPES = enum_values(fb.DType)
MEMORY_SPACES = enum_values(fb.MemorySpace)
AXIS_TYPES = enum_values(fb.AxisType)
SHARDING_KINDS = enum_values(fb.ShardingKind)
CHECK_KINDS = enum_values(fb.DisabledSafetyCheckKind)


def slot(voff: int) -> int:
    """The builder slot number of a vtable offset."""
    return (voff - 4) // 2
