"""Ordering and concurrency of colocated calls, and single-flight caches."""

import threading
import time

import jax
import numpy as np
import pytest

import jaxcolo
from tests import colocated_state as state
from tests.colocated_support import (cpu_devices, executor, get_state,  # noqa: F401
                                     pop_state, put, set_state)


@pytest.fixture
def x():
    return put(1, cpu_devices()[0])


def _ident(x):
    return x


@pytest.mark.parametrize("on_main_thread", [True, False])
def test_calls_from_one_thread_run_in_program_order(executor, x,
                                                    on_main_thread):
    @jaxcolo.colocated_python
    def func0(x):
        state.value = 100
        return x

    @jaxcolo.colocated_python
    def func1(x):
        assert state.value == 100
        state.value += 1
        return x

    @jaxcolo.colocated_python
    def func2(x):
        assert state.value == 101
        return x

    func0, func1, func2 = (f.specialize(out_specs_fn=_ident)
                           for f in (func0, func1, func2))
    errors = []

    def calls():
        try:
            func0.submit(x)      # no waiting between the calls
            func1.submit(x)
            jax.block_until_ready(func2(x))
        except Exception as e:  # reported below
            errors.append(e)

    try:
        if on_main_thread:
            calls()
        else:
            t = threading.Thread(target=calls)
            t.start()
            t.join(30)
        assert errors == []
    finally:
        pop_state("value")


def test_submitted_calls_keep_order_under_jitter(executor, x):
    @jaxcolo.colocated_python
    def record(x, i):
        time.sleep(0.002 * int(np.asarray(i) % 3 == 0))  # uneven durations
        state.order.append(int(np.asarray(i)))
        return i

    record = record.specialize(out_specs_fn=lambda x, i: i)
    d = cpu_devices()[0]
    set_state(order=[])
    try:
        ids = [put(np.int32(i), d) for i in range(60)]
        futs = [record.submit(x, i) for i in ids]
        last = record(x, put(np.int32(60), d))  # a sync call waits its turn
        assert int(last) == 60
        assert [int(f.result(timeout=30)) for f in futs] == list(range(60))
        assert get_state("order").tolist() == list(range(61))
    finally:
        pop_state("order")


def test_program_order_holds_across_hosts(executor, tmp_path):
    """Calls of one thread on devices of different hosts run in program
    order: a submitted slow call on device 0 (host 0) is done before the
    thread's next call on device 7 (host 1 of two) starts."""
    log_file = str(tmp_path / "order")

    def writer(tag, delay):
        def write(x):
            time.sleep(delay)
            with open(log_file, "a") as fh:
                fh.write(tag + "\n")
            return x
        return jaxcolo.colocated_python(write).specialize(
            out_specs_fn=_ident)
    d0, d7 = cpu_devices()[0], cpu_devices()[7]
    x0, x7 = put(1, d0), put(1, d7)
    calls = [(writer("a", 0.4), x0), (writer("b", 0.0), x7),
             (writer("c", 0.2), x0), (writer("d", 0.0), x0),
             (writer("e", 0.0), x7)]
    for f, arg in calls:  # discovered; nothing logged after this
        f(arg)
    open(log_file, "w").close()
    futs = [f.submit(arg) for f, arg in calls[:-1]]
    f, arg = calls[-1]
    jax.block_until_ready(f(arg))  # a synchronous call waits its turn
    for fut in futs:
        fut.result(timeout=30)
    with open(log_file) as fh:
        assert fh.read().split() == ["a", "b", "c", "d", "e"]


