"""Malformed payloads: only PayloadError (with a field path), never a hang."""

import collections
import os
import re
import random
import struct
import sys
import tracemalloc

import jax
import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jaxcolo
import jaxcolo.export
import jaxcolo_fb as fb
from jaxcolo import envelope
from jaxcolo.fastbuilder import FastBuilder
from tests import corpus

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import fuzz_payloads  # noqa: E402


def test_mutation_fuzz_only_payload_errors():
    seeds = fuzz_payloads.seed_payloads()
    from jaxcolo import envelope
    from jaxcolo.wire import enum_values
    from jaxcolo_fb import RootKind
    kinds = {envelope.read_header(s).root_kind for s in seeds}
    assert kinds == set(enum_values(RootKind)) - {0}, kinds  # every kind
    counts, failures = fuzz_payloads.run(seeds, 4000, random.Random(1234))
    assert not failures, failures[0][1]
    assert counts["PayloadError"] > 1000
    assert not fuzz_payloads.run.unchecked, fuzz_payloads.run.unchecked[0][1]


def test_checksum_catches_bit_flips():
    data = bytearray(jaxcolo.serialize(corpus.meshes()))
    data[len(data) // 2] ^= 0x10
    with pytest.raises(jaxcolo.PayloadError, match=r"checksum.*\$\.header\.crc32"):
        jaxcolo.deserialize(bytes(data))


@pytest.mark.parametrize("cut", [0, 3, 15, 16, 20, -1, -7])
def test_truncation(cut):
    obj = corpus.avals()
    data = jaxcolo.serialize(obj, compress=False)
    with pytest.raises(jaxcolo.PayloadError):
        jaxcolo.deserialize(data[:cut])
    # With a forged checksum: an error, or (cut padding only) nothing lost.
    if len(data[:cut]) > 16:
        try:
            out = jaxcolo.deserialize(fuzz_payloads.fix_crc(data[:cut]))
        except jaxcolo.PayloadError:
            return
        assert out == obj


def test_not_bytes_and_wrong_magic():
    with pytest.raises(jaxcolo.PayloadError, match="must be bytes"):
        jaxcolo.deserialize("text")
    with pytest.raises(jaxcolo.PayloadError, match="magic"):
        jaxcolo.deserialize(b"\x00" * 64)


def _with_header(data, **changes):
    magic, w, r, k, f, res, crc = envelope.HEADER.unpack_from(data, 0)
    vals = dict(writer=w, reader=r, kind=k, flags=f)
    vals.update(changes)
    return envelope.HEADER.pack(magic, vals["writer"], vals["reader"],
                                vals["kind"], vals["flags"], res, crc) + data[16:]


def test_version_errors_name_versions():
    data = jaxcolo.serialize(np.dtype("f4"))
    with pytest.raises(jaxcolo.VersionError,
                       match=r"needs a reader of version >= 99.*supports "
                             rf"versions 1\.\.{jaxcolo.SCHEMA_VERSION}"):
        jaxcolo.deserialize(_with_header(data, writer=99, reader=99))
    with pytest.raises(jaxcolo.PayloadError, match="root kind 77"):
        jaxcolo.deserialize(_with_header(data, kind=77))
    with pytest.raises(jaxcolo.PayloadError, match=r"^unknown header flag "
                       r"bits set \(flags=2\) - at \$\.header\.flags$"):
        jaxcolo.deserialize(_with_header(data, flags=2))
    # each header field by its own name (the reserved one was "flags"; a
    # version 0 was "inconsistent" with a writer version equal to it)
    bad = bytearray(data)
    bad[10] = 1
    with pytest.raises(jaxcolo.PayloadError, match=r"^reserved header field "
                       r"set \(1\) - at \$\.header\.reserved$"):
        jaxcolo.deserialize(bytes(bad))
    for fn in (jaxcolo.deserialize, jaxcolo.inspect):
        with pytest.raises(jaxcolo.PayloadError, match=r"^min_reader_version "
                           r"0: versions start at 1 - at \$\.header\."
                           r"min_reader_version$"):
            fn(_with_header(data, writer=0, reader=0))


def _reseal(body: bytes, flags: int) -> bytes:
    head = envelope.HEADER.pack(envelope.MAGIC, 1, 1, 1, flags, 0,
                                zlib.crc32(body))
    return head + body


def test_compressed_body_errors():
    everything = corpus.everything()  # one object: one set of scopes
    plain = jaxcolo.serialize(everything, compress=False)
    packed = jaxcolo.serialize(everything)
    assert packed[8 + 1] == envelope.FLAG_ZLIB and len(packed) < len(plain)
    assert plain[9] == 0
    assert jaxcolo.deserialize(plain) == jaxcolo.deserialize(packed)
    # A plain body flagged as compressed; a truncated and an extended stream.
    with pytest.raises(jaxcolo.PayloadError, match=r"corrupt compressed body"
                                                   r".*\$\.body"):
        jaxcolo.deserialize(_reseal(plain[16:], envelope.FLAG_ZLIB))
    with pytest.raises(jaxcolo.PayloadError, match="truncated"):
        jaxcolo.deserialize(_reseal(packed[16:-5], envelope.FLAG_ZLIB))
    with pytest.raises(jaxcolo.PayloadError, match="trailing"):
        jaxcolo.deserialize(_reseal(packed[16:] + b"xx", envelope.FLAG_ZLIB))
    # A deflate bomb (20 MB of zeros in ~20 KB) is refused by the inflate
    # bound before it is allocated in full; writers never exceed the bound.
    bomb = zlib.compress(bytes(20_000_000), 9)
    assert len(bomb) * envelope.MAX_INFLATE_RATIO < 20_000_000
    with pytest.raises(jaxcolo.PayloadError, match="too large"):
        jaxcolo.deserialize(_reseal(bomb, envelope.FLAG_ZLIB))
    for n in (1_000, 1_000_000, 20_000_000):  # whatever writers compress
        sealed = envelope.seal(bytes(n), 1, 1, 1, compress=True)  # is read
        header = envelope.read_header(sealed)
        assert envelope.open_body(sealed, header) == bytes(n)


def _find(data: bytes, needle: bytes) -> int:
    i = data.find(needle)
    assert i > 0
    return i


def test_invalid_utf8_named():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("qqqq",))
    data = bytearray(jaxcolo.serialize(mesh, compress=False))
    data[_find(bytes(data), b"qqqq")] = 0xFF
    with pytest.raises(jaxcolo.PayloadError,
                       match=r"invalid UTF-8.*\$\.meshes\[0\]\.axis_names\[0\]"):
        jaxcolo.deserialize(fuzz_payloads.fix_crc(bytes(data)))


