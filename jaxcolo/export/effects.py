"""Effects and disabled safety checks in JAX's export format.

An effect travels as ``str(type(effect))`` and is rebuilt, as JAX does, by
calling the nullary constructor of the lowerable effect type with that name.
"""

from __future__ import annotations

from jax._src import effects as jeffects
from jax._src.export import _export as jexport

import jaxcolo_jax_export_fb as fb
from jaxcolo.codec.effects import snapshot
from jaxcolo.errors import EncodeError, PayloadError, UnregisteredError
from jaxcolo.export.layouts import CHECK as LC, EFFECT as LE

_CK = fb.DisabledSafetyCheckKind
DisabledSafetyCheck = jexport.DisabledSafetyCheck
_PLATFORM = DisabledSafetyCheck.platform()


# ------------------------------------------------------------------ effects

def encode_effect(builder, eff, path) -> int:
    t = type(eff)
    try:
        replica = t()
        same = replica == eff and hash(replica) == hash(eff)
    except Exception:
        same = False
    if not same:
        raise EncodeError(
            f"effect {eff!r} is not serializable: JAX's format needs a "
            "nullary constructor that produces an equal, equally hashed "
            "effect", path)
    name = builder.CreateString(str(t))
    fb.EffectStart(builder)
    fb.EffectAddTypeName(builder, name)
    return fb.EffectEnd(builder)


def _effect_types() -> dict:
    """Lowerable effect types by name; of types with one name, the first in
    JAX's own iteration order (the one jax.export's reader returns)."""
    types: dict = {}
    # (another thread may register effect types meanwhile)
    for t in snapshot(jeffects.lowerable_effects._effect_types):
        types.setdefault(str(t), t)
    return types


def decode_effect(t, path):
    name = t.string(LE.type_name, path, "type_name")
    if name is None:
        raise PayloadError("effect type name missing", f"{path}.type_name")
    etype = _effect_types().get(name)
    if etype is None:
        raise UnregisteredError(f"unknown effect type {name!r} (not a "
                                "lowerable effect known to this process)",
                                f"{path}.type_name")
    try:
        return etype()
    except Exception as e:
        raise PayloadError(f"cannot construct effect {name!r}: {e!r}",
                           path) from None


# -------------------------------------------------------- disabled checks

def encode_check(builder, check, path) -> int:
    target = check.is_custom_call()
    target_off = 0
    if target is not None:
        kind = _CK.custom_call
        target_off = builder.CreateString(target)
    elif check == _PLATFORM:
        kind = _CK.platform
    else:
        raise EncodeError(f"disabled safety check {check} has no JAX export "
                          "encoding", path)
    fb.DisabledSafetyCheckStart(builder)
    fb.DisabledSafetyCheckAddKind(builder, kind)
    if target_off:
        fb.DisabledSafetyCheckAddCustomCallTarget(builder, target_off)
    return fb.DisabledSafetyCheckEnd(builder)


def decode_check(t, path):
    kind = t.scalar(LC.kind, "u8", 0, path, "kind")
    if kind == _CK.platform:
        return _PLATFORM
    if kind == _CK.custom_call:
        target = t.string(LC.custom_call_target, path, "custom_call_target")
        if not target:
            raise PayloadError("custom_call check without a target",
                               f"{path}.custom_call_target")
        return DisabledSafetyCheck.custom_call(target)
    if kind == _CK.shape_assertions:
        # Removed from JAX in Nov 2024; JAX 0.4.35..0.9.2 read it as a no-op
        # custom_call("no op") (0.10.0 on refuse it).  jaxcolo reads it so.
        return DisabledSafetyCheck.custom_call("no op")
    raise PayloadError(f"unknown DisabledSafetyCheckKind value {kind}",
                       f"{path}.kind")
