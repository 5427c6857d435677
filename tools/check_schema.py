"""Check that schema/ only evolves compatibly: ``flatc --conform`` of the
current schema against every frozen version under schema/history/vN/.

    python tools/check_schema.py            # check against every frozen version
    python tools/check_schema.py --freeze N # copy schema/*.fbs to history/vN
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from regen import ROOT, flatc  # noqa: E402
SCHEMA_DIR = os.path.join(ROOT, "schema")
HISTORY = os.path.join(SCHEMA_DIR, "history")
ROOT_FILE = "jaxcolo.fbs"


def conform(old_dir: str, new_file: str) -> subprocess.CompletedProcess:
    """Run flatc --conform: is new_file an evolution of old_dir's schema?"""
    return subprocess.run(
        [flatc(), "--conform", os.path.join(old_dir, ROOT_FILE),
         "--conform-includes", old_dir, "-I", os.path.dirname(new_file),
         new_file], capture_output=True, text=True)


def frozen_versions() -> list[str]:
    return sorted(glob.glob(os.path.join(HISTORY, "v*")),
                  key=lambda d: int(os.path.basename(d)[1:]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--freeze", type=int, metavar="N")
    args = ap.parse_args()
    if args.freeze is not None:
        dest = os.path.join(HISTORY, f"v{args.freeze}")
        if os.path.exists(dest):
            sys.exit(f"{dest} exists: frozen versions never change")
        os.makedirs(dest)
        for f in glob.glob(os.path.join(SCHEMA_DIR, "*.fbs")):
            shutil.copy(f, dest)
        print(f"froze schema as {os.path.relpath(dest, ROOT)}")
        return 0
    failures = 0
    current = os.path.join(SCHEMA_DIR, ROOT_FILE)
    versions = frozen_versions()
    for d in versions:
        r = conform(d, current)
        status = "ok" if r.returncode == 0 else "NOT CONFORMING"
        print(f"flatc --conform {os.path.relpath(d, ROOT)}: {status}")
        if r.returncode:
            failures += 1
            print(r.stdout + r.stderr)
    if not versions:
        print("no frozen schema versions under schema/history yet")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
