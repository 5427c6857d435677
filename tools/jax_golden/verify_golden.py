"""Checks that the *current* JAX reads and runs every golden payload.

  python tools/jax_golden/verify_golden.py [--golden tests/golden/jax_export]
      [--versions 0.4.30 ...] [--cases NAME ...] [-v]

For every ``jax-<V>/<case>.bin`` with status "ok" in its manifest:
``jax.export.deserialize`` it, rebuild the inputs from ``<case>.io.npz``,
call ``exp.call(*args, **kwargs)`` and compare with the recorded outputs
(exact for ints/bools/PRNG key data, assert_allclose for floats); for vjp
cases also ``exp.vjp().call(...)``.  Prints one line per case and a final
"N passed, N failed" line.  ``--reader jaxcolo`` deserializes with
jaxcolo.export instead.  Exits 1 if anything failed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import traceback

# Must happen before jax is imported.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if HERE not in sys.path:
  sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # keep tools/jax_golden free of __pycache__

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import golden_types  # noqa: E402

# Payloads that the current JAX legitimately cannot read.
# case -> (why, regex the failure message must match to count as expected)
KNOWN_FAILURES = {
    "jax-0.4.30/disabled_checks_shape_assertions": (
        "DisabledSafetyCheck.shape_assertions (flatbuffer kind 2) was removed "
        "from JAX 0.10.0; its deserialization raises ValueError",
        r"ValueError: Cannot deserialize DisabledSafetyCheck with unknown "
        r"kind: 2"),
}

_NATIVE_FLOATS = {"float16": (1e-3, 1e-3), "float32": (1e-5, 1e-6),
                  "float64": (1e-12, 1e-12), "complex64": (1e-5, 1e-6),
                  "complex128": (1e-12, 1e-12)}


def decode_leaf(info, arr):
  if info.get("prng_key"):
    return jax.random.wrap_key_data(np.asarray(arr), impl=info["prng_impl"])
  if info["dtype"] == "float0":
    return np.zeros(info["shape"], dtype=jax.dtypes.float0)
  if info["stored_as"] != info["dtype"]:
    return np.asarray(arr).view(jnp.dtype(info["dtype"])).reshape(info["shape"])
  return np.asarray(arr).reshape(info["shape"])


def compare_leaf(info, expected_stored, actual, where):
  if info.get("prng_key"):
    if not jax.dtypes.issubdtype(actual.dtype, jax.dtypes.prng_key):
      raise AssertionError(f"{where}: expected PRNG key, got {actual.dtype}")
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(actual)),
                                  expected_stored, err_msg=where)
    return
  a = np.asarray(actual)
  if list(a.shape) != list(info["shape"]):
    raise AssertionError(f"{where}: shape {a.shape} != {info['shape']}")
  if info["dtype"] == "float0":
    return
  if a.dtype.name != info["dtype"]:
    raise AssertionError(f"{where}: dtype {a.dtype.name} != {info['dtype']}")
  exp = decode_leaf(info, expected_stored)
  if info["dtype"] in _NATIVE_FLOATS:
    rtol, atol = _NATIVE_FLOATS[info["dtype"]]
    np.testing.assert_allclose(a, exp, rtol=rtol, atol=atol, err_msg=where)
  elif a.dtype.kind in "biu" and info["stored_as"] == info["dtype"]:
    np.testing.assert_array_equal(a, exp, err_msg=where)
  else:  # bfloat16, float8*, int4, ...: compare the bit patterns
    np.testing.assert_array_equal(
        np.asarray(a).view(np.dtype(info["stored_as"])), expected_stored,
        err_msg=where)


def place(leaves, case, inputs_info):
  m = case.get("call_mesh")
  if not m:
    return leaves
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  n = int(np.prod(m["shape"]))
  mesh = Mesh(np.array(jax.devices()[:n]).reshape(m["shape"]), tuple(m["axis_names"]))
  specs = case.get("call_in_specs") or []
  kinds = case.get("call_in_memory_kinds") or []
  out = []
  for i, x in enumerate(leaves):
    ps = P(*[tuple(e) if isinstance(e, list) else e for e in specs[i]]) \
        if i < len(specs) else P()
    mk = kinds[i] if i < len(kinds) else None
    s = NamedSharding(mesh, ps, memory_kind=mk) if mk else NamedSharding(mesh, ps)
    out.append(jax.device_put(x, s))
  return out


def verify_case(vdir, case, deserialize=None, data=None):
  """Deserialize (``deserialize``, default jax.export.deserialize) the case's
  payload (or ``data`` instead of the file), call it and compare."""
  ser = data if data is not None else \
      open(os.path.join(vdir, case["file"]), "rb").read()
  io = np.load(os.path.join(vdir, case["io_file"]))
  exp = (deserialize or jax.export.deserialize)(bytearray(ser))
  if case.get("nr_devices") is not None and exp.nr_devices != case["nr_devices"]:
    raise AssertionError(f"nr_devices {exp.nr_devices} != {case['nr_devices']}")
  if case.get("platforms") and list(exp.platforms) != list(case["platforms"]):
    raise AssertionError(f"platforms {exp.platforms} != {case['platforms']}")
  if case.get("in_avals") is not None and len(exp.in_avals) != len(case["in_avals"]):
    raise AssertionError("number of in_avals differs from manifest")
  for i, spec in enumerate(case.get("call_in_specs") or []):
    # An input placed with a non-trivial spec was exported sharded: the
    # payload must still say so (a writer that drops it gives None).
    if any(e is not None for e in spec) and i < len(exp.in_shardings_hlo) \
        and exp.in_shardings_hlo[i] is None:
      raise AssertionError(f"in_shardings_hlo[{i}] is None: the sharding "
                           f"{spec} of the export was lost")
  in_leaves = [decode_leaf(i, io[i["key"]]) for i in case["inputs"]]
  prev = bool(jax.config.jax_enable_x64)
  if case.get("requires_x64"):
    jax.config.update("jax_enable_x64", True)
  try:
    placed = place(in_leaves, case, case["inputs"])
    args, kwargs = jax.tree_util.tree_unflatten(exp.in_tree, placed)
    res = exp.call(*args, **kwargs)
    out_leaves = jax.tree_util.tree_leaves(res)
    if len(out_leaves) != len(case["outputs"]):
      raise AssertionError(f"{len(out_leaves)} outputs != {len(case['outputs'])}")
    for info, a in zip(case["outputs"], out_leaves):
      compare_leaf(info, io[info["key"]], a, info["key"])
    extra = ""
    if case.get("vjp_serialized"):
      vc = case.get("vjp_call") or {}
      if "inputs" not in vc:
        extra = " (vjp present; no recorded vjp call)"
        exp.vjp()
      else:
        vexp = exp.vjp()
        vin = [decode_leaf(i, io[i["key"]]) for i in vc["inputs"]]
        vres = jax.tree_util.tree_leaves(vexp.call(*vin))
        if len(vres) != len(vc["outputs"]):
          raise AssertionError("vjp output count mismatch")
        for info, a in zip(vc["outputs"], vres):
          compare_leaf(info, io[info["key"]], a, info["key"])
        extra = " (+vjp)"
  finally:
    jax.config.update("jax_enable_x64", prev)
  return extra


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--golden", default=os.path.join(REPO, "tests", "golden", "jax_export"))
  ap.add_argument("--versions", nargs="*")
  ap.add_argument("--cases", nargs="*")
  ap.add_argument("-v", "--verbose", action="store_true")
  ap.add_argument("--reader", choices=("jax", "jaxcolo"), default="jax",
                  help="deserialize with jax.export or jaxcolo.export")
  a = ap.parse_args(argv)
  deserialize = None
  if a.reader == "jaxcolo":
    import jaxcolo.export
    deserialize = jaxcolo.export.deserialize
  print(f"verifying with jax {jax.__version__} (jaxlib "
        f"{getattr(__import__('jaxlib'), '__version__', '?')}), "
        f"{len(jax.devices())} devices")
  reg = golden_types.register_serialization()
  try:
    golden_types.setup_testing_effects()
  except Exception as e:
    print(f"note: testing effects unavailable: {e}")
  print(f"pytree serialization registration: {reg}")
  dirs = sorted(d for d in os.listdir(a.golden)
                if d.startswith("jax-") and os.path.isdir(os.path.join(a.golden, d)))
  if a.versions:
    dirs = [d for d in dirs if d[len("jax-"):] in a.versions]
  passed, failed, skipped, xfailed = 0, 0, 0, 0
  failures = []
  for d in dirs:
    vdir = os.path.join(a.golden, d)
    manifest = json.load(open(os.path.join(vdir, "manifest.json")))
    for case in manifest["cases"]:
      name = f"{d}/{case['name']}"
      if a.cases and case["name"] not in a.cases:
        continue
      if case["status"] != "ok":
        skipped += 1
        if a.verbose:
          print(f"SKIP {name}: not produced ({case['status']})")
        continue
      try:
        extra = verify_case(vdir, case, deserialize)
        passed += 1
        if name in KNOWN_FAILURES:
          print(f"XPASS {name}{extra} (listed in KNOWN_FAILURES)")
        else:
          print(f"PASS {name}{extra}")
      except Exception as e:
        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        known = KNOWN_FAILURES.get(name)
        if known is not None and re.search(known[1], msg):
          xfailed += 1
          print(f"XFAIL {name}: {msg}  [expected: {known[0]}]")
        else:
          if known is not None:
            msg += "  [listed in KNOWN_FAILURES, but fails differently]"
          failed += 1
          failures.append((name, msg))
          print(f"FAIL {name}: {msg}")
        if a.verbose:
          traceback.print_exc()
  print()
  if failures:
    print("Failures:")
    for n, m in failures:
      print(f"  {n}: {m}")
  print(f"expected failures (xfail): {xfailed}; cases not produced by "
        f"their release (skipped): {skipped}")
  print(f"{passed} passed, {failed} failed")
  if not passed + failed + xfailed:
    print("nothing was verified (no golden cases matched): failing")
    return 1
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
