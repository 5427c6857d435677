"""Program payloads: contents, pickle-free spec decoding, versions, bad
bytes, inspection, and the InlineExecutor's use of them."""

import io
import json
import os
import pickle
import random
import subprocess
import sys

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxcolo
from jaxcolo import envelope
from jaxcolo.colocated import body as body_mod
from jaxcolo.colocated.inline import InlineExecutor
from jaxcolo.colocated.program import (Program, ProgramRef, decode_program,
                                       encode_program, read_program)
from tests.colocated_support import cpu_devices, executor, put  # noqa: F401

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import fuzz_payloads  # noqa: E402


class PickleUsed(Exception):
    """Raised by the patched pickle entry points."""


def _refuse_pickle(monkeypatch):
    def refuse(*a, **k):
        raise PickleUsed("pickle was used")

    class Refusing:
        def __init__(self, *a, **k):
            refuse()
    for mod in (pickle, cloudpickle):
        monkeypatch.setattr(mod, "loads", refuse)
        monkeypatch.setattr(mod, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", Refusing)


@pytest.fixture
def no_pickle(monkeypatch):
    """Every way to unpickle raises PickleUsed."""
    _refuse_pickle(monkeypatch)


def _tree_fn(t):
    return {"y": t["a"] * 2, "keys": t["k"], "s": t["s"]}


@pytest.fixture(scope="module")
def programs():
    """(function, args, its discovery and full program refs)."""
    devs = cpu_devices()
    mesh = Mesh(np.array(devs[:4]).reshape(2, 2), ("x", "y"))
    s = NamedSharding(mesh, P("x"))
    args = ({"a": jax.device_put(np.arange(4.0), s),
             "k": jax.device_put(jax.random.split(jax.random.key(0), 4), s),
             "s": jax.device_put(np.array(list("abcd"), np.dtypes.StringDType()),
                                 s)},)
    f = jaxcolo.colocated_python(_tree_fn)
    with InlineExecutor() as ex, jaxcolo.use_executor(ex):
        f(*args)
    discovery, full = f.programs()
    return f, args, discovery, full


def _specs_of(args):
    return (tuple(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        args)), {})


def test_spec_payloads_decode_with_pickle_disabled(programs, no_pickle):
    f, args, discovery, full = programs
    in_specs = _specs_of(args)
    out = _tree_fn(args[0])
    out_specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=x.sharding), out)
    for ref in (discovery, full):
        prog = jaxcolo.deserialize(ref.payload)  # via the root-kind dispatch
        assert isinstance(prog, Program) and prog.name == "_tree_fn"
        assert prog.in_specs == in_specs
        assert prog.devices == tuple(cpu_devices()[:4])
        raw = read_program(ref.payload)
        # The nested spec payloads are spec payloads in their own right.
        assert jaxcolo.deserialize(raw.in_specs) == in_specs
        assert jaxcolo.inspect(raw.in_specs)["root_kind"] == "spec_tree"
    assert jaxcolo.deserialize(discovery.payload).out_specs is None
    full_prog = jaxcolo.deserialize(full.payload)
    assert full_prog.out_specs == out_specs
    # The discovered spec payload is embedded verbatim and decodes alone.
    assert jaxcolo.deserialize(read_program(full.payload).out_specs) == out_specs
    with pytest.raises(PickleUsed):  # the patch is live: the body needs pickle
        body_mod.loads_body(full_prog.body)


def test_only_the_body_is_pickle(programs):
    _, _, discovery, full = programs
    raw = read_program(full.payload)
    fn = cloudpickle.loads(raw.body)
    assert fn.__name__ == "_tree_fn"
    for nested in (raw.in_specs, raw.out_specs):
        assert nested[:4] == envelope.MAGIC and b"\x80\x05" not in nested
    # Without the body, no byte sequence of a pickle stream remains.
    i = full.payload.find(raw.body)
    rest = full.payload[:i] + full.payload[i + len(raw.body):]
    assert b"\x80\x05" not in rest and b"cloudpickle" not in rest
    assert raw.body.startswith(b"\x80\x05")


def test_executor_touches_cloudpickle_only_to_run(programs, monkeypatch):
    f, args, discovery, full = programs
    loads = []
    real = cloudpickle.loads
    monkeypatch.setattr(cloudpickle, "loads",
                        lambda data: loads.append(len(data)) or real(data))
    ex = InlineExecutor()
    leaves = jax.tree.leaves((args, {}))
    decode_program(full.payload)
    jaxcolo.inspect(full.payload)
    assert loads == []
    out = ex.call(full, leaves, lane=1)
    body_len = len(read_program(full.payload).body)
    assert loads == [body_len]  # exactly the body, once
    ex.call(full, leaves, lane=1)
    outs, spec_payload = ex.discover(discovery, leaves, lane=1)
    # One body copy per program, as JAX has one per specialisation and one
    # for discovery: the discovery program loads its own.
    assert loads == [body_len, body_len]
    assert ex.stats()["programs_decoded"] == 2
    np.testing.assert_array_equal(jax.device_get(out[2]), np.arange(4.0) * 2)  # leaves: keys, s, y
    # The discovered spec payload decodes with every pickle entry point off.
    with monkeypatch.context() as m:
        _refuse_pickle(m)
        discovered = jaxcolo.deserialize(spec_payload)
    assert discovered == jaxcolo.deserialize(read_program(full.payload).out_specs)
    assert jaxcolo.inspect(spec_payload)["root_kind"] == "spec_tree"
    ex.close()