def test_huge_vector_length_is_refused_fast():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("qqqq",))
    data = bytearray(jaxcolo.serialize(mesh, compress=False))
    i = _find(bytes(data), b"qqqq")
    data[i - 4:i] = struct.pack("<I", 0xFFFFFFF0)
    with pytest.raises(jaxcolo.PayloadError, match="exceeds the buffer"):
        jaxcolo.deserialize(fuzz_payloads.fix_crc(bytes(data)))


def test_unknown_enum_value_named():
    data = bytearray(jaxcolo.serialize(jax.ShapeDtypeStruct((2,), np.float32),
                                         compress=False))
    # The only float32 DType byte (10) sits in the DTypeSpec table; find it by
    # re-encoding with float64 (11) and diffing.
    other = jaxcolo.serialize(jax.ShapeDtypeStruct((2,), np.float64), compress=False)
    diffs = [i for i in range(16, len(data)) if data[i] != other[i]]
    assert len(diffs) == 1
    data[diffs[0]] = 250
    with pytest.raises(jaxcolo.PayloadError,
                       match=r"unknown DType value 250.*\$\.dtypes\[0\]\.kind"):
        jaxcolo.deserialize(fuzz_payloads.fix_crc(bytes(data)))


def test_absurd_pytree_depth(monkeypatch):
    from jaxcolo.codec import pytree
    tree = np.dtype("f4")
    for _ in range(300):
        tree = [tree]
    with pytest.raises(jaxcolo.EncodeError, match="deeper than 256"):
        jaxcolo.serialize(tree)
    monkeypatch.setattr(pytree, "MAX_DEPTH", 400)
    data = jaxcolo.serialize(tree)
    monkeypatch.setattr(pytree, "MAX_DEPTH", 256)
    with pytest.raises(jaxcolo.PayloadError, match=r"deeper than 256.*\$\.structure"):
        jaxcolo.deserialize(data)