def test_threads_run_concurrently(executor, x):
    """Three threads meet at a barrier inside the function: no deadlock."""
    @jaxcolo.colocated_python
    def init(x):
        state.barrier = threading.Barrier(3)
        return x

    @jaxcolo.colocated_python
    def meet(x):
        state.barrier.wait(timeout=10)
        return x

    meet = meet.specialize(out_specs_fn=_ident)
    results, errors = [], []

    def run(use_submit):
        try:
            out = meet.submit(x).result(30) if use_submit else meet(x)
            results.append(int(out))
        except Exception as e:
            errors.append(e)

    try:
        jax.block_until_ready(init(x))
        for use_submit in (False, True):
            results.clear()
            threads = [threading.Thread(target=run, args=(use_submit,))
                       for _ in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert errors == [] and results == [1, 1, 1]
    finally:
        pop_state("barrier")


def _burst(n, fn, *args):
    """Call fn(*args) from n threads released together; (results, errors)."""
    go = threading.Barrier(n)
    results, errors = [None] * n, [None] * n

    def run(i):
        go.wait(10)
        try:
            results[i] = fn(*args)
        except BaseException as e:
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results, errors


def test_concurrent_misses_compile_once(executor, x):
    made = []

    def slow_out_specs(x):
        made.append(1)
        time.sleep(0.2)  # keeps the other threads waiting on the entry
        return x

    f = jaxcolo.colocated_python(lambda x: x + 1).specialize(
        out_specs_fn=slow_out_specs)
    results, errors = _burst(4, f, x)
    assert errors == [None] * 4
    assert [int(r) for r in results] == [2] * 4
    assert len(made) == 1
    assert len(f.programs()) == 1


def test_concurrent_misses_share_the_error(executor, x):
    made = []

    def failing_out_specs(x):
        made.append(1)
        time.sleep(0.2)
        raise RuntimeError(f"out_specs_fn failed ({len(made)})")

    f = jaxcolo.colocated_python(lambda x: x).specialize(
        out_specs_fn=failing_out_specs)
    _, errors = _burst(4, f, x)
    assert len(made) == 1
    assert all(type(e) is RuntimeError for e in errors)
    assert len({id(e) for e in errors}) == 1  # one error, shared
    with pytest.raises(RuntimeError, match=r"\(2\)"):  # a later call retries
        f(x)


def test_concurrent_first_calls_discover_once(executor, x):
    @jaxcolo.colocated_python
    def slow(x):
        state.runs += 1
        time.sleep(0.1)
        return x + 1

    discovery_before = [p for p in slow.programs()]
    set_state(runs=0)
    try:
        results, errors = _burst(4, slow, x)
        assert errors == [None] * 4 and [int(r) for r in results] == [2] * 4
        assert get_state("runs") == 4  # each call ran once: 1 discovery + 3
        outs = [jaxcolo.inspect(p.payload)["out_specs"] for p in slow.programs()]
        assert discovery_before == [] and len(outs) == 2
        assert sum(isinstance(o, str) for o in outs) == 1  # one discovery program
    finally:
        pop_state("runs")


def test_fast_cache_follows_new_sharding_objects(executor):
    d = cpu_devices()[0]
    f = jaxcolo.colocated_python(lambda x: x)
    for _ in range(20):  # a new, equal sharding object each time
        s = jax.sharding.SingleDeviceSharding(d)
        assert int(f(jax.device_put(np.int32(7), s))) == 7
    assert len(f._cache._fast) == 1 and len(f._cache._slow) == 1


def test_a_new_thread_does_not_queue_behind_a_finished_one(x):
    """Lanes are per thread, not per thread id: an id is reused once its
    thread ends, and a new thread with it queued behind work the finished
    thread left submitted (here: blocked until the test ends)."""
    release = state.release = threading.Event()  # by reference: a module's

    def wait(v):
        state.release.wait(30)
        return v
    blocked = jaxcolo.colocated_python(wait).specialize(
        out_specs_fn=lambda v: v)  # no discovery: submit returns at once

    quick = jaxcolo.colocated_python(_ident)
    futures, idents = [], []
    with jaxcolo.InlineExecutor() as ex, jaxcolo.use_executor(ex):
        try:
            first = threading.Thread(
                target=lambda: futures.append(blocked.submit(x)))
            first.start()
            first.join()
            for _ in range(20):  # until the OS hands out the same id again
                done = threading.Event()

                def call():
                    idents.append(threading.get_ident())
                    quick(x)
                    done.set()
                t = threading.Thread(target=call)
                t.start()
                assert done.wait(10), "queued behind the finished thread"
                t.join()
                if idents[-1] == first.ident:
                    break
            assert not futures[0].done()
        finally:
            release.set()
            del state.release
        assert int(futures[0].result(10)) == 1
    if first.ident not in idents:
        pytest.skip("no thread id was reused")


def test_a_callback_may_wait_for_a_later_call_of_its_thread(executor):
    """InlineExecutor ran done-callbacks on the lane's runner, the thread
    that runs the lane's later calls: a callback waiting for one waited for
    ever (ProcessExecutor runs them on a thread of their own)."""
    nap = jaxcolo.colocated_python(
        lambda x: (time.sleep(0.2), x + 1)[1]).specialize(
            out_specs_fn=lambda x: x)
    x = put(np.float32(1), cpu_devices()[0])
    first, second = nap.submit(x), nap.submit(x)
    got = []
    first.add_done_callback(lambda _: got.append(float(second.result(10))))
    assert float(first.result(10)) == 2.0
    assert float(second.result(10)) == 2.0
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == [2.0]


def test_cancelling_a_queued_inline_call_runs_its_callbacks():
    """InlineExecutor's queued futures keep their callbacks apart (so they
    run off the lane's thread); cancel() ran only Future's own list, which
    is empty: a cancelled call's callbacks never ran."""
    nap = jaxcolo.colocated_python(
        lambda x: (time.sleep(0.3), x + 1)[1]).specialize(
            out_specs_fn=lambda x: x)
    x = put(np.float32(1), cpu_devices()[0])
    with jaxcolo.InlineExecutor() as ex, jaxcolo.use_executor(ex):
        nap(x)
        ref = nap.programs()[-1]  # (Executor.submit: public, cancellable)
        running = ex.submit(ref, [x], lane="L")
        queued = ex.submit(ref, [x], lane="L")
        seen = []
        queued.add_done_callback(lambda u: seen.append(u.cancelled()))
        assert queued.cancel() and seen == [True]
        assert float(running.result(10)[0]) == 2.0


def test_ctrl_c_in_a_callback_still_fails_every_queued_call_at_close():
    """A KeyboardInterrupt in one queued call's callback, as close() failed
    them, left the calls queued behind it pending for ever."""
    nap = jaxcolo.colocated_python(
        lambda x: (time.sleep(0.3), x + 1)[1]).specialize(
            out_specs_fn=lambda x: x)
    x = put(np.float32(1), cpu_devices()[0])
    ex = jaxcolo.InlineExecutor()
    with jaxcolo.use_executor(ex):
        futs = [nap.submit(x) for _ in range(4)]

    def interrupt(_):
        raise KeyboardInterrupt
    futs[1].add_done_callback(interrupt)
    time.sleep(0.05)
    try:
        ex.close()
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("close() did not raise the KeyboardInterrupt")
    for u in futs[1:]:
        with pytest.raises(jaxcolo.ExecutorError, match="closed before"):
            u.result(5)
