"""JAX effects and PRNG implementations, by registered name.

An effect travels as its type's name ("module:qualname", or the name it was
registered under) plus optional state bytes.  Decoding looks the name up in
jaxcolo's effect registry and among JAX's known effect types; it never imports.
Effects that carry state must be registered with :func:`register_effect`.

PRNG impls travel by their name in JAX's PRNG registry.
"""

from __future__ import annotations

import sys
from typing import Callable

from jax._src import core
from jax._src import effects as jeffects
from jax._src.random import prng

import jaxcolo_fb as fb
from jaxcolo_fb import LeafKind
from jaxcolo.codec.core import register_leaf, register_table
from jaxcolo.errors import EncodeError, PayloadError, UnregisteredError
from jaxcolo.wire import layout

LE = layout(fb, "Effect")

# name -> (type, to_bytes or None, from_bytes or None); type -> name
_EFFECTS_BY_NAME: dict[str, tuple] = {}
_EFFECT_NAMES: dict[type, str] = {}


def register_effect(effect_type: type, name: str | None = None, *,
                    to_bytes: Callable | None = None,
                    from_bytes: Callable | None = None) -> type:
    """Make ``effect_type`` serializable under ``name``.

    Effects with state pass ``to_bytes(effect) -> bytes`` and
    ``from_bytes(bytes) -> effect``; stateless ones need neither (they are
    rebuilt with their nullary constructor).
    """
    if (to_bytes is None) != (from_bytes is None):
        raise ValueError("pass both to_bytes and from_bytes, or neither")
    name = name or _qualified(effect_type)
    old = _EFFECTS_BY_NAME.get(name)
    if old is not None and old[0] is not effect_type:
        raise ValueError(f"effect name {name!r} already registered for "
                         f"{old[0]!r}")
    _EFFECTS_BY_NAME[name] = (effect_type, to_bytes, from_bytes)
    _EFFECT_NAMES[effect_type] = name
    return effect_type


def _qualified(t: type) -> str:
    return f"{t.__module__}:{t.__qualname__}"


def snapshot(items) -> tuple:
    """``tuple(items)`` of a set or dict view another thread may change
    meanwhile (JAX's effect registries while a library defining effects is
    imported; a module's globals): copying is one C call, but a garbage
    collection inside it can run Python code and switch threads, and a
    change then fails the copy -- taken again until it succeeds."""
    for _ in range(SNAPSHOT_TRIES - 1):
        try:
            return tuple(items)
        except RuntimeError:  # "... changed size during iteration"
            continue
    return tuple(items)


SNAPSHOT_TRIES = 100


def _known_effect_types():
    seen = set()
    for group in (jeffects.lowerable_effects, jeffects.control_flow_allowed_effects,
                  jeffects.custom_derivatives_allowed_effects,
                  jeffects.remat_allowed_effects, jeffects.ordered_effects,
                  jeffects.partial_eval_jaxpr_custom_rules_allowed_effects
                  if hasattr(jeffects, "partial_eval_jaxpr_custom_rules_allowed_effects")
                  else None):
        for t in snapshot(getattr(group, "_effect_types", ())
                          if group is not None else ()):
            if t not in seen:
                seen.add(t)
                yield t


def _effect_item(eff, path):
    t = type(eff)
    name = _EFFECT_NAMES.get(t)
    if name is not None:
        to_bytes = _EFFECTS_BY_NAME[name][1]
        if to_bytes is not None:
            blob = to_bytes(eff)
            if not isinstance(blob, (bytes, bytearray)):
                raise EncodeError(f"to_bytes of effect {name!r} returned "
                                  f"{type(blob).__name__}", path)
            return (name, bytes(blob))
    else:
        name = _qualified(t)
        found = effect_type_by_name(name)
        if found is None or found[0] is not t:  # a reader could not find it
            if not _is_stateless(eff):
                raise EncodeError(
                    f"effect {eff!r} (type {name!r}) carries state and is "
                    "not registered; register it on both sides with "
                    "jaxcolo.register_effect(type, to_bytes=..., "
                    "from_bytes=...)", path)
            raise EncodeError(
                f"effect type {name!r} is neither registered nor one of "
                "JAX's effect types; register it on both sides with "
                "jaxcolo.register_effect(type)", path)
    if not _is_stateless(eff):
        raise EncodeError(
            f"effect {eff!r} carries state; register it with "
            "jaxcolo.register_effect(type, to_bytes=..., from_bytes=...)", path)
    return (name, None)


