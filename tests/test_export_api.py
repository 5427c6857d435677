"""jaxcolo.export: API contracts, errors with paths, CLI, the export bundle."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcolo
import jaxcolo.export as je
from jaxcolo.export import detect
from jaxcolo.export.layouts import EXPORTED as L
from jaxcolo.wire import Buffer
from tests import corpus
from tests import golden_setup  # noqa: F401  (registers the golden types)

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "jax_export")


def _golden(release, case):
    return open(os.path.join(GOLDEN, f"jax-{release}", f"{case}.bin"),
                "rb").read()


@pytest.fixture(scope="module")
def poly_exp():
    """Shape-polymorphic, 2 vjp orders, dict/list pytree."""
    def f(d):
        return {"y": [jnp.sin(d["x"]) * 2, d["x"].sum()]}
    spec = {"x": jax.ShapeDtypeStruct(
        jax.export.symbolic_shape("b, 2*b"), jnp.float32)}
    return jax.export.export(jax.jit(f))(spec)


def test_round_trip_poly_and_vjp_chain(poly_exp):
    # exp.vjp() re-lowers on each call (JAX's own bytes differ run to run),
    # so byte identity is checked on a deserialized Exported.
    fixed = jax.export.deserialize(poly_exp.serialize(vjp_order=2))
    data = je.serialize(fixed, vjp_order=2)
    assert bytes(data) == bytes(fixed.serialize(vjp_order=2))
    exp = je.deserialize(data)
    assert str(exp.in_avals) == str(poly_exp.in_avals)
    assert exp.in_tree == poly_exp.in_tree
    assert exp.vjp().vjp() is not None and not exp.vjp().vjp().has_vjp()
    x = np.arange(18, dtype=np.float32).reshape(3, 6) / 10
    got = exp.call({"x": x})
    np.testing.assert_allclose(got["y"][0], np.sin(x) * 2, rtol=1e-6)
    assert je.serialization_version(data) == 10  # nothing of v11 used
    assert je.version_range(data) == (10, 11)


def test_every_version_round_trips(poly_exp):
    for v in range(je.MIN_VERSION, je.MAX_VERSION + 1):
        data = je.serialize(poly_exp, vjp_order=1, version=v)
        lo, hi = je.version_range(data)
        assert lo <= v <= hi, v
        assert str(je.deserialize(data).in_avals) == str(poly_exp.in_avals)


def test_an_abstract_device_without_platform_is_not_from_version_11():
    """Version-11 writers always write an abstract device's platform, so a
    payload with one without it was written by version 10: its range was
    reported as (10, 11) and inspect named 0.10.1 and 0.10.2 as writers."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    spec = jax.ShapeDtypeStruct((8, 8), jnp.float32,
                                sharding=NamedSharding(mesh, P("x", "y")))
    exp = jax.export.export(jax.jit(lambda x: x * 2))(spec)
    assert je.version_range(je.serialize(exp, version=10)) == (10, 10)
    assert je.version_range(exp.serialize()) == (11, 11)


def test_version_12_writes_jax_version(poly_exp):
    data = je.serialize(poly_exp, version=12)
    assert detect.scan(data).jax_version == jax.__version__
    assert je.serialization_version(data) == 12
    # jax 0.10.2 ignores the new field.
    assert jax.export.deserialize(data).in_tree == poly_exp.in_tree


@pytest.mark.parametrize("version", [0, 1, 13, None.__class__])
def test_unwritable_versions(poly_exp, version):
    with pytest.raises((jaxcolo.EncodeError, TypeError)):
        je.serialize(poly_exp, version=version)


def test_numpy_integers_are_versions_and_vjp_orders(poly_exp):
    """JAX takes numpy integers for vjp_order; jaxcolo refused them (and
    numpy versions) with an EncodeError/TypeError.  Bools stay refused."""
    data = je.serialize(poly_exp, vjp_order=np.int64(1), version=np.int32(9))
    back = je.deserialize(data)
    assert back.has_vjp() and not back.vjp().has_vjp()
    assert je.serialize(poly_exp, version=np.int64(9)) == \
        je.serialize(poly_exp, version=9)
    spec = jax.ShapeDtypeStruct((2,), np.float32)
    assert jaxcolo.serialize(spec, version=np.int64(1)) == \
        jaxcolo.serialize(spec, version=1)
    with pytest.raises(jaxcolo.EncodeError, match=r"got True"):
        je.serialize(poly_exp, vjp_order=True)
    with pytest.raises(jaxcolo.EncodeError, match=r"got 1\.0"):
        je.serialize(poly_exp, vjp_order=1.0)
    with pytest.raises(TypeError, match="version must be an int"):
        jaxcolo.serialize(spec, version=True)


