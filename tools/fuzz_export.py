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
jax.export.deserialize on each mutant and tallies its exception types; it
runs in a child process, since some mutants make XLA abort the process or
loop for ever (tallied as "aborted" and "hung": the child is restarted).
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


JAX_TIMEOUT = 20.0  # seconds jax.export.deserialize may take on a mutant


def _jax_child(conn) -> None:
    """Decode each mutant received with jax.export.deserialize; reply with
    "accepted" or the exception's type name."""
    import golden_types
    golden_types.register_serialization()
    golden_types.setup_testing_effects()
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        try:
            jax.export.deserialize(bytearray(data))
            conn.send("accepted")
        except Exception as e:  # noqa: BLE001 - what is tallied
            conn.send(type(e).__name__)


class JaxDecoder:
    """jax.export.deserialize in a child process that may die or hang."""

    def __init__(self):
        import multiprocessing as mp
        self._ctx = mp.get_context("spawn")
        self._proc = self._conn = None

    def _start(self) -> None:
        self._conn, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_jax_child, args=(child,),
                                       daemon=True)
        self._proc.start()
        child.close()

    def outcome(self, data: bytes) -> str:
        if self._proc is None:
            self._start()
        try:
            self._conn.send_bytes(data)
            if self._conn.poll(JAX_TIMEOUT):
                return self._conn.recv()
            what = "hung"
        except (EOFError, OSError):
            what = "aborted"
        self.close()  # (dead, or killed now): the next mutant starts anew
        return what

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(10)
            self._conn.close()
            self._proc = self._conn = None


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
    jax_decoder = JaxDecoder() if compare_jax else None
    try:
        _fuzz(seeds, n, rng, slow, counts, failures, jax_decoder, jax_counts)
    finally:
        if jax_decoder is not None:
            jax_decoder.close()
    return counts, failures, jax_counts


def _fuzz(seeds, n, rng, slow, counts, failures, jax_decoder, jax_counts):
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
        if jax_decoder is not None:
            jax_counts[jax_decoder.outcome(data)] += 1


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
