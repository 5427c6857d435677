"""Benchmark jaxcolo spec payloads against the seed's way (colocated_python's
cloudpickle of ``(treedef, leaves)``), in one run.

    python tools/bench_codec.py [--seconds 0.3]

For N = 1, 10, 100, 1000 ShapeDtypeStruct leaves on shared NamedShardings
(a dict of a list and a tuple), prints encode time, decode time and size of

* seed: ``colocated_python.serialization._serialize((treedef, leaves))``;
* jaxcolo: ``jaxcolo.serialize(tree)`` -- the same information (the tree's
  structure is the treedef), decoded back to the tree;

twice: *cold*, with jaxcolo's payload memos off (every call does the whole
encode/decode work), and *warm*, with the memos on (the same spec tree encoded
and decoded again, as colocated calls do).  Ratios are jaxcolo / seed;
target <= 0.5.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.colocated_python import serialization as seed  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxcolo  # noqa: E402
from jaxcolo.codec import memo  # noqa: E402


def spec_tree(n: int):
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    shardings = [NamedSharding(mesh, P("x", "y")), NamedSharding(mesh, P(None, "y")),
                 NamedSharding(mesh, P())]
    dtypes = [np.dtype("float32"), jax.numpy.bfloat16, np.dtype("int32")]
    leaves = [jax.ShapeDtypeStruct((8 * (i % 5 + 1), 16), dtypes[i % 3],
                                   sharding=shardings[i % 3]) for i in range(n)]
    return {"params": leaves[: (n + 1) // 2],
            "opt_state": tuple(leaves[(n + 1) // 2:])}


def per_call(fn, seconds: float) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        k, t0 = 0, time.perf_counter()
        while True:
            fn()
            k += 1
            el = time.perf_counter() - t0
            if el > seconds / 5:
                break
        best = min(best, el / k)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=0.5)
    args = ap.parse_args()
    worst = {}
    for mode in ("cold", "warm"):
        memo.set_enabled(mode == "warm")
        print(f"\n{mode}: jaxcolo payload memos "
              f"{'on' if mode == 'warm' else 'off'}")
        print(f"{'N':>5} | {'seed enc':>9} {'seed dec':>9} {'seed B':>7} | "
              f"{'jxc enc':>9} {'jxc dec':>9} {'jxc B':>7} | "
              f"{'enc x':>6} {'dec x':>6} {'size x':>6}")
        worst[mode] = 0.0
        for n in (1, 10, 100, 1000):
            tree = spec_tree(n)
            leaves, treedef = jax.tree_util.tree_flatten(tree)
            obj = (treedef, leaves)
            sd = seed._serialize(obj)
            jd = jaxcolo.serialize(tree)
            back = seed._deserialize(sd)
            assert jaxcolo.deserialize(jd) == back[0].unflatten(back[1])
            se = per_call(lambda: seed._serialize(obj), args.seconds)
            sdc = per_call(lambda: seed._deserialize(sd), args.seconds)
            je = per_call(lambda: jaxcolo.serialize(tree), args.seconds)
            jdc = per_call(lambda: jaxcolo.deserialize(jd), args.seconds)
            r = (je / se, jdc / sdc, len(jd) / len(sd))
            worst[mode] = max(worst[mode], *r)
            print(f"{n:>5} | {se*1e6:8.1f}u {sdc*1e6:8.1f}u {len(sd):>7} | "
                  f"{je*1e6:8.1f}u {jdc*1e6:8.1f}u {len(jd):>7} | "
                  f"{r[0]:6.2f} {r[1]:6.2f} {r[2]:6.2f}")
    memo.set_enabled(True)
    print("\nworst ratio: " + ", ".join(
        f"{m} {w:.2f}" for m, w in worst.items()) + " (target <= 0.5)")


if __name__ == "__main__":
    main()
