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
    return 0 if ok else 1