def test_warm_calls_decode_nothing(executor, monkeypatch):
    f = jaxcolo.colocated_python(lambda x: x + 1)
    x = put(1, cpu_devices()[0])
    f(x)
    f(x)
    before = dict(executor.stats())

    def refuse(*a, **k):
        raise AssertionError("decoded on a warm call")
    import jaxcolo.colocated.inline as inline_mod
    monkeypatch.setattr(inline_mod, "decode_program", refuse)
    # The executor's own module (a process executor's controller) too.
    ex_mod = sys.modules[type(executor).__module__]
    if hasattr(ex_mod, "decode_program"):
        monkeypatch.setattr(ex_mod, "decode_program", refuse)
    monkeypatch.setattr(inline_mod, "loads_body", refuse)
    monkeypatch.setattr(jaxcolo.codec.spec_tree, "decode_spec_tree", refuse)
    for _ in range(20):
        assert int(f(x)) == 2
    after = executor.stats()
    for k in ("programs_decoded", "bodies_loaded"):
        assert after.get(k) == before.get(k)
    assert after["calls"] == before["calls"] + 20


def test_program_version_rules():
    spec = jaxcolo.serialize(((jax.ShapeDtypeStruct((), jnp.int32, sharding=
                                                    jax.sharding.SingleDeviceSharding(jax.devices()[0])),), {}))
    assert envelope.read_header(jaxcolo.serialize(1 and np.dtype("f4"),
                                                  version=1)).writer_version == 1
    kw = dict(name="f", kind="function", body=b"\x80\x05N.", in_specs=spec,
              out_specs=None, device_ids=[0])
    with pytest.raises(jaxcolo.EncodeError,
                       match=r"program needs schema version 2, but version 1 "
                             r"was requested"):
        encode_program(**kw, version=1)
    data = encode_program(**kw)
    h = envelope.read_header(data)
    new = jaxcolo.SCHEMA_VERSION
    assert (h.writer_version, h.min_reader_version) == (new, 2)
    info = jaxcolo.inspect(data)
    assert info["root_kind"] == "program"
    assert info["readable_by_versions"] == list(range(2, new + 1))
    from jaxcolo.checking import check_readable
    ok, why = check_readable(data, 1)
    assert not ok and "needs a reader of version >= 2" in why
    # A spec payload nested in a program of the same version is fine; a spec
    # payload newer than the program is refused.
    with pytest.raises(jaxcolo.EncodeError, match="in_specs must be a spec "
                                                  "payload of version <= 2"):
        encode_program(**{**kw, "version": 2, "in_specs": envelope.HEADER.pack(
            envelope.MAGIC, 3, 1, 1, 0, 0, 0) + spec[16:]})
    with pytest.raises(jaxcolo.EncodeError, match="at least one device"):
        encode_program(**{**kw, "device_ids": []})
    with pytest.raises(jaxcolo.EncodeError, match="nonzero instance_id"):
        encode_program(**{**kw, "kind": "method", "method_name": "m"})


def _program(**overrides):
    sds = jax.ShapeDtypeStruct((2,), jnp.float32,
                               sharding=jax.sharding.SingleDeviceSharding(
                                   jax.devices()[1]))
    kw = dict(name="f", kind="function", body=b"\x80\x05N.",
              in_specs=jaxcolo.serialize(((sds,), {})),
              out_specs=jaxcolo.serialize({"out": sds}), device_ids=[1])
    kw.update(overrides)
    return encode_program(**kw)


def _patched(data: bytes, field: str, offset: int, value: int) -> bytes:
    """``data`` with byte ``offset`` of nested payload ``field`` replaced."""
    nested = getattr(read_program(data), field)
    at = data.find(nested) + offset
    return fuzz_payloads.fix_crc(data[:at] + bytes([value]) + data[at + 1:])