# --------------------------------------------------------- property based

_dtypes = st.sampled_from(corpus.ALL_DTYPES)
_shapes = st.lists(st.integers(0, 64), max_size=4).map(tuple)


@st.composite
def sds(draw):
    mesh = draw(st.sampled_from(corpus.meshes()[:4]))
    names = mesh.axis_names
    spec = draw(st.lists(st.sampled_from((None,) + names), max_size=2,
                         unique=True))
    sharding = draw(st.sampled_from([
        None, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)),
        jax.sharding.SingleDeviceSharding(jax.devices()[draw(st.integers(0, 7))])]))
    shape = draw(_shapes)
    if sharding is not None and len(shape) < len(spec):
        shape = shape + (8,) * (len(spec) - len(shape))
    return jax.ShapeDtypeStruct(shape, draw(_dtypes), sharding=sharding,
                                weak_type=draw(st.booleans()))


_keys = st.text(min_size=1, max_size=5)
_trees = st.recursive(
    st.one_of(sds(), _dtypes, st.none()),
    lambda ch: st.one_of(st.lists(ch, max_size=4), st.tuples(ch, ch),
                         st.dictionaries(_keys, ch, max_size=4)),
    max_leaves=30)


@settings(max_examples=150, deadline=None)
@given(_trees)
def test_property_roundtrip(tree):
    out = jaxcolo.deserialize(jaxcolo.serialize(tree))
    assert out == tree
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)


# --- nested compressed payloads: one inflation budget per decode ----------

def _zeros_spec_payload(n: int) -> bytes:
    """A spec-tree envelope whose body deflates ``n`` zero bytes (fixed
    Huffman: about n/160 stored, within the per-envelope ratio, and the
    stored bytes are themselves very compressible)."""
    c = zlib.compressobj(9, zlib.DEFLATED, 15, 9, zlib.Z_FIXED)
    stored = c.compress(bytes(n)) + c.flush()
    assert n <= envelope.MAX_INFLATE_RATIO * len(stored)
    return envelope.HEADER.pack(
        envelope.MAGIC, jaxcolo.SCHEMA_VERSION, 1, fb.RootKind.spec_tree,
        envelope.FLAG_ZLIB, 0, zlib.crc32(stored)) + stored


def _bundle_around(specs: bytes) -> bytes:
    exp = jax.export.export(jax.jit(lambda x: x))(
        jax.ShapeDtypeStruct((2,), np.float32))
    b = FastBuilder()
    specs_off = b.CreateByteVector(specs)
    exp_off = b.CreateByteVector(bytes(jaxcolo.export.serialize(exp)))
    fb.ExportBundleStart(b)
    fb.ExportBundleAddExported(b, exp_off)
    fb.ExportBundleAddExportedVersion(b, 11)
    fb.ExportBundleAddSpecs(b, specs_off)
    b.Finish(fb.ExportBundleEnd(b))
    return envelope.seal(b.Output(), fb.RootKind.export_bundle,
                         jaxcolo.SCHEMA_VERSION, 2, compress=True)


def _program_around(specs: bytes) -> bytes:
    b = FastBuilder()
    name = b.CreateString("f")
    body = b.CreateByteVector(b"not a pickle")
    in_specs = b.CreateByteVector(specs)
    ids = b.CreateNumpyVector(np.array([0], np.int64))
    fb.ProgramStart(b)
    fb.ProgramAddName(b, name)
    fb.ProgramAddKind(b, fb.ProgramKind.function)
    fb.ProgramAddBody(b, body)
    fb.ProgramAddInSpecs(b, in_specs)
    fb.ProgramAddDeviceIds(b, ids)
    b.Finish(fb.ProgramEnd(b))
    return envelope.seal(b.Output(), fb.RootKind.program,
                         jaxcolo.SCHEMA_VERSION, 2, compress=True)


