"""Exports golden cases with the *running* JAX release.

Runs inside a throwaway venv holding one JAX release (0.4.30 .. 0.10.x). Only
imports jax / numpy (+ the sibling ``golden_types`` module). Must be started
with XLA_FLAGS=--xla_force_host_platform_device_count=8 and JAX_PLATFORMS=cpu
(make_golden.py does that).

Usage:  python export_cases.py --out-dir DIR [--cases NAME ...]

Writes into DIR, per case, ``<case>.bin`` (``exp.serialize()`` bytes, with
``vjp_order=1`` for vjp cases) and ``<case>.io.npz`` (flattened inputs
``in_i`` / expected outputs ``out_i`` of ``exp.call``; for vjp cases also
``vjp_in_i`` / ``vjp_out_i``), plus one ``manifest.json`` describing all
cases (including skipped ones, with the reason).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
  sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # keep tools/jax_golden free of __pycache__

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import golden_types  # noqa: E402

jexport = golden_types.get_export_module()
JAX_VERSION = jax.__version__
try:
  import jaxlib
  JAXLIB_VERSION = jaxlib.__version__
except Exception:  # pragma: no cover
  from jax.lib import __version__ as JAXLIB_VERSION  # type: ignore


def _ver_tuple(v: str):
  out = []
  for p in v.split(".")[:3]:
    num = "".join(ch for ch in p if ch.isdigit())
    out.append(int(num) if num else 0)
  return tuple(out)


JAX_VT = _ver_tuple(JAX_VERSION)


class Skip(Exception):
  """Raised by a case to be skipped with a reason."""


# ----------------------------------------------------------------------------
# Version/format introspection
# ----------------------------------------------------------------------------
def _serialization_module():
  for modname in ("jax._src.export.serialization",
                  "jax.experimental.export.serialization",
                  "jax.experimental.export._serialization"):
    try:
      __import__(modname)
      return sys.modules[modname]
    except Exception:
      continue
  return None


def _flatbuf_module():
  for modname in ("jax._src.export.serialization_generated",
                  "jax.experimental.export.serialization_generated"):
    try:
      __import__(modname)
      return sys.modules[modname]
    except Exception:
      continue
  return None


def module_serialization_info():
  mod = _serialization_module()
  info = {"module": getattr(mod, "__name__", None), "constants": {}}
  value = None
  if mod is not None:
    for k, v in vars(mod).items():
      if "VERSION" in k.upper() and isinstance(v, int) and not isinstance(v, bool):
        info["constants"][k] = v
    value = getattr(mod, "_SERIALIZATION_VERSION", None)
    if value is None and info["constants"]:
      value = next(iter(info["constants"].values()))
  info["serialization_version"] = value
  try:
    import inspect
    src = inspect.getsource(mod)
    info["history"] = [l.strip("# ").rstrip() for l in src.splitlines()
                       if l.startswith("# Version ")]
  except Exception:
    info["history"] = []
  return info


def flatbuffer_serialization_version(ser: bytes):
  fb = _flatbuf_module()
  if fb is None:
    return None
  try:
    return int(fb.Exported.GetRootAsExported(bytearray(ser), 0).SerializationVersion())
  except Exception:
    return None


def serialize(exp, vjp_order=0) -> bytes:
  if hasattr(exp, "serialize"):
    if vjp_order:
      return bytes(exp.serialize(vjp_order=vjp_order))
    return bytes(exp.serialize())
  return bytes(jexport.serialize(exp, vjp_order=vjp_order))  # type: ignore


def deserialize(ser: bytes):
  return jexport.deserialize(bytearray(ser))


def export(fun_jit, *specs, platforms=None, disabled_checks=None, **kwspecs):
  kw = {}
  if platforms is not None:
    kw["platforms"] = platforms
  if disabled_checks is not None:
    kw["disabled_checks"] = disabled_checks
  return jexport.export(fun_jit, **kw)(*specs, **kwspecs)


def sds(shape, dtype, **kw):
  return jax.ShapeDtypeStruct(shape, dtype, **kw)


# ----------------------------------------------------------------------------
# Leaf encoding for npz
# ----------------------------------------------------------------------------
_NPZ_NATIVE = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
               "uint32", "uint64", "float16", "float32", "float64",
               "complex64", "complex128"}


def is_prng_key(x) -> bool:
  try:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  except Exception:
    return False


def prng_impl_name(k) -> str:
  impl = jax.random.key_impl(k)
  inner = getattr(impl, "_impl", None)
  name = getattr(inner, "name", None)
  return name if isinstance(name, str) else str(impl)


def encode_leaf(x, key):
  """Returns (stored np array, info dict)."""
  info = {"key": key}
  if is_prng_key(x):
    data = np.asarray(jax.random.key_data(x))
    info.update(dtype=str(x.dtype), shape=list(x.shape), prng_key=True,
                prng_impl=prng_impl_name(x), stored_as=str(data.dtype),
                stored_shape=list(data.shape))
    return data, info
  a = np.asarray(x)
  name = a.dtype.name
  info.update(dtype=name, shape=list(a.shape))
  if name == "float0" or (a.dtype.kind == "V" and a.dtype.itemsize == 0):
    info.update(dtype="float0", stored_as="bool")
    return np.zeros(a.shape, dtype=np.bool_), info
  if name in _NPZ_NATIVE:
    info["stored_as"] = name
    return a, info
  view = a.view(np.dtype(f"uint{8 * a.dtype.itemsize}"))
  info["stored_as"] = str(view.dtype)
  return view, info


def encode_leaves(leaves, prefix, arrays, infos):
  for i, x in enumerate(leaves):
    k = f"{prefix}_{i}"
    arr, info = encode_leaf(x, k)
    arrays[k] = arr
    infos.append(info)


def spec_to_json(spec):
  out = []
  for e in tuple(spec):
    if e is None or isinstance(e, str):
      out.append(e)
    else:
      out.append(list(e))
  return out


# ----------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------
CASES = []


def case(fn):
  CASES.append((fn.__name__.replace("case_", "", 1), fn))
  return fn


def make_mesh(shape, names):
  from jax.sharding import Mesh
  n = int(np.prod(shape))
  devs = jax.devices()
  if len(devs) < n:
    raise Skip(f"need {n} devices, have {len(devs)}")
  return Mesh(np.array(devs[:n]).reshape(shape), names)


@case
def case_simple_f32():
  f = jax.jit(lambda x: jnp.sin(x) + 1)
  exp = export(f, sds((4,), jnp.float32))
  return dict(exp=exp, args=(np.arange(4, dtype=np.float32) / 4,),
              description="jnp.sin(x) + 1 on f32[4]")


@case
def case_pytree_io():
  def f(d, lst, *, scale):
    x, (y, none_leaf) = d["a"], d["b"]
    assert none_leaf is None
    z, w = lst
    return {"sum": (x + y) * scale,
            "t": (z * 2, None, [w.astype(jnp.int32) + 1, {"k": x}])}
  specs_d = {"a": sds((2,), jnp.float32), "b": (sds((2,), jnp.float32), None)}
  specs_l = [sds((3,), jnp.float32), sds((2, 2), jnp.int16)]
  exp = export(jax.jit(f), specs_d, specs_l, scale=sds((), jnp.float32))
  args = ({"a": np.array([1., 2.], np.float32),
           "b": (np.array([10., 20.], np.float32), None)},
          [np.array([1., 2., 3.], np.float32),
           np.array([[1, 2], [3, 4]], np.int16)])
  kwargs = {"scale": np.float32(0.5)}
  return dict(exp=exp, args=args, kwargs=kwargs,
              description="dict/tuple/list inputs+outputs with None leaves and a kwarg")


def _sample(dtype_name, n=4):
  dt = jnp.dtype(dtype_name)
  if dtype_name == "bool":
    return np.array([True, False, True, True][:n])
  if dt.kind == "i" or dtype_name == "int4":
    return np.array([-1, 2, 3, 4][:n]).astype(dt)
  if dt.kind == "u" or dtype_name == "uint4":
    return np.array([1, 2, 3, 7][:n]).astype(dt)
  if dt.kind == "c":
    return np.array([1 + 2j, -1j, 0.5, 2][:n]).astype(dt)
  return np.array([1.0, 2.0, 4.0, 0.5][:n]).astype(dt)


def _dtypes_case(names):
  def f(*xs):
    return tuple((x, x.astype(jnp.float32) if x.dtype != jnp.complex64
                  else jnp.real(x)) for x in xs)
  specs = [sds((4,), jnp.dtype(n)) for n in names]
  exp = export(jax.jit(f), *specs)
  args = tuple(_sample(n) for n in names)
  return exp, args


@case
def case_many_dtypes():
  base = ["bool", "int8", "int16", "int32", "uint8", "uint32", "float16",
          "bfloat16", "float32", "complex64"]
  optional = ["float8_e4m3fn", "float8_e5m2"]
  names = list(base)
  notes = []
  for n in optional:
    if hasattr(jnp, n):
      names.append(n)
    else:
      notes.append(f"{n}: not in jax.numpy")
  exp, args = _dtypes_case(names)
  return dict(exp=exp, args=args, extra={"dtypes": names},
              notes=notes, description="identity + cast to f32 for each dtype")


@case
def case_exotic_dtypes():
  cands = ["int4", "uint4", "float8_e4m3b11fnuz", "float8_e4m3fnuz",
           "float8_e5m2fnuz", "float8_e4m3", "float8_e3m4", "float8_e8m0fnu",
           "float4_e2m1fn", "int2", "uint2"]
  names, notes = [], []
  for n in cands:
    if not hasattr(jnp, n):
      notes.append(f"{n}: not in jax.numpy")
      continue
    try:  # probe that the dtype exports, serializes and runs alone
      exp, args = _dtypes_case([n])
      ser = serialize(exp)
      jax.block_until_ready(exp.call(*args))
      deserialize(ser)
      names.append(n)
    except Exception as e:
      notes.append(f"{n}: {type(e).__name__}: {str(e)[:200]}")
  if not names:
    raise Skip("no exotic dtype usable: " + "; ".join(notes))
  exp, args = _dtypes_case(names)
  return dict(exp=exp, args=args, extra={"dtypes": names}, notes=notes,
              description="identity + cast to f32 for int4/float8 variants/etc.")


@case
def case_x64_dtypes():
  prev = bool(jax.config.jax_enable_x64)
  jax.config.update("jax_enable_x64", True)
  try:
    names = ["int64", "uint64", "float64", "complex128", "uint16"]
    def f(*xs):
      return tuple((x, x.astype(jnp.float64) if x.dtype != jnp.complex128
                    else jnp.real(x)) for x in xs)
    exp = export(jax.jit(f), *[sds((4,), jnp.dtype(n)) for n in names])
    args = tuple(_sample(n) for n in names)
  finally:
    jax.config.update("jax_enable_x64", prev)
  return dict(exp=exp, args=args, requires_x64=True,
              extra={"dtypes": names},
              description="64-bit dtypes; exported and called with jax_enable_x64=True")


def _symbolic_shape(spec, **kw):
  fn = getattr(jexport, "symbolic_shape", None)
  if fn is None:
    raise Skip("no symbolic_shape in export API")
  return fn(spec, **kw)


@case
def case_shape_poly():
  b, = _symbolic_shape("b")
  def f(x, y):
    return x * 2 + y[:, None], jnp.concatenate([y, y])
  exp = export(jax.jit(f), sds((b, 4), jnp.float32), sds((b,), jnp.float32))
  args = (np.arange(12, dtype=np.float32).reshape(3, 4),
          np.array([1., 2., 3.], np.float32))
  return dict(exp=exp, args=args,
              description='x: f32["b, 4"], y: f32["b"] -> (f32[b,4], f32[2*b]); called with b=3')


@case
def case_shape_poly_constraints():
  try:
    a, b = _symbolic_shape("a, b", constraints=("a >= b",))
  except TypeError as e:
    raise Skip(f"symbolic_shape has no constraints: {e}")
  def f(x):
    return jnp.concatenate([x, x], axis=0), x[:x.shape[1], :].sum(axis=0)
  exp = export(jax.jit(f), sds((a, b), jnp.float32))
  args = (np.arange(6, dtype=np.float32).reshape(3, 2),)
  return dict(exp=exp, args=args,
              description='symbolic_shape("a, b", constraints=("a >= b",)); called with (3, 2)')


@case
def case_sharded_8dev():
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = make_mesh((2, 4), ("x", "y"))
  in_specs = (P("x", "y"), P(("x", "y"), None))
  out_specs = (P("x", None), P())
  f = jax.jit(lambda x, y: (x * 2 + y, jnp.sum(y, axis=1)),
              in_shardings=tuple(NamedSharding(mesh, s) for s in in_specs),
              out_shardings=tuple(NamedSharding(mesh, s) for s in out_specs))
  exp = export(f, sds((8, 16), jnp.float32), sds((8, 16), jnp.float32))
  args = (np.arange(128, dtype=np.float32).reshape(8, 16),
          np.ones((8, 16), np.float32))
  return dict(exp=exp, args=args, mesh=mesh, in_specs=in_specs,
              extra={"out_specs": [spec_to_json(s) for s in out_specs]},
              description="mesh (2,4) ('x','y'); in P('x','y'), P(('x','y'),None); out P('x',None), P()")


@case
def case_sharded_1d_replicated():
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = make_mesh((8,), ("x",))
  in_specs = (P("x"),)
  f = jax.jit(lambda x: jnp.sum(x, axis=0),
              in_shardings=NamedSharding(mesh, P("x")),
              out_shardings=NamedSharding(mesh, P()))
  exp = export(f, sds((8, 16), jnp.float32))
  args = (np.arange(128, dtype=np.float32).reshape(8, 16),)
  return dict(exp=exp, args=args, mesh=mesh, in_specs=in_specs,
              extra={"out_specs": [[]]},
              description="mesh (8,) ('x',); in P('x'), replicated out P()")


@case
def case_vjp():
  def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)
  exp = export(jax.jit(loss), sds((3, 2), jnp.float32), sds((4, 3), jnp.float32))
  args = (np.arange(6, dtype=np.float32).reshape(3, 2) / 10,
          np.arange(12, dtype=np.float32).reshape(4, 3) / 10)
  return dict(exp=exp, args=args, vjp_order=1,
              description="scalar loss, serialized with vjp_order=1")


@case
def case_vjp_int_input():
  def loss(w, n):
    return jnp.sum(jnp.sin(w)) * n.astype(jnp.float32)
  exp = export(jax.jit(loss), sds((3,), jnp.float32), sds((), jnp.int32))
  args = (np.array([0.1, 0.2, 0.3], np.float32), np.int32(3))
  return dict(exp=exp, args=args, vjp_order=1,
              description="vjp with an int32 input (cotangent is float0)")


def _prng_case(impl):
  if not hasattr(jax.random, "key"):
    raise Skip("no jax.random.key (typed keys)")
  k = jax.random.key(0, impl=impl) if impl else jax.random.key(0)
  def f(key):
    return jax.random.normal(key, (3,)), jax.random.split(key)
  exp = export(jax.jit(f), sds(k.shape, k.dtype))
  return dict(exp=exp, args=(k,),
              extra={"key_impl": prng_impl_name(k)},
              description=f"typed PRNG key ({prng_impl_name(k)}) -> normal(key,(3,)), split(key)")


@case
def case_prng_key():
  return _prng_case(None)


@case
def case_prng_key_rbg():
  return _prng_case("rbg")


@case
def case_namedtuple_custom():
  reg = golden_types.register_serialization()
  if any(str(v).startswith("UNAVAILABLE") for v in reg.values()):
    raise Skip(f"serialization registration unavailable: {reg}")
  Point, Box = golden_types.Point, golden_types.Box
  def f(p, b):
    return (Point(p.x + 1, p.y * 2),
            Box(b.lo - 1, {"hi": b.hi + 1}, label=b.label + "-out"))
  p_spec = Point(sds((2,), jnp.float32), sds((), jnp.int32))
  b_spec = Box(sds((2,), jnp.float32), sds((3,), jnp.float32), label="in-label")
  exp = export(jax.jit(f), p_spec, b_spec)
  args = (Point(np.array([1., 2.], np.float32), np.int32(5)),
          Box(np.array([3., 4.], np.float32), np.array([1., 2., 3.], np.float32),
              label="in-label"))
  return dict(exp=exp, args=args,
              extra={"serialized_names": reg,
                     "box_auxdata_encoding": "utf-8 bytes of the label string",
                     "in_box_label": "in-label", "out_box_label": "in-label-out"},
              description="golden_types.Point (NamedTuple) and golden_types.Box (custom node)")


@case
def case_debug_print_effect():
  def f(x):
    jax.debug.print("x = {}", x)
    return x + 1
  try:
    exp = export(jax.jit(f), sds((2,), jnp.float32))
    serialize(exp)
  except Exception as e:
    raise Skip("jax.debug.print is not exportable: "
               f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
  return dict(exp=exp, args=(np.array([1., 2.], np.float32),),
              description="jax.debug.print inside exported function")


@case
def case_ordered_effects():
  try:
    eff = golden_types.setup_testing_effects()
  except Exception as e:
    raise Skip(f"private effect APIs unavailable: {type(e).__name__}: {e}")
  def f(x):
    y = eff["bind"](x, "ordered")
    return eff["bind"](y, "unordered") + 1
  exp = export(jax.jit(f), sds((3,), jnp.float32))
  return dict(exp=exp, args=(np.array([1., 2., 3.], np.float32),),
              extra={"effect_type_names": [str(eff["ordered"]), str(eff["unordered"])],
                     "private_api": True},
              description="testing effects defined via JAX private APIs "
                          "(golden_types.setup_testing_effects); the deserializer "
                          "must import golden_types and call setup_testing_effects()")


def _disabled_checks_case(which):
  DSC = getattr(jexport, "DisabledSafetyCheck", None)
  if DSC is None:
    raise Skip("no DisabledSafetyCheck")
  checks, notes = [], []
  for name, a in which:
    fn = getattr(DSC, name, None)
    if fn is None:
      notes.append(f"DisabledSafetyCheck.{name} missing")
      continue
    try:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checks.append(fn(*a))
    except Exception as e:
      notes.append(f"DisabledSafetyCheck.{name}: {type(e).__name__}: {e}")
  if not checks:
    raise Skip("; ".join(notes) or "no checks")
  exp = export(jax.jit(lambda x: x * 3), sds((2,), jnp.float32),
               disabled_checks=checks)
  return dict(exp=exp, args=(np.array([1., 2.], np.float32),), notes=notes,
              extra={"disabled_checks_requested": [str(c) for c in checks]},
              description="export with disabled_checks=" + str([str(c) for c in checks]))


@case
def case_disabled_checks():
  return _disabled_checks_case((("custom_call", ("golden_fake_target",)),
                                ("platform", ())))


@case
def case_disabled_checks_shape_assertions():
  # DisabledSafetyCheck.shape_assertions() (kind 2 in the flatbuffer) was
  # deprecated / removed in later releases.
  return _disabled_checks_case((("shape_assertions", ()),))


@case
def case_multi_platform():
  last = None
  for plats in (("cpu", "cuda", "tpu"), ("cpu", "cuda")):
    try:
      exp = export(jax.jit(lambda x: jnp.cos(x) * 2), sds((3,), jnp.float32),
                   platforms=plats)
      return dict(exp=exp, args=(np.array([0., 1., 2.], np.float32),),
                  description=f"lowered for platforms={plats}, called on cpu")
    except Exception as e:
      last = e
  raise Skip(f"multi-platform lowering failed: {type(last).__name__}: {last}")


@case
def case_scalar_and_zero_size():
  def f(s, z, i):
    return s * 2, z + s, jnp.sum(z) + s, i + 1
  exp = export(jax.jit(f), sds((), jnp.float32), sds((0, 3), jnp.float32),
               sds((), jnp.int32))
  args = (np.float32(1.5), np.zeros((0, 3), np.float32), np.int32(7))
  return dict(exp=exp, args=args, description="scalar f32[], zero-size f32[0,3], i32[]")


@case
def case_unused_input():
  exp = export(jax.jit(lambda x, unused, y: x * 2 + y),
               sds((2,), jnp.float32), sds((5,), jnp.int32), sds((2,), jnp.float32))
  args = (np.array([1., 2.], np.float32), np.arange(5, dtype=np.int32),
          np.array([3., 4.], np.float32))
  return dict(exp=exp, args=args,
              description="middle input unused -> module_kept_var_idx excludes it")


@case
def case_weak_type():
  try:
    spec = sds((), jnp.float32, weak_type=True)
  except TypeError as e:
    raise Skip(f"ShapeDtypeStruct has no weak_type: {e}")
  exp = export(jax.jit(lambda s, x: x * s), spec, sds((3,), jnp.float32))
  return dict(exp=exp, args=(np.float32(2.0), np.array([1., 2., 3.], np.float32)),
              description="weak-typed f32[] scalar input (weak_type is not in the "
                          "flatbuffer; it shows in the in_avals string)")


@case
def case_memory_space():
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = make_mesh((1,), ("x",))
  try:
    s_host = NamedSharding(mesh, P(), memory_kind="pinned_host")
  except Exception as e:
    raise Skip(f"NamedSharding(memory_kind=...) unsupported: {type(e).__name__}: {e}")
  s_dev = NamedSharding(mesh, P())
  variants = (("pinned_host", "device"), ("pinned_host", "pinned_host"),
              ("device", "pinned_host"))
  notes, exp = [], None
  for in_k, out_k in variants:
    s_in = s_host if in_k != "device" else s_dev
    s_out = s_host if out_k != "device" else s_dev
    try:
      f = jax.jit(lambda x: x * 2, in_shardings=(s_in,), out_shardings=s_out)
      e = export(f, sds((4,), jnp.float32, sharding=s_in))
      jax.block_until_ready(e.call(jax.device_put(np.arange(4, dtype=np.float32), s_in)))
      exp = e
      break
    except Exception as ex:
      notes.append(f"variant in={in_k} out={out_k}: {type(ex).__name__}: "
                   f"{str(ex).splitlines()[0][:200]}")
  if exp is None:
    raise Skip("no memory-kind variant exports+runs: " + " | ".join(notes))
  avals = [str(a) for a in list(exp.in_avals) + list(exp.out_avals)]
  ms = [str(getattr(a, "memory_space", None)) for a in list(exp.in_avals) + list(exp.out_avals)]
  if not any("host" in a.lower() for a in avals + ms):
    note = ["pinned_host memory kind is not reflected in the avals of this release"]
  else:
    note = []
  return dict(exp=exp, args=(np.arange(4, dtype=np.float32),),
              mesh=mesh, in_specs=(P(),),
              in_memory_kinds=(None if in_k == "device" else in_k,),
              notes=notes + note,
              extra={"aval_memory_spaces": ms, "memory_kinds": {"in": in_k, "out": out_k}},
              description=f"1-device mesh; x*2 with input memory kind {in_k}, output {out_k}")


# ----------------------------------------------------------------------------
# Runner
# ----------------------------------------------------------------------------
def _exp_attr_strings(exp):
  out = {}
  for name in ("fun_name", "in_tree", "out_tree", "in_avals", "out_avals",
               "in_shardings_hlo", "out_shardings_hlo", "in_shardings",
               "out_shardings", "_in_named_shardings", "_out_named_shardings",
               "_has_named_shardings", "nr_devices", "platforms",
               "lowering_platforms", "ordered_effects", "unordered_effects",
               "disabled_safety_checks", "disabled_checks",
               "calling_convention_version", "mlir_module_serialization_version",
               "module_kept_var_idx", "uses_global_constants",
               "uses_shape_polymorphism"):
    try:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        v = getattr(exp, name)
    except Exception:
      continue
    if callable(v) and not isinstance(v, (tuple, list)):
      continue
    if isinstance(v, (bool, int, str)) or v is None:
      out[name] = v
    elif isinstance(v, (tuple, list)):
      out[name] = [x if isinstance(x, (bool, int, str)) or x is None else str(x)
                   for x in v]
    else:
      out[name] = str(v)
  return out


def _place_leaves(leaves, spec):
  mesh = spec.get("mesh")
  if mesh is None:
    return leaves
  from jax.sharding import NamedSharding, PartitionSpec as P
  in_specs = spec.get("in_specs") or ()
  kinds = spec.get("in_memory_kinds") or ()
  out = []
  for i, x in enumerate(leaves):
    ps = in_specs[i] if i < len(in_specs) else P()
    mk = kinds[i] if i < len(kinds) else None
    s = NamedSharding(mesh, ps, memory_kind=mk) if mk else NamedSharding(mesh, ps)
    out.append(jax.device_put(x, s))
  return out


def _call(exp, args, kwargs):
  return exp.call(*args, **kwargs)


def run_case(name, fn, out_dir, mod_info):
  entry = {"name": name, "jax_version": JAX_VERSION, "jaxlib_version": JAXLIB_VERSION,
           "module_serialization_version": mod_info["serialization_version"]}
  try:
    spec = fn()
  except Skip as e:
    entry.update(status="skipped", reason=str(e))
    return entry
  except Exception as e:
    entry.update(status="skipped",
                 reason=f"export failed: {type(e).__name__}: {str(e)[:500]}",
                 traceback=traceback.format_exc()[-2000:])
    return entry
  exp = spec["exp"]
  args = spec.get("args", ())
  kwargs = spec.get("kwargs", {})
  vjp_order = spec.get("vjp_order", 0)
  entry["description"] = spec.get("description", "")
  entry["notes"] = list(spec.get("notes", []))
  try:
    ser = serialize(exp, vjp_order)
  except Exception as e:
    entry.update(status="skipped",
                 reason=f"serialize failed: {type(e).__name__}: {str(e)[:500]}")
    return entry
  entry["status"] = "ok"
  entry["file"] = f"{name}.bin"
  entry["io_file"] = f"{name}.io.npz"
  entry["bin_size"] = len(ser)
  entry["calling_convention_version"] = getattr(exp, "calling_convention_version", None)
  entry["flatbuffer_serialization_version"] = flatbuffer_serialization_version(ser)
  entry["vjp_serialized"] = bool(vjp_order)
  entry["vjp_order"] = vjp_order
  entry["requires_x64"] = bool(spec.get("requires_x64", False))
  try:
    entry["has_vjp"] = bool(exp.has_vjp())
  except Exception:
    entry["has_vjp"] = None
  entry["exported"] = _exp_attr_strings(exp)
  entry["nr_devices"] = entry["exported"].get("nr_devices")
  entry["platforms"] = entry["exported"].get(
      "platforms", entry["exported"].get("lowering_platforms"))
  entry["in_avals"] = entry["exported"].get("in_avals")
  entry["out_avals"] = entry["exported"].get("out_avals")
  entry["in_shardings"] = entry["exported"].get(
      "_in_named_shardings", entry["exported"].get(
          "in_shardings_hlo", entry["exported"].get("in_shardings")))
  entry["out_shardings"] = entry["exported"].get(
      "_out_named_shardings", entry["exported"].get(
          "out_shardings_hlo", entry["exported"].get("out_shardings")))
  entry["in_shardings_hlo"] = entry["exported"].get(
      "in_shardings_hlo", entry["exported"].get("in_shardings"))
  entry["out_shardings_hlo"] = entry["exported"].get(
      "out_shardings_hlo", entry["exported"].get("out_shardings"))
  if spec.get("mesh") is not None:
    m = spec["mesh"]
    entry["call_mesh"] = {"shape": [int(d) for d in m.devices.shape],
                          "axis_names": list(m.axis_names)}
    entry["call_in_specs"] = [spec_to_json(s) for s in spec.get("in_specs", ())]
    entry["call_in_memory_kinds"] = list(spec.get("in_memory_kinds") or [])
    entry["call_note"] = ("inputs must be device_put to NamedSharding(Mesh(devices[:n]"
                          ".reshape(call_mesh.shape), call_mesh.axis_names), "
                          "P(*call_in_specs[i]), memory_kind=call_in_memory_kinds[i])")
  entry.update(spec.get("extra", {}))

  with open(os.path.join(out_dir, entry["file"]), "wb") as f:
    f.write(ser)

  arrays, in_infos, out_infos = {}, [], []
  in_leaves = jax.tree_util.tree_leaves((tuple(args), dict(kwargs)))
  encode_leaves(in_leaves, "in", arrays, in_infos)
  entry["inputs"] = in_infos

  prev_x64 = bool(jax.config.jax_enable_x64)
  if entry["requires_x64"]:
    jax.config.update("jax_enable_x64", True)
  try:
    placed = _place_leaves(in_leaves, spec)
    cargs, ckwargs = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure((tuple(args), dict(kwargs))), placed)
    res = _call(exp, cargs, ckwargs)
    out_leaves = [np.asarray(x) if not is_prng_key(x) else x
                  for x in jax.tree_util.tree_leaves(res)]
    encode_leaves(out_leaves, "out", arrays, out_infos)
    entry["outputs"] = out_infos
    entry["out_tree_of_call"] = str(jax.tree_util.tree_structure(res))
  except Exception as e:
    entry["status"] = "call_failed"
    entry["call_error"] = f"{type(e).__name__}: {str(e)[:500]}"
    entry["traceback"] = traceback.format_exc()[-2000:]
    out_leaves = None
  # Round trip within the same release.
  if out_leaves is not None:
    try:
      exp2 = deserialize(ser)
      res2 = _call(exp2, cargs, ckwargs)
      l2 = jax.tree_util.tree_leaves(res2)
      ok = len(l2) == len(out_leaves)
      for a, b in zip(out_leaves, l2):
        ea, _ = encode_leaf(a, "a")
        eb, _ = encode_leaf(b, "b")
        ok = ok and ea.shape == eb.shape and bool(np.array_equal(ea, eb))
      entry["same_release_roundtrip"] = "ok" if ok else "mismatch"
    except Exception as e:
      entry["same_release_roundtrip"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
  # VJP.
  if vjp_order and out_leaves is not None:
    try:
      vexp = exp.vjp()
      cts = [np.ones(np.shape(o), np.asarray(o).dtype) for o in out_leaves]
      vin = list(in_leaves) + cts
      vres = vexp.call(*vin)
      vout = [np.asarray(x) for x in jax.tree_util.tree_leaves(vres)]
      vin_infos, vout_infos = [], []
      encode_leaves(vin, "vjp_in", arrays, vin_infos)
      encode_leaves(vout, "vjp_out", arrays, vout_infos)
      entry["vjp_call"] = {
          "how": ("vexp = exp.vjp(); vexp.call(*primal_in_leaves, *out_cotangent_leaves) "
                  "with cotangents = ones_like(out leaves); vjp_in_i are the flat "
                  "call args, vjp_out_i the flat result leaves (input cotangents)"),
          "vjp_in_avals": [str(a) for a in vexp.in_avals],
          "vjp_out_avals": [str(a) for a in vexp.out_avals],
          "inputs": vin_infos, "outputs": vout_infos}
    except Exception as e:
      entry["vjp_call"] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
  if entry["requires_x64"]:
    jax.config.update("jax_enable_x64", prev_x64)
  np.savez_compressed(os.path.join(out_dir, entry["io_file"]), **arrays)
  return entry


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--out-dir", required=True)
  ap.add_argument("--cases", nargs="*", default=None)
  a = ap.parse_args(argv)
  os.makedirs(a.out_dir, exist_ok=True)
  mod_info = module_serialization_info()
  import ml_dtypes  # jax dependency
  entries = []
  for name, fn in CASES:
    if a.cases and name not in a.cases:
      continue
    e = run_case(name, fn, a.out_dir, mod_info)
    print(f"[jax {JAX_VERSION}] {name}: {e['status']}"
          + (f" ({e.get('reason') or e.get('call_error')})"
             if e["status"] != "ok" else ""), flush=True)
    entries.append(e)
  manifest = {
      "jax_version": JAX_VERSION,
      "jaxlib_version": JAXLIB_VERSION,
      "numpy_version": np.__version__,
      "ml_dtypes_version": getattr(ml_dtypes, "__version__", None),
      "python_version": platform.python_version(),
      "export_api_module": jexport.__name__,
      "module_serialization_version": mod_info["serialization_version"],
      "serialization_module": mod_info["module"],
      "serialization_module_version_constants": mod_info["constants"],
      "serialization_module_version_history": mod_info["history"],
      "devices": [str(d) for d in jax.devices()],
      "env": {k: os.environ.get(k) for k in ("XLA_FLAGS", "JAX_PLATFORMS")},
      "npz_layout": ("<case>.io.npz keys in_i/out_i (and vjp_in_i/vjp_out_i): leaves "
                     "of jax.tree_util.tree_leaves((args, kwargs)) and of the result. "
                     "Non-npz dtypes stored as a same-size uint view ('stored_as'); "
                     "PRNG keys stored as key_data with 'prng_impl'; float0 stored "
                     "as bool zeros."),
      "call": ("args, kwargs = tree_unflatten(exp.in_tree, in_leaves); "
               "result = exp.call(*args, **kwargs); outputs = tree_leaves(result). "
               "Cases with call_mesh: device_put leaves first (see call_note). "
               "Cases with requires_x64: run with jax_enable_x64=True."),
      "cases": entries,
  }
  with open(os.path.join(a.out_dir, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=1, sort_keys=False, default=str)
  return 0


if __name__ == "__main__":
  sys.exit(main())