def test_malformed_programs_name_the_field():
    cases = [
        (_program(body=b""), r"program body missing - at \$\.body"),
        (_program(device_ids=[1, 1]), r"duplicate device ids.* - at \$\.device_ids"),
        (_program(in_specs=jaxcolo.serialize(np.dtype("f4"))),
         r"in_specs must be an \(args tuple, kwargs dict\) pair.* - at \$\.in_specs"),
        (_program(out_specs=jaxcolo.serialize([np.dtype("f4")])),
         r"leaf 0 is \w+, expected a ShapeDtypeStruct.* - at \$\.out_specs"),
        (_program(device_ids=[1, 4096]),
         r"unknown device id 4096.* - at \$\.device_ids"),
        (_patched(_program(), "in_specs", 4, 0xFF),  # nested writer version
         r"- at \$\.in_specs\.header"),
        (_patched(_program(), "out_specs", 0, ord("X")),  # nested magic
         r"not a jaxcolo payload.* - at \$\.out_specs\.header\.magic"),
    ]
    for data, pattern in cases:
        with pytest.raises(jaxcolo.PayloadError, match=pattern):
            jaxcolo.deserialize(data)
    # A corrupt nested spec payload (checksum of the nested envelope).
    with pytest.raises(jaxcolo.PayloadError,
                       match=r"checksum.* - at \$\.in_specs\.header\.crc32"):
        jaxcolo.deserialize(_patched(_program(), "in_specs", 40, 0x55))
    with pytest.raises(jaxcolo.PayloadError, match="not a program"):
        read_program(jaxcolo.serialize(np.dtype("f4")))
    with pytest.raises(jaxcolo.PayloadError, match="checksum"):
        data = _program()
        jaxcolo.deserialize(data[:-1] + bytes([data[-1] ^ 1]))
    # Truncations anywhere: PayloadError, never another exception.
    data = _program(kind="method", method_name="m", instance_id=9)
    for cut in range(0, len(data), 7):
        with pytest.raises(jaxcolo.PayloadError):
            jaxcolo.deserialize(fuzz_payloads.fix_crc(data[:cut]))


def test_fuzzed_programs_raise_only_payload_errors(programs, no_pickle):
    _, _, discovery, full = programs
    seeds = [discovery.payload, full.payload, _program(),
             _program(kind="method", method_name="m", instance_id=7)]
    counts, failures = fuzz_payloads.run(seeds, 1500, random.Random(7))
    assert failures == [], failures[0][1]
    assert not fuzz_payloads.run.unchecked, fuzz_payloads.run.unchecked[0][1]
    assert counts["PayloadError"] > 500


def test_inspect_describes_programs_without_loading(programs, no_pickle,
                                                    tmp_path):
    _, _, discovery, full = programs
    info = jaxcolo.inspect(full.payload)
    json.dumps(info)
    assert info["name"] == "_tree_fn" and info["kind"] == "function"
    assert info["device_ids"] == [d.id for d in cpu_devices()[:4]]
    assert info["body_size"] == len(read_program(full.payload).body)
    assert info["in_specs"]["num_leaves"] == 3
    assert "key<fry>" in " ".join(info["in_specs"]["leaves"])
    assert "StringDType" in " ".join(info["out_specs"]["leaves"])
    assert jaxcolo.inspect(discovery.payload)["out_specs"].startswith("absent")


def test_cli_inspects_a_program_file(programs, tmp_path):
    _, _, _, full = programs
    f = tmp_path / "program.bin"
    f.write_bytes(full.payload)
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "jaxcolo.cli", *a], capture_output=True,
        text=True, check=True).stdout
    text = run("inspect", str(f))
    assert "program payload" in text and "name: _tree_fn" in text
    assert "in_specs:" in text and "leaf[0]: ShapeDtypeStruct" in text
    assert json.loads(run("inspect", str(f), "--json"))["body_size"] > 0
    assert "readable by version 2" in run("check", str(f), "--reader-version",
                                          "2")


def test_program_ref_is_content_addressed(programs):
    _, _, discovery, full = programs
    assert ProgramRef.of(full.payload).id == full.id
    assert discovery.id != full.id and len(full.id) == 16


def test_body_pickles_devices_as_spec_payloads():
    devs = jax.devices()
    mesh = Mesh(np.array(devs[:2]), ("x",))
    captured = {"mesh": mesh, "s": NamedSharding(mesh, P("x")),
                "d": devs[3], "sd": jax.sharding.SingleDeviceSharding(devs[2])}
    data = body_mod.dumps_body(captured)
    assert data.count(envelope.MAGIC) == 4  # one spec payload per object
    assert body_mod.loads_body(data) == captured
    remap = {d.id: devs[(d.id + 4) % 8] for d in devs}
    moved = body_mod.loads_body(data, remap)  # ids resolve on the loader
    assert moved["d"] == devs[7]
    assert list(moved["mesh"].devices) == [devs[4], devs[5]]


def test_body_functions_keep_their_file_name():
    """A host's traceback names the function's file (and shows its source
    where the host has it): cloudpickle 3.1.3 writes ``<dynamic-code>``."""
    def outer(x):
        def inner(y):
            return y + 1
        return inner(x)

    data = body_mod.dumps_body(outer)
    loaded = pickle.loads(data)  # the standard library alone loads it
    assert loaded(1) == 2
    assert loaded.__code__.co_filename == __file__
    inner_code = next(c for c in loaded.__code__.co_consts
                      if hasattr(c, "co_filename"))
    assert inner_code.co_filename == __file__
    assert inner_code.co_name == "inner"


def test_demo_shows_colocated_programs():
    from jaxcolo import demo
    buf = io.StringIO()
    import contextlib
    with contextlib.redirect_stdout(buf):
        assert demo.colocated_demo()
    text = buf.getvalue()
    assert "program 'summarize' (function)" in text
    assert "program 'Counter.add' (method)" in text
    assert "out_specs: PyTreeDef" in text and "[101, 102, 103]" in text
