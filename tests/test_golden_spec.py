"""Golden spec payloads of every released schema version are read forever.

tests/golden/spec/vN/ holds payloads written by schema version N
(tools/make_spec_golden.py) and the frozen objects module they came from.
Each payload must decode, with this reader, to objects equal to what that
module builds now.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys

import jax
import pytest

import jaxcolo
from jaxcolo import envelope

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
from make_spec_golden import GOLDEN, load_objects  # noqa: E402

VERSION_DIRS = sorted(glob.glob(os.path.join(GOLDEN, "v*")))


def _cases():
    for d in VERSION_DIRS:
        version = int(os.path.basename(d)[1:])
        with open(os.path.join(d, "manifest.json")) as f:
            manifest = json.load(f)
        for name in sorted(manifest["payloads"]):
            yield pytest.param(version, d, name, manifest["payloads"][name],
                               id=f"v{version}-{name}")


def test_every_released_version_has_golden_payloads():
    released = {int(os.path.basename(d)[1:]) for d in glob.glob(
        os.path.join(os.path.dirname(GOLDEN), "..", "..", "schema", "history",
                     "v*"))}
    have = {int(os.path.basename(d)[1:]) for d in VERSION_DIRS}
    assert released and released <= have


def test_every_root_and_message_kind_has_a_golden_payload():
    """A new root kind or message kind gets golden payloads in the version
    that adds it.  ``discover`` is the one exception: it has exactly the
    fields of ``call`` (only the kind number differs)."""
    from jaxcolo.process import messages
    from jaxcolo_fb import MessageKind, RootKind

    roots, kinds = set(), set()
    for path in glob.glob(os.path.join(GOLDEN, "v*", "*.bin")):
        with open(path, "rb") as f:
            data = f.read()
        header = envelope.read_header(data)
        roots.add(header.root_kind)
        if header.root_kind == RootKind.message:
            kinds.add(messages.decode(data).kind)
    want_roots = {v for k, v in vars(RootKind).items()
                  if not k.startswith("_") and v}
    want_kinds = {v for k, v in vars(MessageKind).items()
                  if not k.startswith("_") and v}
    assert roots == want_roots
    assert kinds | {MessageKind.discover} == want_kinds


def _symbolic_text(obj):
    return [(type(x).__name__, tuple(str(d) for d in x.shape), str(x.dtype))
            for x in jax.tree_util.tree_leaves(obj)]


@pytest.mark.parametrize("version,d,name,meta", list(_cases()))
def test_golden_payload_reads_back(version, d, name, meta):
    with open(os.path.join(d, name), "rb") as f:
        data = f.read()
    assert hashlib.sha256(data).hexdigest() == meta["sha256"]  # untouched
    header = envelope.read_header(data)
    assert header.writer_version == version
    assert header.min_reader_version <= version
    module = load_objects(version)
    stem = name.split(".")[0]
    got = jaxcolo.deserialize(data)
    if name.endswith(".bin") and stem not in module.objects() and \
            stem not in module.symbolic_objects():
        module.check_payload(stem, got)  # another root kind
    elif stem in module.objects():
        assert got == module.objects()[stem]
    else:
        assert _symbolic_text(got) == _symbolic_text(
            module.symbolic_objects()[stem])
        if hasattr(module, "check_symbolic"):
            module.check_symbolic(stem, got)
    assert jaxcolo.inspect(data)["writer_version"] == version
