"""Write the golden spec payloads of schema version N (once, forever).

    python tools/make_spec_golden.py --version N

Serializes every object of ``tests/golden/spec/vN/objects.py`` with
``jaxcolo.serialize(obj, version=N)`` into ``tests/golden/spec/vN/<name>.bin``
(and with ``compress=False`` into ``<name>.plain.bin``)
and records sizes and sha256 in ``manifest.json``.  Refuses to overwrite:
golden payloads of a released version never change; every later jaxcolo
must read them (tests/test_golden_spec.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden", "spec")


def load_objects(version: int):
    """The frozen objects module of version N (imported once per process)."""
    name = f"jaxcolo_golden_v{version}_objects"
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(GOLDEN, f"v{version}", "objects.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--version", type=int, required=True)
    args = ap.parse_args()
    import jaxcolo
    d = os.path.join(GOLDEN, f"v{args.version}")
    if os.path.exists(os.path.join(d, "manifest.json")):
        sys.exit(f"{d} already has golden payloads: they never change")
    if args.version != jaxcolo.SCHEMA_VERSION:
        sys.exit(f"golden payloads are written by the version that releases "
                 f"them: this jaxcolo writes version {jaxcolo.SCHEMA_VERSION}"
                 f", not {args.version}")
    if not os.path.exists(os.path.join(d, "objects.py")):
        sys.exit(f"write {os.path.join(d, 'objects.py')} first: the objects "
                 "the version's golden payloads hold (copy the previous "
                 "version's and add what it introduced)")
    module = load_objects(args.version)
    objs = dict(module.objects())
    objs.update(module.symbolic_objects())
    manifest = {"version": args.version, "jaxcolo_schema": jaxcolo.SCHEMA_VERSION,
                "payloads": {}}
    # Payloads of other root kinds (programs, bundles, ...), if the version's
    # objects module describes some.
    if hasattr(module, "payloads"):
        for name, data in module.payloads(args.version).items():
            with open(os.path.join(d, f"{name}.bin"), "wb") as f:
                f.write(data)
            manifest["payloads"][f"{name}.bin"] = {
                "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    for name, obj in objs.items():
        for suffix, compress in ((".bin", True), (".plain.bin", False)):
            data = jaxcolo.serialize(obj, version=args.version,
                                     compress=compress)
            with open(os.path.join(d, name + suffix), "wb") as f:
                f.write(data)
            manifest["payloads"][name + suffix] = {
                "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {len(objs)} golden payloads to {os.path.relpath(d, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
