"""Round trips of every spec kind and dtype through jaxcolo payloads."""

import collections.abc
import pickle

import cloudpickle
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcolo
from tests import corpus


def roundtrip(obj, **kw):
    return jaxcolo.deserialize(jaxcolo.serialize(obj, **kw))


@pytest.mark.parametrize("dtype", corpus.ALL_DTYPES, ids=str)
def test_every_dtype(dtype):
    out = roundtrip(dtype)
    assert out == dtype
    assert type(out) is type(dtype)
    assert str(out) == str(dtype)
    if isinstance(dtype, np.dtypes.StringDType):
        assert out.coerce == dtype.coerce
        assert getattr(out, "na_object", "absent") == \
            getattr(dtype, "na_object", "absent")


@pytest.mark.parametrize("mesh", corpus.meshes(), ids=repr)
def test_meshes(mesh):
    out = roundtrip(mesh)
    assert out == mesh
    assert out.axis_types == mesh.axis_types
    assert (out.device_ids == mesh.device_ids).all()


@pytest.mark.parametrize("sharding", corpus.shardings(), ids=repr)
def test_shardings(sharding):
    out = roundtrip(sharding)
    assert out == sharding
    assert hash(out) == hash(sharding)
    assert type(out) is type(sharding)
    assert out.memory_kind == sharding.memory_kind


@pytest.mark.parametrize("aval", corpus.avals(), ids=repr)
def test_avals(aval):
    out = roundtrip(aval)
    assert out == aval
    assert type(out) is type(aval)
    assert [str(d) for d in out.shape] == [str(d) for d in aval.shape]
    assert out.dtype == aval.dtype
    assert out.weak_type == aval.weak_type
    assert out.sharding == aval.sharding


@pytest.mark.parametrize("tree", corpus.pytrees(), ids=repr)
def test_pytrees(tree):
    out = roundtrip(tree)
    assert jax.tree_util.tree_structure(out) == \
        jax.tree_util.tree_structure(tree)
    assert out == tree
    assert type(out) is type(tree)


@pytest.mark.parametrize("obj", corpus.misc(), ids=repr)
def test_misc(obj):
    out = roundtrip(obj)
    assert out == obj
    assert type(out) is type(obj)


def test_symbolic_constraints_survive():
    a, b = jax.export.symbolic_shape("a, b", constraints=("a >= b", "b >= 2"))
    out = roundtrip(jax.ShapeDtypeStruct((a, b), np.float32))
    oa, ob = out.shape
    assert oa == a and ob == b
    # The constraint is live in the decoded scope: a >= b is decidable.
    assert oa >= ob
    assert [c.debug_str for c in oa.scope._explicit_constraints] == \
        ["a >= b", "b >= 2"]