def _peak_while(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize("container", [_bundle_around, _program_around])
def test_nested_compressed_payloads_share_one_inflation_budget(container):
    # 32 MiB of zeros in a ~2 KB payload: each envelope alone is within its
    # own 256x ratio, but the ratios multiply through the nesting.
    data = container(_zeros_spec_payload(32 << 20))
    budget = envelope.NESTED_INFLATE_RATIO * len(data) + envelope.INFLATE_FLOOR
    # (the Exported's debug locations name this file: its size varies with
    # the checkout's path) the peak bound below excludes inflating 32 MiB
    assert 4 * budget < 32 << 20

    def decode():
        with pytest.raises(jaxcolo.PayloadError,
                           match=r"nested in this one inflate beyond "
                                 r"1024x.* - at \$\.(specs|in_specs)\.body"):
            jaxcolo.deserialize(data)
    assert _peak_while(decode) < 4 * budget  # inflating 32 MiB: refused
    with pytest.raises(jaxcolo.PayloadError, match="nested in this one"):
        jaxcolo.inspect(data)


def test_a_message_and_its_program_share_the_inflation_budget():
    # the worker decodes a registered program after its message: the
    # program's nested specs still count against the message's budget
    from jaxcolo.colocated.program import ProgramRef
    from jaxcolo.process import main_types, messages
    program = _program_around(_zeros_spec_payload(32 << 20))
    frame = messages.encode(messages.Message(
        fb.MessageKind.register, program_id=ProgramRef.of(program).id,
        program=program))
    m = messages.decode(frame)
    assert m.inflation is not None

    def decode():
        with pytest.raises(jaxcolo.PayloadError, match="nested in this one"):
            main_types.decode_importing(m.program, m.inflation)
    assert _peak_while(decode) < 16 << 20  # inflating 32 MiB: refused


def test_writers_nested_payloads_stay_within_the_inflation_budget():
    # a large, very compressible spec tree (compressed) inside a compressed
    # bundle is read back: what writers produce fits the shared budget
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    tree = [jax.ShapeDtypeStruct((8, 8), np.float32, sharding=jax.NamedSharding(
        mesh, jax.P("a", "b"))) for _ in range(3000)]
    data = jaxcolo.export.bundle(jax.export.export(jax.jit(lambda x: x))(
        jax.ShapeDtypeStruct((2,), np.float32)), tree)
    assert jaxcolo.deserialize(data).specs == tree


# --- rebuilding PyTreeDefs: node copies bounded by the payload size -------

def _deep_around_wide(depth: int, width: int):
    obj = [None] * width
    for _ in range(depth):
        obj = (obj,)
    return obj


def test_deep_nesting_around_a_wide_node_is_refused_by_reader_and_writer():
    # 250 nested 1-tuples around 200,000 Nones: ~25 KB compressed, but
    # rebuilding the PyTreeDef bottom-up copies every None 250 times
    from jaxcolo.codec.pytree import FlatTree, build_treedef, copy_budget
    depth, width = 250, 200_000
    flat = FlatTree()
    flat.kinds = bytearray([fb.NodeKind.tuple] * depth + [fb.NodeKind.list] +
                           [fb.NodeKind.none] * width)
    flat.arities = [1] * depth + [width]
    b = FastBuilder()
    structure = build_treedef(b, flat)
    empty = b.CreateByteVector(b"")
    fb.SpecTreeStart(b)
    fb.SpecTreeAddStructure(b, structure)
    fb.SpecTreeAddLeafKinds(b, empty)
    fb.SpecTreeAddLeafRefs(b, empty)
    b.Finish(fb.SpecTreeEnd(b))
    body = b.Output()
    assert depth * width > copy_budget(len(body))
    data = envelope.seal(body, fb.RootKind.spec_tree, jaxcolo.SCHEMA_VERSION,
                         1, compress=True)
    with pytest.raises(jaxcolo.PayloadError,
                       match=r"copies nodes out of proportion.* - at "
                             rf"\$\.structure\.kinds\[{depth}\]"):
        jaxcolo.deserialize(data)
    # the writer refuses what readers would: every payload written is read
    obj = _deep_around_wide(depth, width)
    with pytest.raises(jaxcolo.EncodeError, match="node copies"):
        jaxcolo.serialize(obj)
    # within the budget (the floor covers everyday trees): read back
    for obj in (_deep_around_wide(depth, 2000), _deep_around_wide(20, width)):
        assert jaxcolo.deserialize(jaxcolo.serialize(obj)) == obj


def test_an_exhausted_inflation_budget_inflates_nothing_more():
    # zlib reads a max_length of 0 as "no limit": a budget used up exactly
    # must still refuse the next compressed payload
    sealed = envelope.seal(bytes(100_000), fb.RootKind.spec_tree, 1, 1,
                           compress=True)
    header = envelope.read_header(sealed)
    with envelope.inflation_scope(envelope.Inflation(0)):
        with pytest.raises(jaxcolo.PayloadError, match="nested in this one"):
            envelope.open_body(sealed, header)
    with envelope.inflation_scope(envelope.Inflation(100_000)):
        assert envelope.open_body(sealed, header) == bytes(100_000)


def test_custom_namedtuple_nodes_are_charged_their_rebuild_by_both_sides(
        monkeypatch):
    """A custom node of a namedtuple type is rebuilt from PyTreeDef pickle
    state (STATE_COST copies per node below it): the reader charges that,
    and the writer refuses what the reader would."""
    from jaxcolo.codec import memo, pytree
    Tagged = corpus.Tagged
    obj = [None] * 20_000
    for i in range(10):
        obj = Tagged(obj, str(i))
    with pytest.raises(jaxcolo.EncodeError, match="node copies"):
        jaxcolo.serialize(obj)
    monkeypatch.setattr(pytree, "STATE_COST", 0)  # a writer not counting it
    monkeypatch.setattr(pytree, "_FLAT_CACHE", {})
    data = jaxcolo.serialize(obj)
    assert jaxcolo.deserialize(data) == obj
    monkeypatch.undo()
    memo.clear()
    with pytest.raises(jaxcolo.PayloadError, match="copies nodes out of "
                       "proportion"):
        jaxcolo.deserialize(data)
    inner = Tagged([None] * 2000, "small")
    assert jaxcolo.deserialize(jaxcolo.serialize(inner)) == inner


class _UnprintableMeta:
    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return isinstance(other, _UnprintableMeta) and other.v == self.v

    def __hash__(self):
        return hash(self.v)

    def __repr__(self):
        raise RuntimeError("no repr")


class _MetaNode:
    def __init__(self, a, meta):
        self.a, self.meta = a, meta


def test_trees_that_flatten_oddly_are_encode_errors_or_written():
    """A tree nested past Python's recursion limit, or containing itself,
    raised SystemError (JAX's C++ flatten wrapping a RecursionError); a
    defaultdict factory without __module__ (str.lower) raised
    AttributeError; an auxdata whose repr raises (printed only for a cache
    key) made serialize raise it, though its serializer works."""
    deep = None
    for _ in range(1000):
        deep = [deep]
    looped = []
    looped.append(looped)
    for tree in (deep, looped):
        with pytest.raises(jaxcolo.EncodeError, match=r"^the tree nests too "
                           r"deep to flatten, or contains itself - at \$$"):
            jaxcolo.serialize(tree)
    import collections
    with pytest.raises(jaxcolo.EncodeError, match=r"default_factory .* is "
                       r"not registered .* - at \$\['x'\]$"):
        jaxcolo.serialize({"x": collections.defaultdict(str.lower)})
    with pytest.raises(ValueError, match="must be a named module-level"):
        jaxcolo.register_default_factory(str.lower)
    s = jax.ShapeDtypeStruct((2,), np.float32)
    jax.tree_util.register_pytree_node(
        _MetaNode, lambda n: ((n.a,), n.meta),
        lambda m, c: _MetaNode(c[0], m))
    jax.export.register_pytree_node_serialization(
        _MetaNode, serialized_name="tests.bad_input.MetaNode",
        serialize_auxdata=lambda m: str(m.v).encode(),
        deserialize_auxdata=lambda b: _UnprintableMeta(int(b)))
    for _ in range(2):
        back = jaxcolo.deserialize(jaxcolo.serialize(
            _MetaNode(s, _UnprintableMeta(3))))
        assert back.meta == _UnprintableMeta(3) and back.a == s
    info = jaxcolo.inspect(jaxcolo.serialize(_MetaNode(s, _UnprintableMeta(3))))
    assert info["structure"] == ("PyTreeDef of 2 nodes and 1 leaves (not "
                                 "printed: RuntimeError in a node's repr)")


class _Cfg:
    def __init__(self, xs, names):
        self.xs, self.names = list(xs), tuple(names)


class _Box:
    def __init__(self, x, meta):
        self.x, self.meta = x, meta


def test_custom_auxdata_is_read_back_as_jax_reads_it():
    """Custom nodes were rebuilt straight from the deserialized auxdata:
    JSON auxdata (a tuple read back as a list) that the registered
    from_children normalises came back as a different PyTreeDef (JAX's
    export rebuilds the node and flattens it again, so it is equal there);
    a dataclass whose meta fields came back as a list was written and then
    refused by the reader; and a serializer that loses something was
    written, so a colocated function's outputs (read back from the
    discovered specs) matched on the first call only.  Readers rebuild the
    node as JAX does; writers refuse auxdata that does not read back."""
    import dataclasses
    import functools
    import json
    s = jax.ShapeDtypeStruct((2,), np.float32)
    jax.tree_util.register_pytree_node(
        _Cfg, lambda c: (c.xs, c.names), lambda names, xs: _Cfg(xs, names))
    jax.export.register_pytree_node_serialization(
        _Cfg, serialized_name="tests.bad_input.Cfg",
        serialize_auxdata=lambda names: json.dumps(list(names)).encode(),
        deserialize_auxdata=json.loads,
        from_children=lambda names, xs: _Cfg(xs, tuple(names)))
    td = jax.tree_util.tree_structure(_Cfg([s, s], ("w", "b")))
    assert jaxcolo.deserialize(jaxcolo.serialize([td])) == [td]

    @functools.partial(jax.tree_util.register_dataclass, data_fields=["x"],
                       meta_fields=["n", "tag"])
    @dataclasses.dataclass
    class DC:
        x: object
        n: int
        tag: str
    jax.export.register_pytree_node_serialization(
        DC, serialized_name="tests.bad_input.DC",
        serialize_auxdata=lambda aux: json.dumps(aux).encode(),
        deserialize_auxdata=json.loads)
    assert jaxcolo.deserialize(jaxcolo.serialize(DC(s, 3, "t"))) == \
        DC(s, 3, "t")

    jax.tree_util.register_pytree_node(
        _Box, lambda b: ((b.x,), b.meta), lambda m, c: _Box(c[0], m))
    jax.export.register_pytree_node_serialization(
        _Box, serialized_name="tests.bad_input.Box",
        serialize_auxdata=lambda m: json.dumps(m).encode(),
        deserialize_auxdata=json.loads)
    with pytest.raises(jaxcolo.EncodeError, match=re.escape(
            "auxdata of _Box ('tests.bad_input.Box') reads back as "
            "['w', 'b'], not ('w', 'b'): its serialize_auxdata and "
            "deserialize_auxdata must be inverses") + r".* - at \$\[1\]$"):
        jaxcolo.serialize([s, _Box(s, ("w", "b"))])
    back = jaxcolo.deserialize(jaxcolo.serialize(_Box(s, ["w", "b"])))
    assert back.meta == ["w", "b"]
    f = jaxcolo.colocated_python(lambda x: _Box(x, ("w", "b")))
    x = jax.device_put(np.ones(2, np.float32), jax.devices()[0])
    with jaxcolo.use_executor(jaxcolo.InlineExecutor()):
        with pytest.raises(jaxcolo.EncodeError, match="must be inverses"):
            f(x)


_PointNT = collections.namedtuple("_PointNT", "x y")


def test_a_namedtuple_whose_name_another_class_registered_is_refused():
    """A plain namedtuple is written by its module:qualname, and readers
    look that name up in jax.export's registry first: a different class
    registered under it came back instead, silently."""
    other = collections.namedtuple("Other", "x y")
    jax.export.register_namedtuple_serialization(
        other, serialized_name=f"{__name__}:_PointNT")
    s = jax.ShapeDtypeStruct((2,), np.float32)
    with pytest.raises(jaxcolo.EncodeError, match=r"namedtuple .*_PointNT is "
                       r"not registered, but that name is registered .* - at "
                       r"\$\['p'\]$"):
        jaxcolo.serialize({"p": _PointNT(s, s)})
    assert jaxcolo.deserialize(jaxcolo.serialize(other(s, s))) == other(s, s)


class _Picked:
    """Its auxdata records which children are sequences."""

    def __init__(self, xs):
        self.xs = list(xs)


def test_custom_nodes_are_rebuilt_over_their_children_subtrees():
    """Custom nodes were rebuilt over a 0.0 per child, not the child's
    subtree (jax.export rebuilds subtrees): a node whose flatten looks at
    its children's structure was refused by the writer, blaming its
    serializers, and a PyTreeDef written before read back different.  A
    node whose auxdata depends on its leaves' values is refused, saying
    so."""
    import json
    s = jax.ShapeDtypeStruct((2,), np.float32)
    jax.tree_util.register_pytree_node(
        _Picked, lambda n: (tuple(n.xs), tuple(
            isinstance(x, (tuple, list)) for x in n.xs)),
        lambda aux, ch: _Picked(ch))
    jax.export.register_pytree_node_serialization(
        _Picked, serialized_name="tests.bad_input.Picked",
        serialize_auxdata=lambda a: json.dumps(a).encode(),
        deserialize_auxdata=lambda b: tuple(json.loads(b)))
    tree = _Picked([(s, s), s])
    td = jax.tree_util.tree_structure(tree)
    back = jaxcolo.deserialize(jaxcolo.serialize([tree, td]))
    assert jax.tree_util.tree_structure(back[0]) == td and back[1] == td

    class ByLeafType:
        def __init__(self, xs):
            self.xs = list(xs)
    jax.tree_util.register_pytree_node(
        ByLeafType, lambda n: (tuple(n.xs), tuple(
            type(x).__name__ for x in n.xs)), lambda aux, ch: ByLeafType(ch))
    jax.export.register_pytree_node_serialization(
        ByLeafType, serialized_name="tests.bad_input.ByLeafType",
        serialize_auxdata=lambda a: json.dumps(a).encode(),
        deserialize_auxdata=lambda b: tuple(json.loads(b)))
    with pytest.raises(jaxcolo.EncodeError, match=r"is rebuilt by its "
                       r"from_children over placeholder leaves .* its auxdata "
                       r"must not depend on its leaves' values - at \$$"):
        jaxcolo.serialize(ByLeafType([s]))


_NamedPair = collections.namedtuple("_NamedPair", "a b")


def test_a_namedtuple_name_naming_another_kind_of_class(monkeypatch):
    """A namedtuple node whose name finds a class that is no namedtuple
    (builtins:int, collections:OrderedDict) was an UnregisteredError
    saying it was "neither registered ... nor defined in an imported
    module": check took the corrupt payload as fine where it exists."""
    from jaxcolo.checking import check_readable
    data = jaxcolo.serialize(
        _NamedPair(jax.ShapeDtypeStruct((2,), np.int8), None))
    monkeypatch.setattr(sys.modules[__name__], "_NamedPair", dict)
    with pytest.raises(jaxcolo.PayloadError, match=(
            r"^namedtuple type 'tests\.test_bad_input:_NamedPair' names the "
            r"class builtins\.dict here, not a namedtuple - at \$\.structure"
            r"\.node_data\[0\]\.name$")) as info:
        jaxcolo.deserialize(data)
    assert not isinstance(info.value, jaxcolo.UnregisteredError)
    ok, why = check_readable(data, jaxcolo.SCHEMA_VERSION)
    assert not ok and "not a namedtuple" in why, why
