"""ProcessExecutor round trips vs their floors, measured in one run.

    python tools/bench_executor.py [--rounds 7] [--calls 500] [--json]

* scalar: a colocated identity call on an int32 scalar, through a
  ProcessExecutor(num_hosts=1) worker, vs a bare multiprocessing Pipe round
  trip of 200 bytes to an echoing child process (target: <= 3x);
* jax floor: the least any such call can cost with real jax.Arrays on both
  sides -- the scalar's bytes over a raw Pipe to a child that makes a
  jax.Array of them and sends its bytes back, made a jax.Array again; no
  payloads, no bookkeeping, both ends spinning 200 us as the executor's
  channels do (reported for context: it bounds what the target can mean);
* 64 MiB: a colocated identity call on a 64 MiB float32 array (to the worker
  and back) vs a memcpy (np.copyto into a warm buffer) of the same 64 MiB;
  the ratio is memcpy time / round-trip time, i.e. the round trip's
  bandwidth as a fraction of memcpy bandwidth, counting the 64 MiB once
  (target: >= 0.3x).  Counting both directions doubles it.

Rounds interleave the measurements; medians over rounds are reported.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxcolo  # noqa: E402

BIG = 64 << 20


def _echo(conn):
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        conn.send_bytes(data)


def _identity(x):
    return x


SPIN = 200e-6  # as the executor's channels: spin this long, then block


def _wait_readable(conn) -> None:
    end = time.perf_counter() + SPIN
    while not conn.poll(0):
        if time.perf_counter() > end:
            conn.poll(None)
            return


def _jax_echo(conn):
    """The least a colocated scalar call must do on the worker: bytes in,
    a jax.Array on a device, its bytes out (no payloads, no bookkeeping)."""
    put = _scalar_put(jax.devices()[0])
    while True:
        _wait_readable(conn)
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        conn.send_bytes(np.asarray(put(data)).tobytes())


def _scalar_put(dev):
    """bytes -> an int32 scalar jax.Array on ``dev``, the cheapest way JAX
    offers (``jax.device_put`` costs ~25 us more per call)."""
    from jax._src.interpreters import pxla
    aval = jax.core.ShapedArray((), np.int32)
    sharding = jax.sharding.SingleDeviceSharding(dev)
    return lambda data: pxla.batched_device_put(
        aval, sharding, [np.frombuffer(data, np.int32).reshape(())], [dev])


def bench_jax_floor(conn, x, dev, n: int) -> float:
    """The least a scalar call costs with real jax.Arrays on both sides
    (the controller's conversions, a raw Pipe, the worker's _jax_echo)."""
    put = _scalar_put(dev)
    t = time.perf_counter()
    for _ in range(n):
        conn.send_bytes(np.asarray(x).tobytes())
        _wait_readable(conn)
        out = put(conn.recv_bytes())
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n


def bench_pipe(conn, n: int) -> float:
    msg = b"x" * 200
    t = time.perf_counter()
    for _ in range(n):
        conn.send_bytes(msg)
        conn.recv_bytes()
    return (time.perf_counter() - t) / n


def bench_calls(f, x, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        out = f(x)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n


def bench_memcpy(src, dst, n: int = 3) -> float:
    best = []
    for _ in range(n):
        t = time.perf_counter()
        np.copyto(dst, src)
        best.append(time.perf_counter() - t)
    return min(best)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--big-calls", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    echo = ctx.Process(target=_echo, args=(child,), daemon=True)
    echo.start()

    floor_parent, floor_child = mp.get_context("spawn").Pipe()
    floor = mp.get_context("spawn").Process(target=_jax_echo,
                                            args=(floor_child,), daemon=True)
    floor.start()

    dev = jax.devices()[0]
    x = jax.device_put(np.int32(7), dev)
    host_big = np.arange(BIG // 4, dtype=np.float32)
    big = jax.device_put(host_big, dev)
    src, dst = np.asarray(big), np.empty_like(host_big)
    f = jaxcolo.colocated_python(_identity).specialize(out_specs_fn=_identity)

    rows = {"pipe_us": [], "scalar_us": [], "memcpy_ms": [], "big_ms": [],
            "floor_us": []}
    with jaxcolo.ProcessExecutor(num_hosts=1) as ex, jaxcolo.use_executor(ex):
        bench_calls(f, x, 200)           # warm: program sent, body loaded
        bench_pipe(parent, 200)
        bench_jax_floor(floor_parent, x, dev, 200)
        out = f(big)                      # warm: shared memory mapped
        assert np.array_equal(np.asarray(out), host_big)
        del out
        bench_calls(f, big, 2)
        for _ in range(args.rounds):
            rows["pipe_us"].append(bench_pipe(parent, args.calls) * 1e6)
            rows["scalar_us"].append(bench_calls(f, x, args.calls) * 1e6)
            rows["floor_us"].append(
                bench_jax_floor(floor_parent, x, dev, args.calls) * 1e6)
            rows["memcpy_ms"].append(bench_memcpy(src, dst) * 1e3)
            rows["big_ms"].append(bench_calls(f, big, args.big_calls) * 1e3)
        host = ex.stats()["hosts"][0]
    parent.close()
    floor_parent.close()
    echo.join(5)
    floor.join(5)

    med = {k: statistics.median(v) for k, v in rows.items()}
    scalar_ratio = med["scalar_us"] / med["pipe_us"]
    bw_ratio = med["memcpy_ms"] / med["big_ms"]
    result = {
        "pipe_round_trip_us": round(med["pipe_us"], 1),
        "scalar_call_us": round(med["scalar_us"], 1),
        "scalar_vs_pipe": round(scalar_ratio, 2),
        "scalar_target": "<= 3x",
        "jax_floor_us": round(med["floor_us"], 1),
        "jax_floor_vs_pipe": round(med["floor_us"] / med["pipe_us"], 2),
        "scalar_vs_jax_floor": round(med["scalar_us"] / med["floor_us"], 2),
        "memcpy_64MiB_ms": round(med["memcpy_ms"], 2),
        "memcpy_GBps": round(BIG / med["memcpy_ms"] / 1e6, 2),
        "round_trip_64MiB_ms": round(med["big_ms"], 2),
        "round_trip_GBps_one_way_bytes": round(BIG / med["big_ms"] / 1e6, 2),
        "bandwidth_vs_memcpy": round(bw_ratio, 2),
        "bandwidth_vs_memcpy_both_directions": round(2 * bw_ratio, 2),
        "bandwidth_target": ">= 0.3x",
        "worker_segments": host.get("segments"),
        "rounds": args.rounds,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k:40s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
