"""What the frozen version-5 golden payloads next to this file hold.

Frozen with the payloads: never edit.  Version 5 changed no table: it marks
HloShardings whose OpSharding has ``last_tile_dims`` (subgroup types, as
shard_map's manual subgroups make), which readers before 5 cannot parse.
Everything version 4 wrote is written again at version 5 (this module reuses
v4's frozen module); ``subgroups`` adds HloShardings and a GSPMDSharding with
manual and replicated last tile dims.
"""

from __future__ import annotations

import os
import sys

_TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                      "..", "..", "tools")


def _v4():
    sys.path.insert(0, os.path.abspath(_TOOLS))
    from make_spec_golden import load_objects
    return load_objects(4)


def _hlo(dims, last):
    from jax._src.lib import xla_client as xc
    op = xc.OpSharding()
    op.type = xc.OpSharding.Type.OTHER
    op.tile_assignment_dimensions = dims
    op.iota_reshape_dims = [8]
    op.iota_transpose_perm = [0]
    op.last_tile_dims = last
    return xc.HloSharding.from_proto(op)


def _subgroups() -> list:
    import jax
    from jax._src import sharding_impls
    from jax._src.lib import xla_client as xc
    T = xc.OpSharding.Type
    manual = _hlo([2, 2, 2], [T.MANUAL])
    both = _hlo([2, 2, 2], [T.MANUAL, T.REPLICATED])
    return [manual, both, sharding_impls.GSPMDSharding(
        tuple(jax.devices()), _hlo([4, 2], [T.MANUAL]))]


def objects() -> dict:
    """name -> spec object written with jaxcolo.serialize(obj, version=5)."""
    out = dict(_v4().objects())
    out["subgroups"] = {"subgroups": _subgroups()}
    return out


def symbolic_objects() -> dict:
    return _v4().symbolic_objects()


def payloads(version: int) -> dict:
    """name -> payload of the other root kinds, written at ``version``."""
    return _v4().payloads(version)


def check_payload(name: str, decoded) -> None:
    _v4().check_payload(name, decoded)
