"""Payloads late releases wrote with a feature stamped readable by older
readers than the feature's version (tests/golden/legacy, written by the
real code of the commits its manifest names).

Such features are versions.LENIENT: readers read them whatever the header
says, and ``jaxcolo check`` finds them in the body.  Each payload here was
refused by readers that checked the header against the body instead, while
the release that wrote it read it back equal.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import NamedTuple

import jax
import numpy as np
import pytest

import jaxcolo
from jaxcolo.checking import check_readable
from tests import corpus

HERE = os.path.join(os.path.dirname(__file__), "golden", "legacy")
MANIFEST = json.load(open(os.path.join(HERE, "manifest.json")))["payloads"]


class LegacySwapped(NamedTuple):
    """A namedtuple registered as a custom node that swaps its fields."""
    x: object
    y: object


jax.tree_util.register_pytree_node(
    LegacySwapped, lambda t: ((t.y, t.x), "swapped"),
    lambda aux, ch: LegacySwapped(ch[1], ch[0]))
jax.export.register_pytree_node_serialization(
    LegacySwapped, serialized_name="jaxcolo.tests.legacy.Swapped",
    serialize_auxdata=str.encode, deserialize_auxdata=bytes.decode)


def _namedtuple_custom_node():
    return {"s": LegacySwapped(jax.ShapeDtypeStruct((2,), np.float32),
                               jax.ShapeDtypeStruct((3,), np.int8)),
            "td": jax.tree_util.tree_structure(LegacySwapped(1, 2))}


def _hlo_last_tile_dims():
    return [corpus.manual_subgroup_sharding()]


# name -> (the object written, the feature's version: check's answer)
CASES = {
    "v7_namedtuple_custom_node.bin": (_namedtuple_custom_node, 8),
    "v4_hlo_last_tile_dims.bin": (_hlo_last_tile_dims, 5),
}


def test_every_legacy_payload_has_a_case():
    assert sorted(MANIFEST) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_legacy_payload_reads_back_and_is_checked(name):
    data = open(os.path.join(HERE, name), "rb").read()
    meta = MANIFEST[name]
    assert hashlib.sha256(data).hexdigest() == meta["sha256"]
    info = jaxcolo.inspect(data)
    assert info["writer_version"] == meta["writer_version"]
    assert info["min_reader_version"] == 1  # as that release stamped it
    make, since = CASES[name]
    assert jaxcolo.deserialize(data) == make()
    assert info["readable_by_versions"][0] == since
    assert check_readable(data, jaxcolo.SCHEMA_VERSION)[0]
    ok, why = check_readable(data, since - 1)
    assert not ok and f"needs reader version >= {since}" in why, why
