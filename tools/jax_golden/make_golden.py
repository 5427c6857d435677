"""Generates golden jax.export payloads with several real JAX releases.

Run with the main python (it does not import jax itself):

  python tools/jax_golden/make_golden.py [--versions 0.4.30 0.5.3 ...] \
      [--venv-root /tmp/jaxvenvs] [--out tests/golden/jax_export]

For each version V it creates (or reuses) a venv ``<venv-root>/jax-V``,
pip-installs ``jax==V jaxlib==V`` plus the pins below, and runs
``export_cases.py`` inside it with XLA_FLAGS=--xla_force_host_platform_device_count=8
and JAX_PLATFORMS=cpu, writing into ``<out>/jax-V/``.  Afterwards it writes
``<out>/index.json`` and ``<out>/README.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEFAULT_OUT = os.path.join(REPO, "tests", "golden", "jax_export")

# Newest patch of each minor that installs on Python 3.11.
DEFAULT_VERSIONS = ["0.4.30", "0.4.38", "0.5.3", "0.6.2", "0.7.2", "0.8.3",
                    "0.9.2", "0.10.2"]

# Always needed: jax.export imports absl (<= 0.5.x) and serialization needs
# flatbuffers (not a hard dependency of jax/jaxlib).
COMMON_EXTRAS = ["absl-py", "flatbuffers"]
# Version-specific pins (prefix match on the version string).
PINS = {
    "0.4.30": ["numpy<2"],  # jaxlib 0.4.30 was built against numpy 1.x
}


def pins_for(v: str) -> list[str]:
  out = []
  for k, p in PINS.items():
    if v == k or v.startswith(k + "."):
      out += p
  return out


def run(cmd, env=None, log=None):
  print("+", " ".join(cmd), flush=True)
  r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE,
                     stderr=subprocess.STDOUT, text=True)
  if log:
    with open(log, "a") as f:
      f.write(r.stdout)
  return r


def ensure_venv(v: str, root: str) -> tuple[str | None, str]:
  vdir = os.path.join(root, f"jax-{v}")
  py = os.path.join(vdir, "bin", "python")
  log = os.path.join(root, f"jax-{v}.make.log")
  if not os.path.exists(py):
    r = run([sys.executable, "-m", "venv", vdir], log=log)
    if r.returncode:
      return None, f"venv creation failed (see {log})"
  reqs = [f"jax=={v}", f"jaxlib=={v}"] + pins_for(v) + COMMON_EXTRAS
  r = run([py, "-m", "pip", "install", "-q", *reqs], log=log)
  if r.returncode:
    tail = "\n".join(l for l in r.stdout.splitlines() if "WARNING" not in l)[-800:]
    return None, f"pip install {' '.join(reqs)} failed: {tail}"
  return py, "ok"


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--versions", nargs="*", default=DEFAULT_VERSIONS)
  ap.add_argument("--venv-root", default="/tmp/jaxvenvs")
  ap.add_argument("--out", default=DEFAULT_OUT)
  ap.add_argument("--cases", nargs="*", default=None)
  ap.add_argument("--keep-existing", action="store_true",
                  help="do not delete an existing jax-V output dir first")
  a = ap.parse_args(argv)
  os.makedirs(a.venv_root, exist_ok=True)
  os.makedirs(a.out, exist_ok=True)
  status = {}
  for v in a.versions:
    py, msg = ensure_venv(v, a.venv_root)
    if py is None:
      print(f"!! jax {v}: {msg}", flush=True)
      status[v] = msg
      continue
    vout = os.path.join(a.out, f"jax-{v}")
    if os.path.isdir(vout) and not a.keep_existing:
      shutil.rmtree(vout)
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("PYTHONPATH", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    cmd = [py, os.path.join(HERE, "export_cases.py"), "--out-dir", vout]
    if a.cases:
      cmd += ["--cases", *a.cases]
    # Run from a neutral cwd so that no repo-local module shadows anything.
    print("+", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, env=env, cwd=a.venv_root)
    status[v] = "ok" if r.returncode == 0 else f"exporter exited {r.returncode}"
  write_index(a.out)
  print(json.dumps(status, indent=1))
  return 0 if all(s == "ok" for s in status.values()) else 1


def _vkey(d):
  return tuple(int("".join(c for c in p if c.isdigit()) or 0)
               for p in d[len("jax-"):].split("."))


def write_index(out: str):
  versions = []
  for d in sorted((d for d in os.listdir(out)
                   if d.startswith("jax-") and
                   os.path.exists(os.path.join(out, d, "manifest.json"))),
                  key=_vkey):
    with open(os.path.join(out, d, "manifest.json")) as f:
      m = json.load(f)
    cases = m["cases"]
    versions.append({
        "dir": d,
        "jax_version": m["jax_version"],
        "jaxlib_version": m["jaxlib_version"],
        "numpy_version": m.get("numpy_version"),
        "ml_dtypes_version": m.get("ml_dtypes_version"),
        "module_serialization_version": m.get("module_serialization_version"),
        "flatbuffer_serialization_versions": sorted(
            {c["flatbuffer_serialization_version"] for c in cases
             if c.get("flatbuffer_serialization_version") is not None}),
        "calling_convention_versions": sorted(
            {c["calling_convention_version"] for c in cases
             if c.get("calling_convention_version") is not None}),
        "cases_ok": [c["name"] for c in cases if c["status"] == "ok"],
        "cases_not_ok": {c["name"]: (c["status"] + ": " +
                                     (c.get("reason") or c.get("call_error") or ""))
                         for c in cases if c["status"] != "ok"},
    })
  index = {
      "description": "Golden jax.export payloads; see README.md.",
      "generator": "python tools/jax_golden/make_golden.py",
      "versions": versions,
  }
  with open(os.path.join(out, "index.json"), "w") as f:
    json.dump(index, f, indent=1)
  write_readme(out, versions)


def write_readme(out: str, versions):
  all_cases = []
  for v in versions:
    for c in v["cases_ok"] + list(v["cases_not_ok"]):
      if c not in all_cases:
        all_cases.append(c)
  lines = [
      "# Golden `jax.export` payloads from real JAX releases",
      "",
      "Generated (do not edit by hand) with:",
      "",
      "```",
      "python tools/jax_golden/make_golden.py --venv-root /tmp/jaxvenvs",
      "```",
      "",
      "For each release a throwaway venv gets `jax==V jaxlib==V` (+ `absl-py`,",
      "`flatbuffers`, and `numpy<2` for 0.4.30) and runs",
      "`tools/jax_golden/export_cases.py` with",
      "`XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu`.",
      "",
      "Layout: `jax-<V>/<case>.bin` = `exp.serialize()` bytes (`vjp_order=1` for",
      "the vjp cases); `jax-<V>/<case>.io.npz` = flattened call inputs `in_i`,",
      "expected outputs `out_i` of `exp.call` in that release (and `vjp_in_i` /",
      "`vjp_out_i` for vjp cases); `jax-<V>/manifest.json` describes every case",
      "(avals, shardings, nr_devices, platforms, versions, dtype storage, skip",
      "reasons). `index.json` lists the version dirs with their module-level",
      "`_SERIALIZATION_VERSION`. Pytree types used by `namedtuple_custom` and the",
      "testing effects used by `ordered_effects` live in",
      "`tools/jax_golden/golden_types.py`.",
      "",
      "Check with the current JAX: `python tools/jax_golden/verify_golden.py`.",
      "",
      "## Versions",
      "",
      "| dir | jax | jaxlib | numpy | ml_dtypes | module `_SERIALIZATION_VERSION` | flatbuffer `serialization_version` field | calling conv. |",
      "| --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for v in versions:
    lines.append(f"| {v['dir']} | {v['jax_version']} | {v['jaxlib_version']} | "
                 f"{v['numpy_version']} | {v['ml_dtypes_version']} | "
                 f"{v['module_serialization_version']} | "
                 f"{', '.join(map(str, v['flatbuffer_serialization_versions']))} | "
                 f"{', '.join(map(str, v['calling_convention_versions']))} |")
  lines += ["", "## Cases (ok / not produced per version)", "",
            "| case | " + " | ".join(v["jax_version"] for v in versions) + " |",
            "| --- |" + " --- |" * len(versions)]
  for c in all_cases:
    row = []
    for v in versions:
      if c in v["cases_ok"]:
        row.append("ok")
      elif c in v["cases_not_ok"]:
        row.append(v["cases_not_ok"][c].split(":")[0])
      else:
        row.append("-")
    lines.append(f"| {c} | " + " | ".join(row) + " |")
  lines += ["", "## Notes", "",
            "- `flatbuffer serialization_version` is the `Exported.serialization_version`",
            "  field in the payload; from 0.8.x on JAX always writes 3 there, whatever",
            "  the module-level `_SERIALIZATION_VERSION` is.",
            "- `namedtuple_custom` uses serialized names `jaxcolo.golden.Point`",
            "  (NamedTuple) and `jaxcolo.golden.Box` (custom node; auxdata = UTF-8 label).",
            "- `ordered_effects` uses testing effects built with JAX *private* APIs",
            "  (no public exportable effect exists; `jax.debug.print` cannot be",
            "  serialized). Effect type names are",
            "  `<class 'golden_types.GoldenOrderedEffect'>` / `...GoldenUnorderedEffect'>`.",
            "- Cases with `call_mesh` in the manifest need their inputs device_put to the",
            "  recorded mesh/PartitionSpecs (8 CPU devices); `x64_dtypes` needs",
            "  `jax_enable_x64`.",
            "- `verify_golden.py` (jax 0.10.2): everything passes except",
            "  `jax-0.4.30/disabled_checks_shape_assertions` (expected: kind 2 was removed).",
            ]
  lines += ["", "Reasons for skipped cases are in each `manifest.json` "
            "(`reason` / `call_error`) and in `index.json` (`cases_not_ok`).", ""]
  with open(os.path.join(out, "README.md"), "w") as f:
    f.write("\n".join(lines))


if __name__ == "__main__":
  sys.exit(main())