def test_a_dim_a_reader_refuses_is_not_written():
    """Concrete dims skip the symbolic-text check only while they fit int64:
    a dim of over 1024 bits was written, and jaxcolo's reader refused it
    (the writer must refuse what a reader would)."""
    import dataclasses
    from jax._src import core
    exp = jax.export.export(jax.jit(lambda x: x + 1))(
        jax.ShapeDtypeStruct((3,), np.float32))
    ok = dataclasses.replace(exp, in_avals=(
        core.ShapedArray((2**1023,), np.float32),))
    assert je.deserialize(je.serialize(ok)).in_avals[0].shape == (2**1023,)
    bad = dataclasses.replace(exp, in_avals=(
        core.ShapedArray((2**1024,), np.float32),))
    with pytest.raises(jaxcolo.EncodeError, match=r"in_avals\[0\]"):
        je.serialize(bad)


def test_encode_errors_name_the_field():
    exp = je.deserialize(_golden("0.10.2", "namedtuple_custom"))
    with pytest.raises(jaxcolo.EncodeError,
                       match=r"custom pytree node .* version >= 3 - at "
                             r"\$\.in_tree"):
        je.serialize(exp, version=2)
    exp = je.deserialize(_golden("0.10.2", "memory_space"))
    with pytest.raises(jaxcolo.EncodeError, match=r"in_avals\[0\]"):
        je.serialize(exp, version=4)
    exp = je.deserialize(_golden("0.8.3", "sharded_8dev"))  # HloShardings
    with pytest.raises(jaxcolo.EncodeError, match="HloShardings"):
        je.serialize(exp)
    assert je.serialize(exp, version=8)  # versions with HloShardings work
    with pytest.raises(jaxcolo.EncodeError, match="no vjp"):
        je.serialize(exp, vjp_order=1, version=8)


