"""jaxcolo.export against the golden payloads of real JAX releases
(tests/golden/jax_export, made by tools/jax_golden/make_golden.py)."""

import dataclasses
import json
import os

import jax
import pytest

import jaxcolo.export as je
from jaxcolo import EncodeError

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "golden", "jax_export")
TOOLS = os.path.join(os.path.dirname(HERE), "tools", "jax_golden")


from tests.golden_setup import verify_golden as verify  # noqa: E402

# The newest serialization version of each golden release (versions.py).
RELEASE_VERSION = {r: row.version for row in je.versions.HISTORY
                   for r in row.releases}


def _cases():
    out = []
    for d in sorted(os.listdir(GOLDEN)):
        if not d.startswith("jax-"):
            continue
        manifest = json.load(open(os.path.join(GOLDEN, d, "manifest.json")))
        for case in manifest["cases"]:
            if case["status"] == "ok":
                out.append((d, case))
    return out


CASES = _cases()
IDS = [f"{d}/{c['name']}" for d, c in CASES]


def _read(d, case):
    return open(os.path.join(GOLDEN, d, case["file"]), "rb").read()


def assert_same_exported(mine, ref):
    """Field by field; symbolic shapes from different scopes by text."""
    for f in dataclasses.fields(ref):
        if f.name == "_get_vjp":
            continue
        a, b = getattr(mine, f.name), getattr(ref, f.name)
        try:
            eq = a == b
        except Exception:
            eq = False
        assert eq or str(a) == str(b), (f.name, a, b)
        assert type(a) is type(b), (f.name, type(a), type(b))
    assert mine.has_vjp() == ref.has_vjp()
    if ref.has_vjp():
        assert_same_exported(mine.vjp(), ref.vjp())


def test_golden_count():
    assert len(CASES) == 153
    assert {d for d, _ in CASES} == {f"jax-{r}" for r in (
        "0.4.30", "0.4.38", "0.5.3", "0.6.2", "0.7.2", "0.8.3", "0.9.2",
        "0.10.2")}


@pytest.mark.parametrize("d,case", CASES, ids=IDS)
def test_golden_reads_calls_and_matches_jax(d, case):
    data = _read(d, case)
    verify.verify_case(os.path.join(GOLDEN, d), case, je.deserialize)
    mine = je.deserialize(data)
    try:
        ref = jax.export.deserialize(bytearray(data))
    except ValueError:  # 0.4.30 shape_assertions: jax 0.10.2 cannot read it
        assert case["name"] == "disabled_checks_shape_assertions"
        return
    assert_same_exported(mine, ref)


@pytest.mark.parametrize("d,case", CASES, ids=IDS)
def test_golden_version(d, case):
    data = _read(d, case)
    lo, hi = je.version_range(data)
    assert lo <= RELEASE_VERSION[d[4:]] <= hi
    assert je.serialization_version(data) == lo


@pytest.mark.parametrize("d,case", CASES, ids=IDS)
def test_default_version_is_byte_identical_to_jax(d, case):
    exp = jax.export.deserialize(bytearray(_read(d, case))) \
        if case["name"] != "disabled_checks_shape_assertions" else None
    if exp is None:
        return
    order = 1 if exp.has_vjp() else 0
    try:
        ref = exp.serialize(vjp_order=order)
    except ValueError:  # HloSharding-only Exported: jax 0.10.2 refuses too
        with pytest.raises(EncodeError):
            je.serialize(exp, vjp_order=order)
        return
    assert bytes(je.serialize(exp, vjp_order=order)) == bytes(ref)
    if d == "jax-0.10.2":
        assert bytes(je.serialize(exp, vjp_order=order)) == _read(d, case)


LATEST = [(d, c) for d, c in CASES if d in ("jax-0.10.2", "jax-0.4.30")]


@pytest.mark.parametrize("version", range(2, 13))
@pytest.mark.parametrize("d,case", LATEST,
                         ids=[f"{d}/{c['name']}" for d, c in LATEST])
def test_each_version_is_read_and_called_by_jax(d, case, version):
    """Version N payloads: jax 0.10.2 reads them, they equal jaxcolo's
    reading, they call correctly, and their inferred range contains N."""
    exp = je.deserialize(_read(d, case))
    order = 1 if exp.has_vjp() else 0
    try:
        data = je.serialize(exp, vjp_order=order, version=version)
    except EncodeError as e:
        # Only what the version cannot express.
        assert any(s in e.reason for s in (
            "version >=", "newer serialization version", "HloShardings",
            "abstract device")), e
        return
    lo, hi = je.version_range(data)
    assert lo <= version <= hi
    assert_same_exported(je.deserialize(data),
                         jax.export.deserialize(bytearray(data)))
    verify.verify_case(os.path.join(GOLDEN, d), case, data=data)


def test_fuzz_export_survives_jax_aborting_or_hanging(monkeypatch):
    """--compare-jax ran jax.export.deserialize in the tool's process: a
    mutant on which XLA aborts (seed 2: a failed CHECK) or loops ended the
    run with no result.  The child that runs it is replaced instead."""
    import sys
    sys.path.insert(0, os.path.dirname(TOOLS))
    import fuzz_export
    good = fuzz_export.seed_payloads()[0]
    decoder = fuzz_export.JaxDecoder()
    try:
        assert decoder.outcome(good) == "accepted"
        decoder._proc.kill()  # as XLA aborting does
        decoder._proc.join(10)
        assert decoder.outcome(good) == "aborted"
        assert decoder.outcome(b"not an export") != "aborted"  # restarted
        # a child that does not answer in time (a 0 s timeout alone lost
        # the race on a loaded machine: the child answered first)
        assert len(good) < 16 << 10  # (the send cannot block on the pipe)
        from tests.colocated_support import stop_process
        stop_process(decoder._proc.pid)
        monkeypatch.setattr(fuzz_export, "JAX_TIMEOUT", 0.2)
        assert decoder.outcome(good) == "hung"
        monkeypatch.setattr(fuzz_export, "JAX_TIMEOUT", 60.0)
        assert decoder.outcome(good) == "accepted"
    finally:
        decoder.close()


def test_mutation_fuzz_only_payload_errors():
    """Quick run of tools/fuzz_export.py (the long run: 200k mutations)."""
    import random
    import sys
    sys.path.insert(0, os.path.dirname(TOOLS))
    import fuzz_export
    seeds = fuzz_export.seed_payloads()
    counts, failures, _ = fuzz_export.run(seeds, 3000, random.Random(99))
    assert not failures, failures[0][1]
    assert counts["PayloadError"] > 1000
