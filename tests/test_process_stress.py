"""STRESS TEST (marked ``stress``; about 10-60 s here): 8 threads x 1,000
calls against a two-host ProcessExecutor.  Every caller gets its own
results, in order; every host sees each caller's calls in program order."""

import threading
import time

import jax
import numpy as np
import pytest

import jaxcolo
from tests.colocated_support import cpu_devices

THREADS = 8
CALLS = 1000
BATCH = 25


def _step(v):
    """Host side: check this caller's calls arrive in order, return 2v+1."""
    from tests import colocated_state as state
    t, i = (int(a) for a in np.asarray(v))
    last = state.__dict__.setdefault("stress_last", {})
    assert last.get(t, -1) < i, f"caller {t}: call {i} after {last.get(t)}"
    last[t] = i
    return v * 2 + 1


@pytest.mark.stress
def test_eight_threads_thousand_calls_two_hosts():
    devs = cpu_devices()
    f = jaxcolo.colocated_python(_step).specialize(out_specs_fn=lambda v: v)
    errors, done = [], [0] * THREADS

    def caller(t):
        try:
            for start in range(0, CALLS, BATCH):
                futs, want = [], []
                for i in range(start, start + BATCH):
                    # Alternate the two hosts (devices 0-3 and 4-7).
                    d = devs[(t % 4) + 4 * (i % 2)]
                    x = jax.device_put(np.array([t, i], np.int32), d)
                    want.append([2 * t + 1, 2 * i + 1])
                    if i % 5 == 4:   # some synchronous calls among submits
                        futs.append(f(x))
                    else:
                        futs.append(f.submit(x))
                got = [np.asarray(r if isinstance(r, jax.Array)
                                  else r.result(60)).tolist() for r in futs]
                assert got == want, (t, start)
                done[t] += len(got)
        except BaseException as e:  # reported by the main thread
            errors.append((t, e))

    with jaxcolo.ProcessExecutor(num_hosts=2) as ex, jaxcolo.use_executor(ex):
        f(jax.device_put(np.array([99, 0], np.int32), devs[0]))  # warm
        t0 = time.monotonic()
        threads = [threading.Thread(target=caller, args=(t,))
                   for t in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(300)
        elapsed = time.monotonic() - t0
        stats = ex.stats()
    assert errors == []
    assert done == [CALLS] * THREADS
    assert stats["calls"] == THREADS * CALLS + 1 - 0  # + the warm call
    assert [h["calls"] for h in stats["hosts"]] == \
        [THREADS * CALLS // 2 + 1, THREADS * CALLS // 2]
    print(f"\nstress: {THREADS}x{CALLS} calls on 2 hosts in {elapsed:.1f}s "
          f"({THREADS * CALLS / elapsed:.0f} calls/s)")
