"""Benchmark: jaxcolo colocated calls vs jax.experimental.colocated_python.

Same process, same devices, same functions:

* warm call overhead: a function returning its input, called repeatedly
  after the first call (median of rounds of N calls, per call), with 1 to
  100 array arguments (jaxcolo checks every output against its out spec,
  JAX's CPU path does not: that per-leaf check is most of the gap at 100);
* first-call latency: a fresh function's first call, which discovers the
  output specs (both libraries run it synchronously), median over fresh
  functions.

    python tools/bench_colocated.py [--calls 2000] [--rounds 7] [--fresh 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8")


def _warm(fn, args, calls: int, rounds: int) -> float:
    fn(*args)
    fn(*args)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _first(make, wrap, args, fresh: int) -> float:
    times = []
    for _ in range(fresh):
        f = wrap(make())
        t0 = time.perf_counter()
        f(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--fresh", type=int, default=30)
    args = ap.parse_args(argv)

    import jax
    import numpy as np
    from jax.experimental import colocated_python as jcp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jaxcolo

    devs = jax.devices()
    x1 = jax.device_put(np.arange(4.0), devs[0])
    mesh = Mesh(np.array(devs[:4]), ("x",))
    tree = {"a": jax.device_put(np.arange(8.0), NamedSharding(mesh, P("x"))),
            "b": [jax.device_put(np.arange(4), NamedSharding(mesh, P())),
                  jax.device_put(np.ones((4, 4)), NamedSharding(mesh, P("x")))]}
    cases = {"1 array": (x1,), "3-leaf tree on 4 devices": (tree,),
             "10 arrays": ([jax.device_put(np.float32(i), devs[0])
                            for i in range(10)],),
             "100 arrays": ([jax.device_put(np.float32(i), devs[0])
                             for i in range(100)],)}

    def make():
        def ident(x):
            return x
        return ident

    rows = []
    for label, call_args in cases.items():
        # Alternate the two libraries round by round: a shared machine's
        # noise then hits both alike.
        jfn, cfn = jcp.colocated_python(make()), jaxcolo.colocated_python(make())
        js, cs = [], []
        for _ in range(args.rounds):
            js.append(_warm(jfn, call_args, args.calls, 1))
            cs.append(_warm(cfn, call_args, args.calls, 1))
        rows.append(("warm call", label, statistics.median(js),
                     statistics.median(cs)))
        jf = _first(make, jcp.colocated_python, call_args, args.fresh)
        cf = _first(make, jaxcolo.colocated_python, call_args, args.fresh)
        rows.append(("first call (discovery)", label, jf, cf))

    print(f"jax {jax.__version__}, jaxcolo schema v{jaxcolo.SCHEMA_VERSION}, "
          f"{len(devs)} CPU devices, python {sys.version.split()[0]}")
    print(f"{'measure':24} {'arguments':26} {'jax':>10} {'jaxcolo':>10} "
          f"{'ratio':>7}")
    worst_warm = 0.0
    for what, label, j, c in rows:
        ratio = c / j
        if what == "warm call":
            worst_warm = max(worst_warm, ratio)
        print(f"{what:24} {label:26} {j * 1e6:8.1f}us {c * 1e6:8.1f}us "
              f"{ratio:6.2f}x")
    target = 1.2
    print(f"warm-call target <= {target}x: "
          f"{'met' if worst_warm <= target else 'NOT met'} in every case "
          f"(worst {worst_warm:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
