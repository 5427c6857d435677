"""``jaxcolo demo``: serialize a realistic spec tree and read it back."""

from __future__ import annotations

import time


def realistic_spec_tree():
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    w = NamedSharding(mesh, P(None, "model"))
    rep = NamedSharding(mesh, P())
    act = NamedSharding(mesh, P("data", None))
    bf16 = jax.numpy.bfloat16
    layers = [{"attn": {"wq": jax.ShapeDtypeStruct((512, 512), bf16, sharding=w),
                        "wo": jax.ShapeDtypeStruct((512, 512), bf16, sharding=w)},
               "mlp": (jax.ShapeDtypeStruct((512, 2048), bf16, sharding=w),
                       jax.ShapeDtypeStruct((2048, 512), bf16, sharding=w)),
               "norm": jax.ShapeDtypeStruct((512,), np.float32, sharding=rep)}
              for _ in range(12)]
    batch, = jax.export.symbolic_shape("batch", constraints=("batch >= 1",))
    return {"params": layers,
            "batch": {"tokens": jax.ShapeDtypeStruct((batch, 128), np.int32),
                      "mask": jax.ShapeDtypeStruct((64, 128), np.bool_, sharding=act)},
            "rng": jax.ShapeDtypeStruct((), jax.random.key(0).dtype),
            "mesh": mesh}


def main() -> int:
    import json

    import jaxcolo

    tree = realistic_spec_tree()
    t0 = time.perf_counter()
    data = jaxcolo.serialize(tree)
    t1 = time.perf_counter()
    back = jaxcolo.deserialize(data)
    t2 = time.perf_counter()
    info = jaxcolo.inspect(data)
    summary = {k: info[k] for k in ("root_kind", "writer_version",
                                    "min_reader_version", "size", "tables",
                                    "num_leaves")}
    print("== spec payload ==")
    print(json.dumps(summary, indent=2))
    print(f"structure: {info['structure'][:160]}...")
    print(f"size {len(data)} bytes, schema version {info['writer_version']}, "
          f"encode {1e3 * (t1 - t0):.2f} ms, decode {1e3 * (t2 - t1):.2f} ms")
    ok = back == tree
    print(f"read back equal: {ok}")
    colocated_ok = colocated_demo()
    return 0 if ok and colocated_ok else 1


def _show_program(ref) -> None:
    import jaxcolo
    info = jaxcolo.inspect(ref.payload)
    print(f"  program {info['name']!r} ({info['kind']}), {info['size']} bytes, "
          f"devices {info['device_ids']}, body {info['body_size']} bytes "
          "of cloudpickle (not loaded)")
    for field in ("in_specs", "out_specs"):
        specs = info[field]
        if isinstance(specs, str):
            print(f"    {field}: {specs}")
            continue
        print(f"    {field}: {specs['structure']}")
        for leaf in specs["leaves"]:
            print(f"      {leaf}")


def colocated_demo() -> bool:
    """A colocated function and a colocated class, with their programs."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jaxcolo

    print("\n== colocated Python (InlineExecutor) ==")
    cpus = jaxcolo.colocated_cpu_devices(jax.devices()[:4])
    mesh = Mesh(np.array(cpus).reshape(2, 2), ("data", "model"))
    batch = jax.device_put(np.arange(16.0).reshape(4, 4),
                           NamedSharding(mesh, P("data")))
    words = jax.device_put(np.array(["colocated", "python"],
                                    dtype=np.dtypes.StringDType()),
                           NamedSharding(mesh, P("data")))

    @jaxcolo.colocated_python
    def summarize(x, names):
        # Runs on the host of the arrays' devices; string arrays are per shard.
        total = np.asarray(x).sum()
        upper = [jax.device_put(np.array([w.upper() for w in
                                          np.asarray(s.data)],
                                         dtype=np.dtypes.StringDType()),
                                s.device)
                 for s in names.addressable_shards]
        return {"total": jax.device_put(total, NamedSharding(mesh, P())),
                "names": jax.make_array_from_single_device_arrays(
                    names.shape, names.sharding, upper)}

    t0 = time.perf_counter()
    out = summarize(batch, words)
    t1 = time.perf_counter()
    out = summarize(batch, words)
    t2 = time.perf_counter()
    names = [str(w) for w in jax.device_get(out["names"])]
    print(f"summarize -> total={float(out['total'])}, names={names}; "
          f"first call (discovers out specs) {1e3 * (t1 - t0):.2f} ms, "
          f"second call {1e6 * (t2 - t1):.0f} us")
    for ref in summarize.programs():
        _show_program(ref)

    @jaxcolo.colocated_python_class
    class Counter:
        def __init__(self, start):
            self.count = start

        def add(self, x):
            self.count += int(np.asarray(x).sum())
            return jax.device_put(np.int32(self.count), x.sharding)

    counter = Counter(100)
    one = jax.device_put(np.int32(1), cpus[0])
    counter.add = counter.add.specialize(
        out_specs_fn=lambda x: jax.ShapeDtypeStruct((), np.int32,
                                                    sharding=x.sharding))
    values = [int(counter.add(one)) for _ in range(3)]
    print(f"Counter(100).add(1) x3 -> {values} (state lives on the host)")
    for ref in counter.add.programs():
        _show_program(ref)
    del counter
    return (values == [101, 102, 103] and
            names == ["COLOCATED", "PYTHON"] and
            float(out["total"]) == 120.0)
