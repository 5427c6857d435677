"""Benchmark jaxcolo.export against jax.export, in the same process.

    python tools/bench_export.py [--sizes 1 10 100 1000] [--repeat 20]

For each N: a jitted function of N inputs / N outputs (f32[8,16], half of
them sharded over an 8-device mesh), exported once; then the median time of
serialize (vjp_order=0) and deserialize for both libraries, and the ratio
jaxcolo / jax (target <= 0.5).  Both serializers write the same bytes (checked).
Nothing is cached between calls beyond what each library caches itself.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxcolo.export as je  # noqa: E402


def make_exported(n: int):
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    shardings = [NamedSharding(mesh, P("x", "y")) if i % 2 else
                 NamedSharding(mesh, P()) for i in range(n)]
    args = [jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=s)
            for s in shardings]

    def f(*xs):
        return tuple(x * 2 for x in xs)
    return jax.export.export(jax.jit(f, in_shardings=tuple(shardings),
                                     out_shardings=tuple(shardings)))(*args)


def timeit(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="*", default=[1, 10, 100, 1000])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__}; median of {args.repeat}; times in ms")
    print(f"{'N':>5} {'ser jax':>9} {'ser jxc':>9} {'ratio':>6} "
          f"{'de jax':>9} {'de jxc':>9} {'ratio':>6} {'bytes':>8}")
    for n in args.sizes:
        exp = make_exported(n)
        ref = exp.serialize()
        data = je.serialize(exp)
        assert bytes(ref) == bytes(data), "serializers disagree"
        s_jax = timeit(lambda: exp.serialize(), args.repeat)
        s_jxc = timeit(lambda: je.serialize(exp), args.repeat)
        d_jax = timeit(lambda: jax.export.deserialize(ref), args.repeat)
        d_jxc = timeit(lambda: je.deserialize(data), args.repeat)
        print(f"{n:>5} {s_jax * 1e3:9.3f} {s_jxc * 1e3:9.3f} "
              f"{s_jxc / s_jax:6.2f} {d_jax * 1e3:9.3f} {d_jxc * 1e3:9.3f} "
              f"{d_jxc / d_jax:6.2f} {len(data):8d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