def _is_stateless(eff) -> bool:
    """True if ``type(eff)()`` stands for ``eff``: equal, or no state at all."""
    t = type(eff)
    try:
        if t() == eff and hash(t()) == hash(eff):
            return True
    except Exception:
        return False
    return t.__eq__ is object.__eq__ and not getattr(eff, "__dict__", None) \
        and not getattr(t, "__slots__", ())


def _instance_of(t):
    """The module-level singleton of an identity-compared effect type (JAX
    keeps one, e.g. ``debug_effect``), else a new instance.  No import."""
    module = sys.modules.get(t.__module__)
    if module is not None and t.__eq__ is object.__eq__:
        for v in snapshot(vars(module).values()):
            if type(v) is t:
                return v
    return t()


def build_effect(writer, builder, item) -> int:
    name, state = item
    name_off = builder.CreateSharedString(name)
    state_off = builder.CreateByteVector(state) if state is not None else 0
    fb.EffectStart(builder)
    fb.EffectAddTypeName(builder, name_off)
    if state_off:
        fb.EffectAddState(builder, state_off)
    return fb.EffectEnd(builder)


def effect_type_by_name(name: str):
    reg = _EFFECTS_BY_NAME.get(name)
    if reg is not None:
        return reg
    for t in _known_effect_types():
        if _qualified(t) == name:
            return (t, None, None)
    return None


def decode_effect(reader, t, path):
    name = t.string(LE.type_name, path, "type_name")
    if not name:
        raise PayloadError("effect type name missing", f"{path}.type_name")
    reg = effect_type_by_name(name)
    if reg is None:
        raise UnregisteredError(
            f"unknown effect type {name!r}: register it with "
            "jaxcolo.register_effect", f"{path}.type_name")
    etype, _, from_bytes = reg
    state = t.bytes(LE.state, path, "state")
    try:
        if from_bytes is not None:
            return from_bytes(state or b"")
        if state is not None:
            raise PayloadError(f"effect {name!r} takes no state",
                               f"{path}.state")
        return _instance_of(etype)
    except PayloadError:
        raise
    except Exception as e:
        raise PayloadError(f"cannot rebuild effect {name!r}: {e!r}",
                           path) from None


def intern_effect(writer, eff, path) -> int:
    writer.require("effect", path)
    item = _effect_item(eff, path)
    return writer.intern("effects", item, item)


def intern_prng_impl(writer, impl, path) -> int:
    writer.require("prng_impl", path)
    if prng.prngs.get(impl.name) is not impl:
        raise EncodeError(f"PRNG impl {impl.name!r} is not registered with "
                          "jax", path)
    return writer.intern("prng_impls", impl.name, impl.name)


def registered_count() -> int:
    """Effects and PRNG impls registered in this process (grows with each
    registration)."""
    return len(_EFFECTS_BY_NAME) + len(prng.prngs)


def decode_prng_impl(name: str, path: str):
    impl = prng.prngs.get(name)
    if impl is None:
        raise UnregisteredError(f"PRNG impl {name!r} is not registered here",
                                path)
    return impl


PRNGImpl = prng.PRNGImpl

register_table("effects", build_effect, decode_effect)
register_leaf((core.Effect,), LeafKind.effect, "effects", intern_effect,
              subclasses=True)
register_leaf((PRNGImpl,), LeafKind.prng_impl, "prng_impls", intern_prng_impl)
