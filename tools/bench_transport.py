"""Transport round trip vs a bare multiprocessing Pipe, in one run.

    python tools/bench_transport.py [--seconds 1]

Measures a 200-byte frame echoed by another process over (a) a bare
``multiprocessing.Pipe`` and (b) an authenticated jaxcolo Channel on loopback
TCP (after the hello handshake).  Ratio = channel / pipe (the executor target
for a whole scalar call is <= 3x the bare pipe).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KEY = b"bench-key"


def _pipe_echo(conn):
    while True:
        try:
            conn.send_bytes(conn.recv_bytes())
        except EOFError:
            return


def _channel_echo(q):
    from jaxcolo.errors import ExecutorError
    from jaxcolo.transport import handshake as hs
    from jaxcolo.transport.listener import Listener

    def on_channel(c):
        def loop():
            while True:
                try:
                    c.send(c.recv())
                except ExecutorError:
                    return
        threading.Thread(target=loop, daemon=True).start()
    lis = Listener("127.0.0.1:0", KEY, lambda: hs.local_hello("worker"),
                   on_channel)
    q.put(lis.address)
    threading.Event().wait()


def per_call(fn, seconds):
    for _ in range(100):
        fn()
    best = float("inf")
    for _ in range(5):
        k, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 5:
            fn()
            k += 1
        best = min(best, (time.perf_counter() - t0) / k)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=1.0)
    args = ap.parse_args()
    from jaxcolo.transport import channel as ch, handshake as hs
    frame = os.urandom(200)
    a, b = mp.Pipe()
    p = mp.Process(target=_pipe_echo, args=(b,), daemon=True)
    p.start()

    def pipe_rt():
        a.send_bytes(frame)
        a.recv_bytes()
    q = mp.Queue()
    w = mp.Process(target=_channel_echo, args=(q,), daemon=True)
    w.start()
    c = ch.connect(q.get(timeout=30), KEY, hs.local_hello("controller"))

    def channel_rt():
        c.send(frame)
        c.recv()
    tp = per_call(pipe_rt, args.seconds)
    tc = per_call(channel_rt, args.seconds)
    print(f"bare Pipe round trip     {tp * 1e6:7.1f} us")
    print(f"jaxcolo Channel round trip {tc * 1e6:7.1f} us   ratio {tc / tp:.2f}")
    c.close()
    p.terminate()
    w.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