def test_symbolic_in_fresh_process(tmp_path):
    """Constraints are rebuilt where no live scope exists (new process)."""
    import subprocess
    import sys
    a, b = jax.export.symbolic_shape("a, b", constraints=("a >= b + 1",))
    f = tmp_path / "p.bin"
    f.write_bytes(jaxcolo.serialize(jax.ShapeDtypeStruct((a, b * 2), np.int8)))
    code = (
        "import os; os.environ['XLA_FLAGS']='--xla_force_host_platform_device_count=8'\n"
        "import jaxcolo, sys\n"
        f"s = jaxcolo.deserialize(open({str(f)!r}, 'rb').read())\n"
        "a, b2 = s.shape\n"
        "print(str(a), str(b2), a >= 1, [c.debug_str for c in a.scope._explicit_constraints])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, check=True).stdout.split(None, 3)
    assert out[:3] == ["a", "2*b", "True"]
    assert "a >= b + 1" in out[3]


def _shapes(*texts, constraints=()):
    """One fresh SymbolicScope per text (as separate symbolic_shape calls
    make them)."""
    return [jax.export.symbolic_shape(t, constraints=constraints)
            for t in texts]


def test_separate_scopes_stay_separate():
    """Shapes from separate symbolic_shape calls (distinct scopes, equal
    constraints) come back equal to the originals, each in its own scope;
    version 5 readers would merge them, so writing version 5 is refused."""
    (b1, four), (b2, eight) = _shapes("b, 4", "b, 8")
    tree = [jax.ShapeDtypeStruct((b1, four), np.float32),
            jax.ShapeDtypeStruct((b2, eight), np.float32),
            core_shaped((b1, 2))]
    data = jaxcolo.serialize(tree)
    out = jaxcolo.deserialize(data)
    assert out == tree
    assert out[0].shape[0].scope is b1.scope
    assert out[1].shape[0].scope is b2.scope
    assert jaxcolo.inspect(data)["min_reader_version"] == 6
    with pytest.raises(jaxcolo.EncodeError, match=r"two distinct scopes with "
                       r"equal constraints.*before version 6.* - at \$\[1\]"):
        jaxcolo.serialize(tree, version=5)
    # One scope (or scopes with different constraints) needs no new reader.
    one = jaxcolo.serialize(tree[::2], version=1)
    assert roundtrip(tree[::2]) == tree[::2]
    assert jaxcolo.inspect(one)["min_reader_version"] == 1
    (c,) = _shapes("c", constraints=("c >= 2",))
    mixed = [tree[0], jax.ShapeDtypeStruct(c, np.int8)]
    assert jaxcolo.inspect(jaxcolo.serialize(mixed))["min_reader_version"] == 1
    assert roundtrip(mixed, version=5) == mixed


def core_shaped(shape):
    return jax.core.ShapedArray(shape, np.float32)


def test_scope_identity_across_payloads():
    """A scope keeps its identity from payload to payload: two payloads of
    one scope, decoded where the original is gone, share one new scope; a
    payload of another scope with equal constraints gets another."""
    import gc
    (a1, n1), (a2, _) = _shapes("a, n", "a, 1", constraints=("a >= n",))
    d1 = jaxcolo.serialize(jax.ShapeDtypeStruct((a1, n1), np.float32))
    d2 = jaxcolo.serialize({"k": core_shaped((a1 + 1,))})
    d3 = jaxcolo.serialize(jax.ShapeDtypeStruct((a2,), np.float32))
    del a1, n1, a2
    gc.collect()
    x = jaxcolo.deserialize(d1).shape
    y = jaxcolo.deserialize(d2)["k"].shape[0]
    z = jaxcolo.deserialize(d3).shape[0]
    assert y.scope is x[0].scope and y == x[0] + 1
    assert z.scope is not x[0].scope
    assert x[0] >= x[1]  # the constraint is live in the new scope
    # What a reader decoded travels on with its token: re-encoded and read
    # again, it is the same scope.
    again = roundtrip([core_shaped(x), core_shaped((y,))])
    assert again[0].shape[0].scope is x[0].scope and again[1].shape[0] == y


_SCOPED_PAYLOADS = r"""
import pickle, sys, jax, numpy as np, jaxcolo
from jax import export
out = []
for k in range(1, 13):
    scope = export.SymbolicScope([f"a >= {k}", "b >= a"])
    a, b = export.symbolic_shape("a, b", scope=scope)
    out.append(jaxcolo.serialize(jax.ShapeDtypeStruct((a, b), np.float32)))
sys.stdout.buffer.write(pickle.dumps(out))
"""


def test_concurrent_decodes_of_a_scope_share_it():
    """Threads decoding payloads of one scope at once (written by another
    process, as a controller's are for a worker) each made a scope of their
    own: dims of the payloads could not be compared or combined ('Invalid
    mixing of symbolic scopes'; found by review, 3-15 of 20 tries)."""
    import subprocess
    import sys
    import threading
    payloads = pickle.loads(subprocess.run(
        [sys.executable, "-c", _SCOPED_PAYLOADS], capture_output=True,
        check=True).stdout)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: the window opens
    try:
        for data in payloads:
            barrier = threading.Barrier(4)
            out = [None] * 4

            def decode(i):
                barrier.wait()
                out[i] = jaxcolo.deserialize(data).shape

            threads = [threading.Thread(target=decode, args=(i,))
                       for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            later = jaxcolo.deserialize(data).shape
            assert {id(o[0].scope) for o in out} == {id(later[0].scope)}
            assert all(o[1] - later[1] == 0 for o in out)
    finally:
        sys.setswitchinterval(interval)


def test_scope_token_with_other_constraints_is_a_new_scope():
    """A payload that reuses a live scope's token with other constraints
    does not get that scope (tokens name scopes, constraints decide)."""
    from jaxcolo.codec import scopes
    (a, b), = _shapes("a, b", constraints=("a >= b",))
    (c,), = _shapes("c")
    data = bytearray(jaxcolo.serialize(jax.ShapeDtypeStruct((c,), np.int8),
                                       compress=False))
    # Put a's token where c's is (same width), then fix the checksum.
    tok_c = scopes._scope_token(c.scope).to_bytes(8, "little")
    tok_a = scopes._scope_token(a.scope).to_bytes(8, "little")
    assert data.count(tok_c) == 1
    data[data.index(tok_c):data.index(tok_c) + 8] = tok_a
    import zlib
    data[12:16] = zlib.crc32(bytes(data[16:])).to_bytes(4, "little")
    (out,) = jaxcolo.deserialize(bytes(data)).shape
    assert out.scope is not a.scope and out.scope is not c.scope
    assert str(out) == "c"


def test_everything_at_once_and_identity_sharing():
    obj = corpus.everything()
    out = roundtrip(obj)
    assert out == obj
    s = NamedSharding(corpus.meshes()[1], P("x"))
    leaves = [jax.ShapeDtypeStruct((i + 1,), np.float32, sharding=s)
              for i in range(5)]
    out = roundtrip(leaves)
    assert all(o.sharding is out[0].sharding for o in out)


def test_thousand_leaf_nested_pytree():
    mesh = corpus.meshes()[1]
    sh = [NamedSharding(mesh, P("x", "y")), NamedSharding(mesh, P(None, "y"))]
    leaves = [jax.ShapeDtypeStruct((8 * (i % 7 + 1), 4), np.float32,
                                   sharding=sh[i % 2]) for i in range(1000)]
    tree = {"layers": [{"w": leaves[i], "b": (leaves[i + 1], None)}
                       for i in range(0, 600, 2)],
            "rest": tuple(leaves[600:])}
    data = jaxcolo.serialize(tree)
    out = jaxcolo.deserialize(data)
    assert out == tree
    assert len(jax.tree_util.tree_leaves(out)) == 1000
    # Shared objects are stored once: far smaller than one record per leaf.
    assert len(data) < 20_000


def test_decode_never_touches_pickle(monkeypatch):
    obj = corpus.everything()
    data = jaxcolo.serialize(obj)

    def refuse(*a, **k):
        raise AssertionError("pickle used while decoding")
    for mod in (pickle, cloudpickle):
        monkeypatch.setattr(mod, "loads", refuse)
        monkeypatch.setattr(mod, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    assert jaxcolo.deserialize(data) == obj


def test_device_resolver():
    mesh = corpus.meshes()[1]
    data = jaxcolo.serialize(mesh)
    devs = jax.devices()
    # A mapping that swaps device 0 and 1.
    mapping = {d.id: d for d in devs}
    mapping[0], mapping[1] = devs[1], devs[0]
    out = jaxcolo.deserialize(data, device_resolver=mapping)
    assert out.devices.flat[0] is devs[1]
    with pytest.raises(jaxcolo.PayloadError,
                       match=r"unknown device id 5.*\$\.meshes\[0\]\.device_ids"):
        jaxcolo.deserialize(data, device_resolver=devs[:5])
    # A sequence stands for the devices it holds, each by its own id (as
    # the README says): its order does not remap ids.
    back = jaxcolo.deserialize(data, device_resolver=devs[::-1])
    assert back == mesh and back.devices.flat[0] is mesh.devices.flat[0]
    with pytest.raises(jaxcolo.PayloadError, match="unknown device id"):
        jaxcolo.deserialize(jaxcolo.serialize(devs[7]),
                            device_resolver=lambda i: None)


@pytest.mark.parametrize("error", [RuntimeError("resolver bug"),
                                   ValueError("resolver bug")])
def test_a_device_resolver_that_raises_is_named(error):
    """A resolver raising (not LookupError) was a RuntimeError, a "malformed
    payload (ValueError) at $" or an "invalid sharding" at the sharding,
    by leaf type (found by review): one PayloadError naming the field
    resolved and the resolver's error, its __cause__."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    devs = jax.devices()

    def resolver(i):
        if i == 5:
            raise error
        return devs[i]
    for obj in (mesh, jax.sharding.NamedSharding(mesh, P("x")),
                [jax.ShapeDtypeStruct((8,), np.float32, sharding=jax.sharding.
                                      NamedSharding(mesh, P("x")))]):
        with pytest.raises(jaxcolo.PayloadError,
                           match=r"^the device resolver raised "
                                 f"{type(error).__name__}" r"\('resolver bug'"
                                 r"\) for device id 5 - at \$\.meshes\[0\]\."
                                 r"device_ids$") as info:
            jaxcolo.deserialize(jaxcolo.serialize(obj),
                                device_resolver=resolver)
        assert info.value.__cause__ is error
    class Flaky(collections.abc.Mapping):  # a mapping's get, the same
        def __getitem__(self, k):
            raise RuntimeError("resolver bug")

        def get(self, k, default=None):
            raise RuntimeError("resolver bug")

        def __iter__(self):
            return iter(())

        def __len__(self):
            return 0
    for obj in (mesh, jax.sharding.SingleDeviceSharding(devs[1])):
        with pytest.raises(jaxcolo.PayloadError, match=r"^the device resolver "
                           r"raised RuntimeError\('resolver bug'\) for device "
                           r"id \d - at \$\.(meshes|device_lists)\[0\]\."
                           r"device_ids$") as info:
            jaxcolo.deserialize(jaxcolo.serialize(obj), device_resolver=Flaky())
        assert type(info.value.__cause__) is RuntimeError
    with pytest.raises(jaxcolo.PayloadError,  # a device leaf
                       match=r"raised ZeroDivisionError.* device id 5 - at "
                             r"\$\.devices") as info:
        jaxcolo.deserialize(jaxcolo.serialize(devs[5]),
                            device_resolver=lambda i: 1 / 0)
    assert type(info.value.__cause__) is ZeroDivisionError


def test_encode_errors_name_the_leaf():
    with pytest.raises(jaxcolo.EncodeError,
                       match=r"unsupported leaf.*at \$\['a'\]\[1\]"):
        jaxcolo.serialize({"a": [np.dtype("f4"), object()]})

    class Unregistered:
        pass
    jax.tree_util.register_pytree_node(
        Unregistered, lambda u: ((), None), lambda a, c: Unregistered())
    with pytest.raises(jaxcolo.EncodeError, match="register it"):
        jaxcolo.serialize([Unregistered()])
    with pytest.raises(jaxcolo.EncodeError, match="carries state"):
        from jax._src.core import NamedAxisEffect
        jaxcolo.serialize(NamedAxisEffect("i"))
    from jax._src.state.types import ReadEffect  # JAX's, found by no reader
    with pytest.raises(jaxcolo.EncodeError,
                       match=r"ReadEffect\(0\).*carries state.*to_bytes="):
        jaxcolo.serialize(ReadEffect(0))


def test_stateful_effect_registry():
    from jax._src.core import NamedAxisEffect
    jaxcolo.register_effect(
        NamedAxisEffect, "tests.NamedAxisEffect",
        to_bytes=lambda e: e.name.encode(),
        from_bytes=lambda b: NamedAxisEffect(b.decode()))
    eff = NamedAxisEffect("batch")
    assert roundtrip(eff) == eff


def test_effects_read_and_written_while_another_thread_registers_some(
        monkeypatch):
    """Effect types are looked up in JAX's registries, which another thread
    may be filling (importing a library that defines effects): iterating
    them raised RuntimeError("Set changed size during iteration") out of
    serialize, deserialize and jaxcolo.export's reader (found by review);
    a module whose globals changed meanwhile made a valid payload a
    PayloadError."""
    import sys
    import threading
    import time
    import types
    from jax._src import debugging, effects as jeffects
    from jaxcolo.codec import memo
    from jaxcolo.export import effects as export_effects
    monkeypatch.setattr(memo, "_enabled", False)  # really decode each time
    module = types.ModuleType("effects_race_lib")
    monkeypatch.setitem(sys.modules, module.__name__, module)

    class LibEffect(jeffects.Effect):
        pass
    LibEffect.__module__ = module.__name__
    module.LibEffect, module.lib_effect = LibEffect, LibEffect()
    jaxcolo.register_effect(LibEffect)
    data = jaxcolo.serialize([debugging.debug_effect, module.lib_effect])
    group = jeffects.lowerable_effects._effect_types
    stop = threading.Event()

    def register_some():
        added, i = [], 0
        while not stop.is_set():
            added.append(type(f"Lib{i}", (jeffects.Effect,), {}))
            jeffects.lowerable_effects.add_type(added[-1])
            setattr(module, f"g{i % 50}", i)  # globals come and go
            if i % 50 == 49:
                group.difference_update(added)
                added.clear()
                for k in range(50):
                    delattr(module, f"g{k}")
            i += 1
        group.difference_update(added)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # (makes a race in the loops likely)
    thread = threading.Thread(target=register_some)
    thread.start()
    try:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            assert jaxcolo.deserialize(data) == [debugging.debug_effect,
                                                 module.lib_effect]
            jaxcolo.serialize([debugging.debug_effect])
            assert str(type(debugging.debug_effect)) in \
                export_effects._effect_types()
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old)


def test_fast_builder_is_byte_identical_to_flatbuffers(monkeypatch):
    import flatbuffers
    from jaxcolo.codec import memo, spec_tree
    monkeypatch.setattr(memo, "_enabled", False)  # really encode twice
    for obj in (corpus.everything(), corpus.meshes(), corpus.avals(),
                corpus.pytrees(), [np.dtype("f4")] * 3, None):
        fast = jaxcolo.serialize(obj)
        monkeypatch.setattr(spec_tree, "BUILDER", flatbuffers.Builder)
        reference = jaxcolo.serialize(obj)
        monkeypatch.setattr(spec_tree, "BUILDER", spec_tree.FastBuilder)
        assert fast == reference


def test_generated_readers_read_our_payloads():
    """The flatc-generated accessors agree with jaxcolo's checked reader."""
    from jaxcolo_fb import SpecTree
    mesh = corpus.meshes()[1]
    data = jaxcolo.serialize([mesh, jax.ShapeDtypeStruct((3, 5), np.int8)],
                             compress=False)
    root = SpecTree.GetRootAs(data[16:], 0)
    m = root.Meshes(0)
    assert [m.DeviceIds(i) for i in range(m.DeviceIdsLength())] == \
        mesh.device_ids.ravel().tolist()
    assert [m.AxisNames(i).decode() for i in range(m.AxisNamesLength())] == \
        ["x", "y"]
    arrays = root.Arrays()
    assert arrays.RanksAsNumpy().tolist() == [2]
    assert arrays.DimsAsNumpy().tolist() == [3, 5]
    assert root.LeafKindsAsNumpy().tolist() == [3, 0]


def test_payload_memos_change_nothing(monkeypatch):
    from jaxcolo.codec import memo
    tree = corpus.everything()
    data = jaxcolo.serialize(tree)
    first, second = jaxcolo.deserialize(data), jaxcolo.deserialize(data)
    assert first == second == tree
    assert first is not second and first["pytrees"] is not second["pytrees"]
    first["avals"].append("mutated")  # a caller's edit never reaches the memo
    assert jaxcolo.deserialize(data) == tree
    assert jaxcolo.serialize(tree) == data  # encode memo hit: same bytes
    monkeypatch.setattr(memo, "_enabled", False)
    assert jaxcolo.serialize(tree) == data  # and the same without the memos
    assert jaxcolo.deserialize(data) == tree


def _module_with_namedtuple(name: str, type_name: str = "Pair"):
    """A new imported module ``name`` defining namedtuple ``type_name``."""
    import collections
    import sys
    import types
    module = types.ModuleType(name)
    setattr(module, type_name, collections.namedtuple(
        type_name, ["a", "b"], module=name))
    sys.modules[name] = module
    return module


def test_memos_follow_later_namedtuple_registration():
    """A namedtuple written by its module name, then registered with
    jax.export under another name, is written under that name (the encode
    memo and the flattened-tree cache held the old one)."""
    from jax import export
    module = _module_with_namedtuple("jaxcolo_test_late_registration")
    s = jax.ShapeDtypeStruct((2,), np.float32)
    before = jaxcolo.serialize(module.Pair(s, None), compress=False)
    assert b"jaxcolo_test_late_registration:Pair" in before
    export.register_namedtuple_serialization(
        module.Pair, serialized_name="tests.LatePair")
    for _ in range(2):  # a new tree, then the same leaves again
        after = jaxcolo.serialize(module.Pair(s, None), compress=False)
        assert b"tests.LatePair" in after and b"test_late_registration" \
            not in after
    assert jaxcolo.deserialize(after) == module.Pair(s, None)


def test_memos_follow_a_redefined_namedtuple():
    """A module that rebinds a namedtuple's name (a re-run notebook cell,
    importlib.reload): decodes give the class the name refers to now, and
    encoding an instance of the old class fails as it would uncached."""
    import collections
    name = "jaxcolo_test_redefined_namedtuple"
    module = _module_with_namedtuple(name, "Point")
    s = jax.ShapeDtypeStruct((2,), np.float32)
    old = module.Point(s, None)
    data = jaxcolo.serialize(old)
    assert type(jaxcolo.deserialize(data)) is module.Point  # (memoized)
    module.Point = collections.namedtuple("Point", ["a", "b"], module=name)
    back = jaxcolo.deserialize(data)
    assert type(back) is module.Point and back == module.Point(s, None)
    assert jax.tree_util.tree_structure(back) == \
        jax.tree_util.tree_structure(module.Point(s, None))
    with pytest.raises(jaxcolo.EncodeError, match="shadowed"):
        jaxcolo.serialize(old)


def test_encode_memo_notes_scopes_for_old_readers():
    """Payloads for readers before 6 name a scope by its constraints alone:
    the reader takes the scope latest encoded with them.  Encoding the same
    tree again must note its scope again (it was a memo hit that did not)."""
    from jax import export
    x = jax.ShapeDtypeStruct(export.symbolic_shape("b, 4"), np.float32)
    y = jax.ShapeDtypeStruct(export.symbolic_shape("n"), np.float32)
    jaxcolo.serialize(x, version=5)
    jaxcolo.serialize(y, version=5)  # another scope, equal (no) constraints
    back = jaxcolo.deserialize(jaxcolo.serialize(x, version=5))
    assert back == x
    assert back.shape[0].scope is x.shape[0].scope
    assert str(back.shape[0] + x.shape[0]) == "2*b"


def test_uniform_leaves_path_matches_general_loop(monkeypatch):
    """Trees of ShapeDtypeStructs only take intern_leaves' C-level path; it
    writes the same bytes as the per-leaf loop and names a failing leaf."""
    from jaxcolo.codec import memo, spec_tree
    monkeypatch.setattr(memo, "_enabled", False)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    shardings = [NamedSharding(mesh, P("x")), NamedSharding(mesh, P()), None]
    leaves = [jax.ShapeDtypeStruct((8, i % 4 + 1), [np.float32, np.int8][i % 2],
                                   sharding=shardings[i % 3])
              for i in range(40)]
    tree = {"a": leaves[:25], "b": tuple(leaves[25:])}
    fast = jaxcolo.serialize(tree)
    monkeypatch.setattr(spec_tree, "_intern_uniform_leaves",
                        lambda *a: None)
    assert jaxcolo.serialize(tree) == fast
    monkeypatch.undo()
    assert jaxcolo.deserialize(fast) == tree
    bad = list(leaves)
    bad[7] = jax.ShapeDtypeStruct((2,), np.dtype(object))
    with pytest.raises(jaxcolo.EncodeError, match=r"dtype.*at \$\[7\]\.dtype"):
        jaxcolo.serialize(bad)


def test_namedtuple_custom_nodes_need_a_version_8_reader():
    """Readers before 8 rebuild such a node as a plain namedtuple of its
    children (silently wrong), so payloads holding one say reader 8, and
    writing one at version 7 is an EncodeError."""
    from jaxcolo.checking import check_readable
    a = jax.ShapeDtypeStruct((1,), np.float32)
    for obj in ([corpus.Swapped(a, None)],
                jax.tree_util.tree_structure(corpus.Tagged(1, "t"))):
        data = jaxcolo.serialize(obj)
        assert jaxcolo.inspect(data)["min_reader_version"] == 8
        assert check_readable(data, 8)[0] and not check_readable(data, 7)[0]
        with pytest.raises(jaxcolo.EncodeError, match=r"namedtuple_custom_node"
                           r" needs schema version 8, but version 7"):
            jaxcolo.serialize(obj, version=7)
    assert jaxcolo.inspect(jaxcolo.serialize([a]))["min_reader_version"] == 1


def test_namedtuples_registered_as_custom_nodes_round_trip():
    """They were written as plain namedtuples (all fields, no auxdata):
    refused by our reader, or read back with the children swapped."""
    a = jax.ShapeDtypeStruct((1,), np.float32)
    b = jax.ShapeDtypeStruct((2,), np.int8)
    Tagged, Swapped = corpus.Tagged, corpus.Swapped
    for obj in (Tagged(a, "hello"), Swapped(a, b),
                {"t": Tagged(Swapped(a, [b, None]), "outer")},
                [Swapped(Tagged(a, "in"), (b, Tagged(None, "n"))), a]):
        back = roundtrip(obj)
        assert back == obj
        td = jax.tree_util.tree_structure(obj)
        assert jax.tree_util.tree_structure(back) == td
        back_td = roundtrip(td)
        assert back_td == td and str(back_td) == str(td)


def _corpus_items():
    for group, items in corpus.everything().items():
        for i, obj in enumerate(items):
            yield f"{group}[{i}]", obj


def test_the_whole_corpus_at_the_oldest_readable_version():
    """serialize(x, version=MIN_READABLE_VERSION) of every corpus item is
    read back equal, or is an EncodeError naming the newer feature it needs
    (never a silent drop)."""
    from jaxcolo import versions
    written = refused = 0
    for where, obj in _corpus_items():
        try:
            data = jaxcolo.serialize(obj,
                                     version=jaxcolo.MIN_READABLE_VERSION)
        except jaxcolo.EncodeError as e:
            feature = str(e).split(" needs schema version ")[0]
            assert feature in versions.FEATURE_SINCE, (where, e)
            assert versions.FEATURE_SINCE[feature] > \
                jaxcolo.MIN_READABLE_VERSION, (where, e)
            refused += 1
            continue
        assert jaxcolo.inspect(data)["writer_version"] == \
            jaxcolo.MIN_READABLE_VERSION
        assert jaxcolo.deserialize(data) == obj, where
        written += 1
    assert written > 100 and refused >= 1, (written, refused)


def test_names_that_are_not_text_and_repeated_devices_are_encode_errors():
    """JAX takes any hashable as an axis name: an int name was written as
    that many NUL bytes (a different mesh, silently; 10 MB for 10**7), a
    tuple name leaked TypeError.  JAX also takes a device twice in a mesh
    or device list: the writer wrote what its own reader refuses."""
    from jax._src import core, sharding_impls
    from jax.sharding import AbstractMesh, Mesh, PartitionSpec as P
    from jax._src.lib import xla_client as xc
    d = jax.devices()
    for obj in (Mesh(np.array(d).reshape(2, 4), (0, 1)),
                Mesh(np.array(d[:2]), (("a", "b"),)),
                AbstractMesh((2, 4), (0, 1)),
                P(None, reduced={1}),
                jax.ShapeDtypeStruct((2,), np.float32,
                                     manual_axis_type=core.ManualAxisType(
                                         varying=frozenset({3})))):
        with pytest.raises(jaxcolo.EncodeError, match="is not a str"):
            jaxcolo.serialize([obj])
    for obj in (Mesh(np.array([d[0], d[0]]), ("x",)),
                sharding_impls.GSPMDSharding((d[0], d[0]),
                                             xc.HloSharding.replicate()),
                xc.DeviceList((d[0], d[0]))):
        with pytest.raises(jaxcolo.EncodeError, match="duplicate device"):
            jaxcolo.serialize([obj])
