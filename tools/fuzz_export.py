"""Mutation fuzzing of JAX export payloads: only PayloadError may come out.

    python tools/fuzz_export.py --mutations 100000 [--seed 0] [--compare-jax]

Seeds are golden payloads of every JAX release (tests/golden/jax_export)
plus jaxcolo-written payloads of every serialization version.  Each mutant
(byte flips, truncations, splices, integer overwrites: the mutator of
tools/fuzz_payloads.py) goes through jaxcolo.export.deserialize,
serialization_version and readable_by.  Any exception other than
PayloadError, or a call slower than --slow seconds, is a failure.  JAX
payloads have no checksum, so many mutants (bytes inside blobs and strings)
still decode: those count as "accepted".  --compare-jax also runs
jax.export.deserialize on each mutant and tallies its exception types.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import collections  # noqa: E402
import glob  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "jax_golden"))
sys.dont_write_bytecode = True

import jax  # noqa: E402

import jaxcolo  # noqa: E402
import jaxcolo.export as je  # noqa: E402
from fuzz_payloads import mutate  # noqa: E402

MAX_SEED_BYTES = 6000


def seed_payloads() -> list[bytes]:
    """Small golden payloads of every release, and every writable version
    of a few of them."""
    import golden_types
    golden_types.register_serialization()
    golden_types.setup_testing_effects()
    seeds = []
    for f in sorted(glob.glob(os.path.join(ROOT, "tests", "golden",
                                           "jax_export", "jax-*", "*.bin"))):
        data = open(f, "rb").read()
        if len(data) <= MAX_SEED_BYTES:
            seeds.append(data)
    base = [s for s in seeds if b"Point" in s or b"key" in s][:2] + seeds[-8:]
    for data in base:
        exp = je.deserialize(data)
        for v in range(je.MIN_VERSION, je.MAX_VERSION + 1):
            try:
                seeds.append(bytes(je.serialize(
                    exp, vjp_order=1 if exp.has_vjp() else 0, version=v)))
            except jaxcolo.EncodeError:
                pass
    return seeds


def _one(data):
    je.deserialize(data)
    je.serialization_version(data)
    je.readable_by(data)


def run(seeds, n: int, rng: random.Random, slow: float = 2.0,
        compare_jax: bool = False):
    """(outcome counts, failures, jax outcome counts)."""
    counts = collections.Counter()
    jax_counts = collections.Counter()
    failures = []
    for i in range(n):
        data = mutate(rng.choice(seeds), rng)
        t0 = time.perf_counter()
        try:
            _one(data)
            counts["accepted"] += 1
        except jaxcolo.PayloadError:
            counts["PayloadError"] += 1
        except Exception as e:  # the bug this tool hunts
            counts[type(e).__name__] += 1
            failures.append((data, traceback.format_exc()))
        dt = time.perf_counter() - t0
        if dt > slow:
            failures.append((data, f"slow: {dt:.1f}s"))
        if compare_jax:
            try:
                jax.export.deserialize(bytearray(data))
                jax_counts["accepted"] += 1
            except Exception as e:
                jax_counts[type(e).__name__] += 1
    return counts, failures, jax_counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mutations", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slow", type=float, default=2.0)
    ap.add_argument("--compare-jax", action="store_true")
    ap.add_argument("--save-failures", metavar="DIR")
    args = ap.parse_args(argv)
    seeds = seed_payloads()
    t0 = time.perf_counter()
    counts, failures, jax_counts = run(seeds, args.mutations,
                                       random.Random(args.seed), args.slow,
                                       args.compare_jax)
    dt = time.perf_counter() - t0
    print(f"{args.mutations} mutations of {len(seeds)} seeds in {dt:.0f}s: "
          f"{dict(counts)}")
    if args.compare_jax:
        print(f"jax.export.deserialize on the same mutants: "
              f"{dict(jax_counts)} ({len(jax_counts) - 1} exception types)")
    for data, tb in failures[:5]:
        print("FAILURE:", tb)
    if args.save_failures and failures:
        os.makedirs(args.save_failures, exist_ok=True)
        for k, (data, _) in enumerate(failures):
            open(os.path.join(args.save_failures, f"fail{k}.bin"), "wb") \
                .write(data)
    print(f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
