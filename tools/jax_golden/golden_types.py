"""Pytree types shared by the golden-data exporter and the verifier.

This module is imported (as top-level module ``golden_types``) both inside
the old-JAX venvs by ``export_cases.py`` and in the main environment by
``verify_golden.py``.  It must work with every JAX release we generate data
for, so it only uses public APIs and guards everything that may be missing.

The *serialized names* below are what ends up in the flatbuffer
(PyTreeDef.custom_name); readers must use these exact strings.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax

NAMEDTUPLE_SERIALIZED_NAME = "jaxcolo.golden.Point"
CUSTOM_NODE_SERIALIZED_NAME = "jaxcolo.golden.Box"


class Point(NamedTuple):
  x: Any
  y: Any


class Box:
  """A custom pytree node: children (lo, hi), auxdata = a label string."""

  def __init__(self, lo, hi, label: str = "box"):
    self.lo = lo
    self.hi = hi
    self.label = label

  def __repr__(self):
    return f"Box({self.lo!r}, {self.hi!r}, label={self.label!r})"


def _box_flatten(b: Box):
  return (b.lo, b.hi), b.label


def _box_unflatten(label, children):
  lo, hi = children
  return Box(lo, hi, label)


jax.tree_util.register_pytree_node(Box, _box_flatten, _box_unflatten)


def _serialize_box_aux(label) -> bytes:
  return str(label).encode("utf-8")


def _deserialize_box_aux(data: bytes):
  return bytes(data).decode("utf-8")


_REGISTERED: dict[str, Any] | None = None


def get_export_module():
  """Returns the module providing the export API (jax.export or experimental)."""
  try:
    import jax.export as jexport  # noqa: F401
    if hasattr(jexport, "export"):
      return jexport
  except Exception:  # pragma: no cover - very old jax
    pass
  from jax.experimental import export as jexport  # type: ignore
  return jexport


def register_serialization() -> dict[str, Any]:
  """Registers Point and Box for Exported serialization (idempotent).

  Returns a dict with keys "namedtuple" and "custom" mapping to the serialized
  name used, or to an error string "UNAVAILABLE: ..." when the running JAX
  does not support it.
  """
  global _REGISTERED
  if _REGISTERED is not None:
    return _REGISTERED
  jexport = get_export_module()
  res: dict[str, Any] = {}
  fn = getattr(jexport, "register_namedtuple_serialization", None)
  if fn is None:
    res["namedtuple"] = "UNAVAILABLE: no register_namedtuple_serialization"
  else:
    try:
      fn(Point, serialized_name=NAMEDTUPLE_SERIALIZED_NAME)
      res["namedtuple"] = NAMEDTUPLE_SERIALIZED_NAME
    except Exception as e:  # pragma: no cover
      res["namedtuple"] = f"UNAVAILABLE: {type(e).__name__}: {e}"
  fn = getattr(jexport, "register_pytree_node_serialization", None)
  if fn is None:
    res["custom"] = "UNAVAILABLE: no register_pytree_node_serialization"
  else:
    try:
      fn(Box, serialized_name=CUSTOM_NODE_SERIALIZED_NAME,
         serialize_auxdata=_serialize_box_aux,
         deserialize_auxdata=_deserialize_box_aux)
      res["custom"] = CUSTOM_NODE_SERIALIZED_NAME
    except Exception as e:  # pragma: no cover
      res["custom"] = f"UNAVAILABLE: {type(e).__name__}: {e}"
  _REGISTERED = res
  return res


# ---------------------------------------------------------------------------
# A testing effect, built with JAX *private* APIs (there is no public way to
# create an exportable effect).  Mirrors what JAX's own export_test.py does.
# The serialized effect name is str(GoldenOrderedEffect), i.e.
# "<class 'golden_types.GoldenOrderedEffect'>", so the deserializing side must
# import this module under the same name and call setup_testing_effects().
# ---------------------------------------------------------------------------
_EFFECTS: dict[str, Any] | None = None


def setup_testing_effects() -> dict[str, Any]:
  """Defines (once) the testing effects and a primitive that uses them.

  Returns {"ordered": cls, "unordered": cls, "primitive": p,
  "bind": fn(x, kind)}; raises if the private APIs are missing.
  """
  global _EFFECTS
  if _EFFECTS is not None:
    return _EFFECTS
  from jax._src import core
  from jax._src import effects
  from jax._src.interpreters import mlir

  class GoldenOrderedEffect(effects.Effect):
    def __eq__(self, other):
      return isinstance(other, GoldenOrderedEffect)

    def __hash__(self):
      return hash("GoldenOrderedEffect")

    def __str__(self):
      return "GoldenOrderedEffect"

  class GoldenUnorderedEffect(effects.Effect):
    def __eq__(self, other):
      return isinstance(other, GoldenUnorderedEffect)

    def __hash__(self):
      return hash("GoldenUnorderedEffect")

    def __str__(self):
      return "GoldenUnorderedEffect"

  # Make the qualnames module-level looking.
  for c in (GoldenOrderedEffect, GoldenUnorderedEffect):
    c.__qualname__ = c.__name__
    globals()[c.__name__] = c

  kinds = {"ordered": GoldenOrderedEffect, "unordered": GoldenUnorderedEffect}

  effects.lowerable_effects.add_type(GoldenOrderedEffect)
  effects.lowerable_effects.add_type(GoldenUnorderedEffect)
  effects.ordered_effects.add_type(GoldenOrderedEffect)
  for name in ("control_flow_allowed_effects", "custom_derivatives_allowed_effects",
               "remat_allowed_effects"):
    s = getattr(effects, name, None)
    if s is not None:
      s.add_type(GoldenOrderedEffect)
      s.add_type(GoldenUnorderedEffect)

  p = core.Primitive("golden_testing_primitive_with_effect")

  def _abstract_eval(aval, *, kind):
    return aval, {kinds[kind]()}

  p.def_effectful_abstract_eval(_abstract_eval)

  def _impl(x, *, kind):
    return jax.jit(lambda y: p.bind(y, kind=kind))(x)

  p.def_impl(_impl)

  def _lowering(ctx, a, *, kind):
    if kind == "ordered":
      eff = kinds[kind]()
      token_in = ctx.tokens_in.get(eff)
      ctx.set_tokens_out(mlir.TokenSet({eff: token_in}))
    return [mlir.hlo.add(a, a)]

  mlir.register_lowering(p, _lowering)

  _EFFECTS = {"ordered": GoldenOrderedEffect,
              "unordered": GoldenUnorderedEffect,
              "primitive": p,
              "bind": lambda x, kind: p.bind(x, kind=kind)}
  return _EFFECTS
