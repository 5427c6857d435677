"""Mutation fuzzing of jaxcolo payloads: only PayloadError may come out.

    python tools/fuzz_payloads.py --mutations 100000 [--seed 0] [--slow 2.0]

Each mutation applies random byte flips, truncations, splices, duplications
or integer overwrites to a seed payload (one per root kind and several spec
trees).  Half of the mutants get their checksum recomputed, so the structural
checks are exercised and not just the CRC.  Any exception other than
PayloadError, or a decode slower than --slow seconds, is reported as a failure.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import collections  # noqa: E402
import random  # noqa: E402
import struct  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import zlib  # noqa: E402

import jaxcolo  # noqa: E402
from jaxcolo import envelope  # noqa: E402


def fix_crc(data: bytes) -> bytes:
    if len(data) < envelope.HEADER_SIZE:
        return data
    crc = zlib.crc32(data[envelope.HEADER_SIZE:])
    return data[:12] + struct.pack("<I", crc) + data[16:]


def mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3, 8))):
        op = rng.randrange(7)
        if not b:
            break
        i = rng.randrange(len(b))
        if op == 0:  # bit flip
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1:  # random byte
            b[i] = rng.randrange(256)
        elif op == 2:  # truncate
            del b[i:]
        elif op == 3:  # splice a chunk from elsewhere
            j = rng.randrange(len(b))
            n = rng.randrange(1, 16)
            b[i:i + n] = b[j:j + n]
        elif op == 4:  # insert / delete bytes
            if rng.random() < 0.5:
                b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
            else:
                del b[i:i + rng.randrange(1, 8)]
        elif op == 5:  # overwrite a 32-bit value with an interesting one
            v = rng.choice((0, 1, 2, 3, 4, 0x7FFFFFFF, 0xFFFFFFFF, 0x80000000,
                            len(b), len(b) - 4, rng.randrange(1 << 32)))
            b[i:i + 4] = struct.pack("<I", v & 0xFFFFFFFF)[:len(b) - i]
        else:  # overwrite a 16-bit value (vtable entries)
            v = rng.choice((0, 2, 4, 0xFFFF, rng.randrange(1 << 16)))
            b[i:i + 2] = struct.pack("<H", v)[:len(b) - i]
    return bytes(b)


def seed_payloads() -> list[bytes]:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests import corpus
    objs = [corpus.everything(), corpus.meshes(), corpus.shardings(),
            corpus.avals(), corpus.pytrees(), corpus.misc()]
    # Plain bodies exercise the structural checks; compressed ones the
    # inflate path.
    seeds = [jaxcolo.serialize(o, compress=c) for o in objs
             for c in (False, True)]
    return seeds + other_root_kinds(corpus)


def other_root_kinds(corpus) -> list[bytes]:
    """Program, export bundle, hello and executor message payloads (bodies
    are never loaded by decoding)."""
    import jax
    from jaxcolo.colocated.program import encode_program
    from jaxcolo.transport import handshake
    sds = corpus.avals()[2]
    specs = jaxcolo.serialize(((sds,), {}), compress=False)
    out = []
    for kind, extra in (("function", {}),
                        ("method", {"method_name": "m", "instance_id": 7})):
        out.append(encode_program(
            name="f", kind=kind, body=b"\x80\x05N.", in_specs=specs,
            out_specs=specs, device_ids=[d.id for d in jax.devices()],
            **extra))
    out.append(handshake.encode_hello(handshake.local_hello(
        "worker", host_index=1, device_ids=range(4))))
    # Executor messages (every kind) and the export bundle: the current
    # version's golden ones.
    golden = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                          "tests", "golden", "spec",
                          f"v{jaxcolo.SCHEMA_VERSION}")
    for name in sorted(os.listdir(golden)):
        if name.startswith("message_") or name == "export_bundle.bin":
            with open(os.path.join(golden, name), "rb") as f:
                out.append(f.read())
    return out


def run(seeds, n: int, rng: random.Random, slow: float = 2.0):
    """Returns (counts of outcomes, list of failures)."""
    counts = collections.Counter()
    failures = []
    unchecked = run.unchecked = []
    for k in range(n):
        data = mutate(rng.choice(seeds), rng)
        if rng.random() < 0.5:
            data = fix_crc(data)
        t0 = time.perf_counter()
        try:
            jaxcolo.deserialize(data)
            counts["accepted"] += 1
        except jaxcolo.PayloadError as e:
            counts[type(e).__name__] += 1
            if str(e).startswith("malformed payload ("):
                counts["unchecked (caught by the safety net)"] += 1
                unchecked.append((data, str(e)))
            if " - at $" not in str(e):
                failures.append((data, f"no field path: {e}"))
        except Exception as e:  # noqa: BLE001 - this is what we hunt
            failures.append((data, "".join(traceback.format_exception(e))))
        if time.perf_counter() - t0 > slow:
            failures.append((data, f"slow decode {time.perf_counter() - t0:.1f}s"))
    return counts, failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mutations", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slow", type=float, default=2.0,
                    help="seconds a decode may take before it is a failure")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    seeds = seed_payloads()
    t0 = time.perf_counter()
    counts, failures = run(seeds, args.mutations, rng, args.slow)
    el = time.perf_counter() - t0
    print(f"{args.mutations} mutations of {len(seeds)} seed payloads in "
          f"{el:.0f}s: {dict(counts)}")
    for data, why in run.unchecked[:8]:
        print("UNCHECKED:", why[:300])
    for data, why in failures[:5]:
        print("FAIL:", why[-2000:], "\n  payload:", data.hex()[:200])
    print(f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