@pytest.fixture(scope="module")
def fresh_sharded_exp():
    """A 0.10.2 export as jax.export.export makes it: NamedShardings over an
    AbstractMesh with an abstract device, and no HloShardings stored."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    s_in = NamedSharding(mesh, P("x", "y"))
    s_out = NamedSharding(mesh, P(None, "y"))
    f = jax.jit(lambda a, b: (a * 2 + b, a.sum()),
                in_shardings=(s_in, None), out_shardings=(s_out, None))
    exp = jax.export.export(f)(
        jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=s_in),
        jax.ShapeDtypeStruct((8, 16), jnp.float32))
    assert exp.in_shardings_hlo == (None, None)  # the case under test
    assert exp._in_named_shardings[0].mesh.abstract_device is not None
    return exp, mesh


@pytest.mark.parametrize("version", range(2, 13))
def test_fresh_named_shardings_survive_every_version(fresh_sharded_exp,
                                                     version):
    """Older versions get the shardings in their own vocabulary: before 6
    the HloShardings JAX derives from the NamedShardings (they were silently
    written as unspecified), before 8 meshes without their abstract device
    (they were refused), and JAX reads the same shardings back."""
    exp, mesh = fresh_sharded_exp
    data = je.serialize(exp, version=version)
    back = jax.export.deserialize(bytearray(data))
    want = tuple(jax.export.deserialize(exp.serialize()).in_shardings_hlo)
    assert want[0] is not None and want[1] is None
    assert tuple(back.in_shardings_hlo) == want
    assert str(back.out_shardings_hlo[0]) == str(
        exp._out_named_shardings[0]._to_xla_hlo_sharding(2))
    if version >= 6:  # NamedShardings carried; abstract device from v8
        named = back._in_named_shardings[0]
        assert named.spec == exp._in_named_shardings[0].spec
        assert named.mesh.axis_names == ("x", "y")
        assert (named.mesh.abstract_device is not None) == (version >= 8)
    a = np.arange(128, dtype=np.float32).reshape(8, 16)
    b = np.ones((8, 16), np.float32)
    got = back.call(jax.device_put(a, back.in_shardings_jax(mesh)[0]), b)
    np.testing.assert_allclose(got[0], a * 2 + b)
    np.testing.assert_allclose(got[1], a.sum())
    assert str(je.deserialize(data).in_shardings_hlo) == str(want)


# ------------------------------------------------------------- bad input

@pytest.mark.parametrize("data", [b"", b"\0" * 3, b"\xff" * 64, "text", 5,
                                  None])
def test_garbage_is_a_payload_error(data):
    with pytest.raises(jaxcolo.PayloadError):
        je.deserialize(data)
    if isinstance(data, bytes):
        with pytest.raises(jaxcolo.PayloadError):
            je.serialization_version(data)


def test_truncations_are_payload_errors():
    data = _golden("0.9.2", "pytree_io")
    for cut in range(0, len(data), 7):
        with pytest.raises(jaxcolo.PayloadError):
            je.deserialize(data[:cut])


def _vector_start(data, voff):
    t = Buffer(bytes(data)).root()
    return t._vector(voff, 4, "$", "x")[0]


def test_index_out_of_range_names_its_path():
    data = bytearray(_golden("0.10.2", "sharded_8dev"))
    at = _vector_start(data, L.in_avals_idxs)
    data[at:at + 4] = (99).to_bytes(4, "little")
    with pytest.raises(jaxcolo.PayloadError,
                       match=r"reference 99 out of range.*\$\.in_avals_idxs"
                             r"\[0\]"):
        je.deserialize(bytes(data))
    data = bytearray(_golden("0.10.2", "sharded_8dev"))
    at = _vector_start(data, L.in_shardings_idxs)
    data[at:at + 4] = (7).to_bytes(4, "little")
    with pytest.raises(jaxcolo.PayloadError,
                       match=r"\$\.in_shardings_idxs\[0\]"):
        je.deserialize(bytes(data))


def test_unregistered_custom_node_is_a_payload_error():
    data = _golden("0.5.3", "namedtuple_custom")
    from jax._src.export import _export as jexport
    saved = dict(jexport.deserialization_registry)
    jexport.deserialization_registry.clear()
    try:
        with pytest.raises(jaxcolo.PayloadError,
                           match=r"not registered.*\$\.in_tree"):
            je.deserialize(data)
        # Structure-only tools still work.
        assert je.version_range(data) == (3, 4)
        info = jaxcolo.inspect(data)
        assert "content_unavailable" in info
    finally:
        jexport.deserialization_registry.update(saved)


# --------------------------------------------------------- inspect / CLI

def test_inspect_and_check_jax_payload(tmp_path, capsys):
    from jaxcolo.cli import main
    data = _golden("0.10.2", "sharded_8dev")
    info = jaxcolo.inspect(data)
    json.dumps(info)
    assert info["format"] == "jax_export"
    assert info["serialization_version"] == 11
    assert "0.10.2" in info["readable_by_releases"]
    assert 5 in info["not_readable_by"]
    f = tmp_path / "exp.bin"
    f.write_bytes(data)
    assert main(["inspect", str(f)]) == 0
    assert "readable_by_releases" in capsys.readouterr().out
    assert main(["check", str(f), "--reader-version", "8"]) == 0
    assert "readable by JAX serialization version 8 (0.9.2)" in \
        capsys.readouterr().out
    assert main(["check", str(f), "--reader-version", "5"]) == 1
    assert "only HloShardings" in capsys.readouterr().out
    f.write_bytes(_golden("0.4.30", "simple_f32"))
    assert main(["check", str(f), "--reader-version", "2"]) == 0
    f.write_bytes(b"\x01" * 40)
    assert main(["inspect", str(f)]) == 2


def test_readers_of_old_versions():
    v = {r["version"]: r for r in je.readable_by(
        _golden("0.6.2", "prng_key"))}
    assert not v[3]["ok"] and v[4]["ok"] and v[11]["ok"]
    v = {r["version"]: r for r in je.readable_by(
        _golden("0.10.2", "simple_f32"))}
    assert not v[4]["ok"] and v[5]["ok"]


def test_readers_refusing_the_removed_shape_assertions_check():
    """0.4.30 wrote a shape_assertions disabled check; releases up to 0.9.2
    read it (as a no-op), 0.10.0 on raise on it."""
    data = _golden("0.4.30", "disabled_checks_shape_assertions")
    v = {r["version"]: r for r in je.readable_by(data)}
    assert v[8]["ok"] and not v[10]["ok"] and not v[11]["ok"]
    assert "shape_assertions" in v[11]["reason"]
    info = jaxcolo.inspect(data)
    assert "0.9.2" in info["readable_by_releases"]
    assert "0.10.0" not in info["readable_by_releases"]


def test_version_3_releases_know_different_dtypes():
    """float8_e8m0fnu (enum 25) came in 0.5.1 without a version bump:
    0.4.35 .. 0.5.0 are version-3 readers that cannot read it."""
    exp = jax.export.export(jax.jit(lambda x: x))(
        jax.ShapeDtypeStruct((4,), jnp.float8_e8m0fnu))
    data = je.serialize(exp, version=3)
    v3 = {r["version"]: r for r in je.readable_by(data)}[3]
    assert v3["ok"] and v3["releases"] == ["0.5.1", "0.5.2", "0.5.3"]
    assert set(v3["releases_failing"]) == {"0.4.35", "0.4.36", "0.4.37",
                                           "0.4.38", "0.5.0"}
    from jaxcolo.checking import check_readable
    ok, why = check_readable(bytes(data), 3)
    assert ok and "(0.5.1, 0.5.2, 0.5.3)" in why and "0.4.38 (dtype" in why
    assert "0.4.38" not in jaxcolo.inspect(bytes(data))["readable_by_releases"]


# ------------------------------------------------------------------ bundle

def test_bundle_round_trip(poly_exp):
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    specs = {"in": jax.ShapeDtypeStruct((8, 4), jnp.float32,
                                        sharding=jax.NamedSharding(
                                            mesh, jax.P("x")))}
    data = je.bundle(poly_exp, specs, vjp_order=1)
    assert data[:4] == b"JXCO"
    b = jaxcolo.deserialize(data)
    assert isinstance(b, je.ExportBundle)
    assert b.specs == specs
    assert b.exported.in_tree == poly_exp.in_tree and b.exported.has_vjp()
    assert je.unbundle(data).specs == specs
    info = jaxcolo.inspect(data)
    assert info["root_kind"] == "export_bundle"
    assert info["min_reader_version"] == 2
    assert info["exported"]["serialization_version"] == 10
    old = je.bundle(poly_exp, None, version=3)
    assert jaxcolo.deserialize(old).specs is None
    assert je.serialization_version(je.open_bundle(old)[0]) == 2


def test_bundle_damage_is_detected(poly_exp):
    data = bytearray(je.bundle(poly_exp))
    data[len(data) // 2] ^= 0x40  # inside the StableHLO blob
    with pytest.raises(jaxcolo.PayloadError, match="checksum"):
        jaxcolo.deserialize(bytes(data))


def test_export_without_avals_is_detected():
    """A function with no inputs and no outputs has no aval to tell memory
    spaces by: detection, inspect, check and bundle still work."""
    exp = jax.export.export(jax.jit(lambda: None))()
    data = exp.serialize()
    assert je.serialization_version(data) == 10  # like any 0.10.2 payload
    assert jaxcolo.inspect(data)["serialization_version"] == 10
    assert jaxcolo.deserialize(je.bundle(exp))[0].fun_name == "<lambda>"


def test_v5_payload_with_more_devices_than_a_short(poly_exp):
    """jaxcolo's version-5 writer leaves nr_devices_short out when the count
    does not fit in it; detection still says version 5."""
    import dataclasses
    exp = dataclasses.replace(poly_exp, nr_devices=40000)
    data = je.serialize(exp, version=5)
    assert je.serialization_version(data) == 5
    assert je.deserialize(data).nr_devices == 40000


@pytest.mark.parametrize("legacy", ["ExportedAddOutAvals",
                                    "ExportedAddInShardings",
                                    "ExportedAddOutShardings"])
def test_missing_legacy_vectors_need_a_version_10_reader(monkeypatch, legacy):
    """Without one of the per-entry vectors (JAX plans to stop writing them),
    readers before version 10, which have no *_idxs fields, cannot read it."""
    from jaxcolo.checking import check_readable
    from jaxcolo.export import encode
    exp = jax.export.export(jax.jit(lambda x: x * 2))(
        jax.ShapeDtypeStruct((4,), np.float32))
    monkeypatch.setattr(encode.fb, legacy, lambda builder, off: None)
    data = bytes(je.serialize(exp))
    monkeypatch.undo()
    ok, reason = check_readable(data, 8)
    assert not ok and "per-entry avals/shardings are absent" in reason
    assert check_readable(data, 11)[0]


def test_cli_refuses_a_fifo_without_waiting(tmp_path, capsys):
    from jaxcolo.cli import main
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert main(["inspect", str(fifo)]) == 2
    assert "not a regular file" in capsys.readouterr().err
    assert main(["check", str(fifo), "--reader-version", "5"]) == 2


@pytest.mark.parametrize("change,reason", [
    (dict(platforms=(3,)), r"expected a string, got int"),
    (dict(fun_name="f\udc80"), r"UnicodeEncodeError"),
    (dict(calling_convention_version=70000), r"number <= 65535"),
    (dict(nr_devices=2**32), r"number <= 4294967295"),
])
def test_fields_of_wrong_type_or_range_are_encode_errors(change, reason):
    """Never silently written (bytes(3) would be three NULs), never a raw
    struct/unicode/type error."""
    import dataclasses
    exp = jax.export.export(jax.jit(lambda x: x + 1))(
        jax.ShapeDtypeStruct((4,), np.float32))
    with pytest.raises(jaxcolo.EncodeError, match=reason):
        je.serialize(dataclasses.replace(exp, **change))


def test_foreign_opsharding_keeps_shard_groups():
    """HloShardings in JAX payloads (versions <= 8) keep shard_as/shard_like
    groups as JAX reads them; a shard group type outside the enum is a
    PayloadError."""
    from jax._src.lib import xla_client as xc
    from jaxcolo.codec import opsharding
    op = corpus.shard_group_opsharding(7)
    raw = op.SerializeToString()
    got = opsharding.parse_foreign(raw, "$.in_shardings[0]")
    assert got == xc.HloSharding.from_proto(op) and "shard_as 7" in str(got)
    with pytest.raises(jaxcolo.PayloadError, match=r"shard group.* - at "
                       r"\$\.in_shardings\[0\]"):
        opsharding.parse_foreign(raw + bytes([13 << 3, 9]),
                                 "$.in_shardings[0]")


@pytest.mark.parametrize("device", [("cpu", "tpu"), ("Weird accelerator",
                                                     "cpu")])
def test_check_agrees_with_the_writer_on_device_platforms(fresh_sharded_exp,
                                                          device):
    """An abstract device whose platform its kind does not give: the writer
    refuses versions that infer platforms, and check says those readers
    cannot read the version-11 payload."""
    import dataclasses
    from jax._src import mesh as jmesh
    from jax.sharding import NamedSharding
    from jaxcolo.checking import check_readable
    exp, _ = fresh_sharded_exp
    dev = jmesh.AbstractDevice(device[0], None, device[1])

    def conv(s):
        if s is None:
            return None
        am = s.mesh.abstract_mesh
        return NamedSharding(jmesh.AbstractMesh(
            am.axis_sizes, am.axis_names, am.axis_types, abstract_device=dev),
            s.spec, memory_kind=s.memory_kind)
    odd = dataclasses.replace(
        exp, _in_named_shardings=tuple(map(conv, exp._in_named_shardings)),
        _out_named_shardings=tuple(map(conv, exp._out_named_shardings)))
    data = bytes(je.serialize(odd))
    for version in (8, 10):
        with pytest.raises(jaxcolo.EncodeError, match="needs serialization "
                           "version >= 11"):
            je.serialize(odd, version=version)
        ok, reason = check_readable(data, version)
        assert not ok and "platform differs" in reason
    assert check_readable(data, 11)[0]
    assert check_readable(bytes(je.serialize(exp)), 8)[0]


def test_deep_and_wide_trees_read_back_as_jax_reads_them():
    # rebuilt from objects in one flatten (linear in the nodes), equal to
    # what JAX's own reader builds: nesting, Nones, dict key order, lists
    def f(tree):
        return tree[0]["b"][1] * 2
    arg = [None, jax.ShapeDtypeStruct((2,), jnp.float32)]
    tree = ({"b": arg, "a": [None] * 300, "c": ()},)
    for _ in range(60):
        tree = (tree,)
    exp = jax.export.export(jax.jit(lambda t: f(_unwrap(t, 60))))(tree)
    data = je.serialize(exp)
    ours, theirs = je.deserialize(data), jax.export.deserialize(data)
    assert ours.in_tree == theirs.in_tree == exp.in_tree
    assert ours.out_tree == theirs.out_tree


def _unwrap(t, n):
    for _ in range(n):
        t = t[0]
    return t


def _exported_on_abstract_mesh(n_axes: int):
    """An Exported whose argument and result are sharded over an abstract
    mesh of ``n_axes`` axes of size 1, every axis named by the spec."""
    import dataclasses
    from jax._src import core, mesh as jmesh
    from jax._src.export import _export as jx
    base = jax.export.export(jax.jit(lambda x: x))(
        jax.ShapeDtypeStruct((4,), jnp.float32))
    names = tuple(f"a{i}" for i in range(n_axes))
    s = jax.NamedSharding(jmesh.AbstractMesh((1,) * n_axes, names),
                          jax.P(names))
    a = core.ShapedArray((4,), jnp.float32)
    h = jx.named_to_hlo_sharding(s, a)
    sharded = core.update_aval_with_sharding(a, s)
    return dataclasses.replace(
        base, in_avals=(sharded,), out_avals=(sharded,),
        in_shardings_hlo=(h,), out_shardings_hlo=(h,),
        _in_named_shardings=(s,), _out_named_shardings=(s,))


def test_meshes_of_too_many_axes_are_refused_both_ways():
    # building the NamedSharding costs JAX axes squared
    exp = _exported_on_abstract_mesh(300)
    with pytest.raises(jaxcolo.EncodeError, match=r"300 mesh axes, more than "
                       r"256 - at \$\..*\.axis_names"):
        je.serialize(exp)
    with pytest.raises(jaxcolo.PayloadError, match=r"300 mesh axes, more than "
                       r"256 - at \$\..*\.axis_names"):
        je.deserialize(exp.serialize())  # JAX's own writer
    ok = _exported_on_abstract_mesh(64)
    data = je.serialize(ok)
    assert bytes(data) == bytes(ok.serialize())
    assert je.deserialize(data).in_shardings_hlo == ok.in_shardings_hlo


def test_overlapping_strings_count_against_the_read_budget():
    # n entries of a string vector each start 4 bytes further into one run
    # whose every word reads as the length k: n * k characters from ~4n bytes
    import struct
    from jaxcolo.export.layouts import EXPORTED
    k = 0x0808
    n = k // 4
    base = bytearray(jax.export.export(jax.jit(lambda x: x * 2))(
        jax.ShapeDtypeStruct((3,), jnp.float32)).serialize())
    while len(base) % 4:
        base.append(0)
    t = Buffer(bytes(base)).root()
    at = t.pos + struct.unpack_from("<H", base, t.vt + EXPORTED.platforms)[0]
    vec = len(base)
    run = vec + 4 + 4 * n
    struct.pack_into("<I", base, at, vec - at)
    base += struct.pack("<I", n)
    for j in range(n):
        base += struct.pack("<I", run + 4 * j - (vec + 4 + 4 * j))
    base += struct.pack("<I", k) * (n + k // 4 + 2)
    with pytest.raises(jaxcolo.PayloadError, match=r"strings decoded are out "
                       r"of proportion.* - at \$\.platforms\[\d+\]"):
        je.deserialize(bytes(base))


def test_symbolic_shapes_a_reader_would_refuse_are_not_written():
    """Nested min/max dims whose parse costs less than the trial limit each
    but more than a reader's budget for the payload in all were written
    (byte for byte as JAX), then refused by jaxcolo.export.deserialize and
    unbundle; the writer refuses them now, and what it writes reads."""
    from jax._src import core

    def exported(n):
        syms = jax.export.symbolic_shape(",".join(f"s{i}" for i in range(n)))

        def f(*xs):
            d = xs[0].shape[0]
            for i, x in enumerate(xs[1:]):
                d = core.max_dim(d, x.shape[0]) if i % 2 else \
                    core.min_dim(d + 1, x.shape[0])
            return jnp.zeros((d,))
        return jax.export.export(jax.jit(f))(
            *[jax.ShapeDtypeStruct((s,), jnp.float32) for s in syms])

    small = exported(6)
    back = je.deserialize(je.serialize(small))
    assert str(back.out_avals) == str(small.out_avals)
    big = exported(12)
    for write in (je.serialize, je.bundle):
        with pytest.raises(jaxcolo.EncodeError, match=r"the symbolic shapes "
                           r"cost \d+ parse units, more than a reader allows "
                           r"a \d+-byte payload .* - at \$$"):
            write(big)


def test_meshes_the_reader_refuses_are_not_written():
    """An abstract mesh of more devices than the reader takes (2^24) was
    written, then refused by jaxcolo.export.deserialize."""
    from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
    m = AbstractMesh((4096, 4097), ("a", "b"))
    s = NamedSharding(m, P("a"))
    exp = jax.export.export(jax.jit(lambda x: x, in_shardings=s,
                                    out_shardings=s))(
        jax.ShapeDtypeStruct((8192,), np.float32, sharding=s))
    with pytest.raises(jaxcolo.EncodeError, match=r"make more than 16777216 "
                       r"devices - at \$\.in_shardings\[0\]"):
        je.serialize(exp)


def test_trees_as_deep_as_jax_writes_read_back():
    """JAX's own writer goes about 330 levels deep; jaxcolo refused past
    256 both ways.  Deeper than its own limit is refused, cleanly."""
    def nested(depth):
        arg = jax.ShapeDtypeStruct((2,), jnp.float32)
        for _ in range(depth):
            arg = (arg,)
        return arg
    exp = jax.export.export(jax.jit(lambda t: _unwrap(t, 290) * 2))(
        nested(290))  # (JAX's writer needs the stack a test has left)
    data = exp.serialize()
    assert je.deserialize(data).in_tree == exp.in_tree
    assert bytes(je.serialize(exp)) == bytes(data)
    deep = jax.export.export(jax.jit(lambda t: _unwrap(t, 401) * 2))(
        nested(401))
    with pytest.raises(jaxcolo.EncodeError, match=r"deeper than 400 - at "
                       r"\$\.in_tree"):
        je.serialize(deep)


def test_in_tree_that_is_no_args_kwargs_pair_is_a_payload_error():
    """One byte (the in_tree root's kind) turned JAX's bytes into an
    Exported whose call raised IndexError inside JAX."""
    from jaxcolo.export.layouts import TREE as LT
    exp = jax.export.export(jax.jit(lambda a, b: a + b))(jnp.ones(3),
                                                         jnp.ones(3))
    data = bytearray(exp.serialize())
    tree = Buffer(bytes(data)).root().table(L.in_tree, "$", "in_tree")
    at = tree._field(LT.kind, 1, "$", "kind")
    assert data[at] == 2  # tuple
    data[at] = 3  # list
    with pytest.raises(jaxcolo.PayloadError, match=r"not that of an \(args "
                       r"tuple, kwargs dict\) pair - at \$\.in_tree$"):
        je.deserialize(bytes(data))


def test_named_shardings_among_hlo_shardings_are_a_payload_error():
    """A named in-sharding beside HloSharding out-shardings reached JAX as
    an 'HloSharding' (exp.call raised AttributeError)."""
    import dataclasses
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from jax._src.export._export import named_to_hlo_sharding
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    s = NamedSharding(mesh, P("x"))
    exp = jax.export.export(jax.jit(lambda x: x * 2, in_shardings=s,
                                    out_shardings=s))(
        jax.ShapeDtypeStruct((8,), jnp.float32, sharding=s))
    hlo = named_to_hlo_sharding(exp._in_named_shardings[0], exp.in_avals[0])
    mixed = je.serialize(dataclasses.replace(
        exp, _out_named_shardings=(None,), out_shardings_hlo=(hlo,)),
        version=6)
    with pytest.raises(jaxcolo.PayloadError, match=r"a named sharding in an "
                       r"Exported whose other shardings are HloShardings .* "
                       r"- at \$\.in_shardings\[0\]$"):
        je.deserialize(mixed)


def test_effect_types_sharing_a_name_read_back_as_jax_reads_them():
    """Of two lowerable effect types with one name, JAX's reader returns
    the first it meets; jaxcolo returned the last."""
    import dataclasses
    from jax._src import effects

    def make(tag):
        class E(effects.Effect):
            TAG = tag

            def __eq__(self, other):
                return type(other) is type(self)

            def __hash__(self):
                return hash(type(self))
        effects.lowerable_effects.add_type(E)
        return E
    kinds = [make(1), make(2)]
    base = jax.export.export(jax.jit(lambda x: x))(jnp.ones(3))
    try:
        for E in kinds:
            data = dataclasses.replace(base, unordered_effects=(E(),)) \
                .serialize()
            theirs = jax.export.deserialize(data).unordered_effects[0]
            assert type(je.deserialize(data).unordered_effects[0]) is \
                type(theirs)
    finally:
        for E in kinds:
            effects.lowerable_effects._effect_types.discard(E)


def test_hlo_shardings_the_reader_refuses_are_not_written():
    """At versions <= 5 (HloSharding protos only) a mesh of more than 2^20
    devices was written, then refused by jaxcolo.export.deserialize."""
    from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
    m = AbstractMesh((2048, 1024), ("a", "b"))
    s = NamedSharding(m, P("a", "b"))
    exp = jax.export.export(jax.jit(lambda x: x, in_shardings=s,
                                    out_shardings=s))(
        jax.ShapeDtypeStruct((2048, 1024), np.float32, sharding=s))
    with pytest.raises(jaxcolo.EncodeError, match=r"cannot be read back: "
                       r"tile assignment dimensions \[2048, 1024\] make more "
                       r"than 1048576 tiles - at \$\.in_shardings\[0\]\."
                       r"hlo_sharding_proto$"):
        je.serialize(exp, version=5)
    data = je.serialize(exp)
    assert je.deserialize(data).in_shardings_hlo == \
        jax.export.deserialize(data).in_shardings_hlo


def _constrained_export():
    a, b = jax.export.symbolic_shape("a, b", constraints=("a >= b",))

    def f(x, y, w):
        return x.sum(0) + y[:, 0].sum() * w, x * 2.0
    exp = jax.export.export(jax.jit(f))(
        jax.ShapeDtypeStruct((a, b), np.float32),
        jax.ShapeDtypeStruct((b, 2), np.float32), 1.0)
    return exp, a, b


def test_a_bundle_keeps_what_jax_format_drops():
    """JAX's format drops the constraints of an Exported's symbolic scope
    and its avals' weak types (jax.export too): a bundled Exported came
    back without them, in a scope of its own beside the bundled specs'."""
    exp, a, b = _constrained_export()
    specs = {"x": jax.ShapeDtypeStruct((a, b), np.float32)}
    data = je.bundle(exp, specs)
    assert jaxcolo.inspect(data)["min_reader_version"] == 2  # (skipped by
    back = je.unbundle(data)                                  # older readers)
    got = back.exported
    x0, x1 = got.in_avals[0].shape
    assert x0 >= x1  # inconclusive without the constraint
    assert [v.weak_type for v in got.in_avals] == \
        [v.weak_type for v in exp.in_avals] == [False, False, True]
    assert back.specs["x"].shape[0] - x0 == 0  # one scope with the specs
    plain = je.deserialize(exp.serialize())
    with pytest.raises(Exception, match="Symbolic dimension comparison"):
        plain.in_avals[0].shape[0] >= plain.in_avals[0].shape[1]
    x, y = np.ones((5, 3), np.float32), np.ones((3, 2), np.float32)
    for a_, b_ in zip(got.call(x, y, 2.0), exp.call(x, y, 2.0)):
        np.testing.assert_array_equal(a_, b_)
    assert je.open_bundle(data)[0] == exp.serialize()  # JAX's own bytes
    # nothing dropped: the field is left out, the bundle is as before
    simple = jax.export.export(jax.jit(lambda v: v + 1))(
        jax.ShapeDtypeStruct((3,), np.float32))
    assert "exported_avals" not in jaxcolo.inspect(je.bundle(simple))


def test_exported_avals_that_do_not_match_are_a_payload_error(monkeypatch):
    import importlib
    bundle_mod = importlib.import_module("jaxcolo.export.bundle")
    exp, a, b = _constrained_export()
    other = jaxcolo.serialize(((jax.core.ShapedArray((a, 3), np.float32),
                                jax.core.ShapedArray((b, 2), np.float32),
                                jax.core.ShapedArray((), np.float32, True)),
                               tuple(exp.out_avals)))
    monkeypatch.setattr(bundle_mod, "_exported_avals", lambda e, w: other)
    data = je.bundle(exp)
    with pytest.raises(jaxcolo.PayloadError, match=r"exported_avals are not "
                       r"the Exported's avals - at \$\.exported_avals$"):
        je.unbundle(data)
    from jaxcolo.checking import check_readable
    assert not check_readable(data, jaxcolo.SCHEMA_VERSION)[0]


def test_deep_trees_jax_writes_are_checked_inspected_and_bundled():
    """The depth limit was raised for the reader only: version_range,
    check and inspect refused a 260-deep tree deserialize read, and
    bundle() raised a PayloadError."""
    from jaxcolo.checking import check_readable
    arg = jax.ShapeDtypeStruct((2,), jnp.float32)
    for _ in range(260):
        arg = [arg]
    exp = jax.export.export(jax.jit(lambda t: t))(arg)
    data = exp.serialize()
    assert je.version_range(data)[1] >= 10
    assert check_readable(data, 11)[0]
    assert jaxcolo.inspect(data)["format"] == "jax_export"
    assert je.unbundle(je.bundle(exp)).exported.in_tree == exp.in_tree


def test_dims_past_the_model_only_together_need_reader_9():
    """Readers parse an aval's dims as one text; the writer judged each dim
    alone, so two dims of 257 terms each were stamped readable by 2 (a v7
    reader refuses them: more than 512 terms)."""
    import dataclasses
    from jaxcolo.codec.parse_cost import parse_cost
    names = jax.export.symbolic_shape(",".join(f"a{i}" for i in range(258)))
    d1, d2 = sum(names[:257]), sum(names[1:])
    base = jax.export.export(jax.jit(lambda x: x))(
        jax.ShapeDtypeStruct((names[0],), jnp.float32))
    exp = dataclasses.replace(base, out_avals=(
        jax.core.ShapedArray((d1, d2), jnp.float32),))
    dims = [str(d1), str(d2)]
    assert not any(parse_cost(d).counted for d in dims)
    assert parse_cost(",".join(dims)).counted
    assert jaxcolo.inspect(je.bundle(exp))["min_reader_version"] == 9


def test_hlo_tile_limit_applies_only_where_readers_read_the_proto():
    """At versions 6..8 the named sharding is written beside the
    HloSharding and readers read it: the tile limit refused exports that
    read back fine there."""
    from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
    m = AbstractMesh((2048, 1024), ("a", "b"))
    s = NamedSharding(m, P("a", "b"))
    exp = jax.export.export(jax.jit(lambda x: x, in_shardings=s,
                                    out_shardings=s))(
        jax.ShapeDtypeStruct((2048, 1024), np.float32, sharding=s))
    for version in (6, 8):
        data = je.serialize(exp, version=version)
        assert je.deserialize(data).in_shardings_hlo == \
            jax.export.deserialize(data).in_shardings_hlo
    with pytest.raises(jaxcolo.EncodeError, match="more than 1048576 tiles"):
        je.serialize(exp, version=5)


def test_bundled_avals_keep_the_shardings_jax_reads():
    """The avals kept beside the Exported were compared whole with those
    JAX's reader derives (sharding, memory space from the Exported's
    shardings): bundles of an Explicit-mesh or pinned_host export with a
    weak scalar were refused by unbundle (v10 readers read them)."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from jaxcolo.checking import check_readable
    mesh = jax.make_mesh((2, 4), ("x", "y"),
                         axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        explicit = jax.export.export(jax.jit(lambda x, w: x * w))(
            jax.ShapeDtypeStruct((8, 4), np.float32,
                                 sharding=NamedSharding(mesh, P("x", "y"))),
            1.0)
    pinned = jax.export.export(jax.jit(
        lambda x, w: x * w, out_shardings=jax.sharding.SingleDeviceSharding(
            jax.devices()[0], memory_kind="pinned_host")))(
        jax.ShapeDtypeStruct((3,), np.float32), 1.0)
    for exp in (explicit, pinned):
        data = je.bundle(exp)
        theirs = je.deserialize(exp.serialize())
        got = je.unbundle(data).exported
        assert [a.weak_type for a in got.in_avals] == [False, True]
        assert [(a.sharding, a.memory_space) for a in got.in_avals] == \
            [(a.sharding, a.memory_space) for a in theirs.in_avals]
        assert got.out_avals == theirs.out_avals
        assert check_readable(data, jaxcolo.SCHEMA_VERSION)[0]


def test_detection_reads_presence_only_fields_from_the_vtable():
    """A bad offset in nr_devices_short (present beside nr_devices, which
    deserialize reads instead, as JAX does) failed detection at the
    meaningless path '$.?': presence is read from the vtable alone."""
    data = bytearray(_golden("0.10.2", "shape_poly"))
    data[21] = 4  # nr_devices_short's vtable entry: an offset past the table
    data = bytes(data)
    assert str(je.deserialize(data).in_avals) == str(je.deserialize(
        _golden("0.10.2", "shape_poly")).in_avals)
    with pytest.raises(jaxcolo.PayloadError, match=r"match no JAX "
                       r"serialization version's layout .* - at \$$"):
        je.serialization_version(data)
