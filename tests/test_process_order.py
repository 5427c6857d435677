"""Program order across hosts and the bounds of a call's timeout on a
two-host ProcessExecutor: calls a thread defers behind its calls on other
hosts, the thread that sends them, and what a timeout lets go of."""

import gc
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import pytest

import jaxcolo
from jaxcolo.errors import ExecutorError
from tests.colocated_support import sleeping_identity, stop_process


def _writer(log_file, tag, delay=0.0):
    def write(x):
        time.sleep(delay)
        with open(log_file, "a") as fh:
            fh.write(tag + "\n")
        return x
    return jaxcolo.colocated_python(write).specialize(out_specs_fn=lambda x: x)


@pytest.fixture(scope="module")
def hosts():
    with jaxcolo.ProcessExecutor(num_hosts=2) as ex, jaxcolo.use_executor(ex):
        yield ex


def _on(i, x):
    return jax.device_put(x, jax.devices()[i])


def test_a_call_does_not_overtake_a_deferred_one_being_sent(hosts,
                                                            tmp_path):
    """A thread's call for the host set of a deferred call the pump thread
    is still packing (64 MiB) waits behind it (it was sent at once and
    overtook it)."""
    log_file = str(tmp_path / "log")
    a, b, c = (_writer(log_file, "a", 0.3), _writer(log_file, "b"),
               _writer(log_file, "c"))
    x0, x7 = _on(0, jnp.ones(4)), _on(7, jnp.ones(4))
    big7 = _on(7, jnp.ones(16 << 20, jnp.float32))
    a(x0), b(big7), c(x7)
    for _ in range(3):
        open(log_file, "w").close()
        fa = a.submit(x0)    # host 0, 0.3 s
        fb = b.submit(big7)  # host 1: deferred behind fa
        fa.result(timeout=30)
        time.sleep(0.005)    # the pump is packing fb
        c(x7)                # host 1: after fb
        fb.result(timeout=30)
        with open(log_file) as fh:
            assert fh.read().split() == ["a", "b", "c"]


def test_callbacks_of_calls_the_pump_fails_run_elsewhere(hosts):
    """A deferred call failed by the thread sending deferred calls runs
    its done-callbacks on another thread: a callback waiting for the
    lane's next deferred call finishes (it ran on the sending thread,
    which it blocked)."""
    a, b = sleeping_identity(0.5), sleeping_identity()
    b(_on(7, jnp.ones(4)))
    doomed, ok7 = _on(7, jnp.ones(4)), _on(7, jnp.ones(4))
    fa = a.submit(_on(0, jnp.ones(4)))
    doomed.delete()  # fb fails when it is packed (a deferred call copies
    fb = b.submit(doomed)  # its inputs, but this one is gone already)
    fc = b.submit(ok7)     # deferred behind it
    seen = {}
    ran = threading.Event()

    def callback(fut):
        seen["thread"] = threading.current_thread().name
        try:
            fc.result(timeout=10)
            seen["fc"] = "done"
        except Exception as e:  # reported below
            seen["fc"] = repr(e)
        ran.set()
    fb.add_done_callback(callback)
    fa.result(timeout=30)
    assert ran.wait(20)
    assert fb.exception() is not None
    assert seen["fc"] == "done" and seen["thread"] != "jaxcolo-lane-order"


def test_a_deferred_call_that_times_out_is_not_sent_nor_kept(hosts,
                                                             tmp_path):
    """A call deferred behind a slow call on another host times out at its
    deadline, is never sent, and its arguments are let go at once (they
    stayed until the slow call finished)."""
    log_file = str(tmp_path / "log")
    slow = _writer(log_file, "slow", 1.5)
    quick = _writer(log_file, "quick")
    x0, x7 = _on(0, jnp.ones(4)), _on(7, jnp.ones(4))
    slow(x0), quick(x7)
    open(log_file, "w").close()
    big7 = _on(7, jnp.ones((1 << 20) + 3, jnp.float32))
    fs = slow.submit(x0)
    with hosts.timeout(0.3):
        fq = quick.submit(big7)  # deferred behind fs (with its own copy)
    del big7
    with pytest.raises(ExecutorError, match="before it was sent.*it was "
                                            "not sent"):
        fq.result(timeout=10)
    deadline = time.monotonic() + 10  # (the copy) let go before the slow
    while any(a.shape == ((1 << 20) + 3,) for a in jax.live_arrays()):
        assert time.monotonic() < deadline and not fs.done()  # call ends
        gc.collect()
        time.sleep(0.01)
    assert not fs.done()
    fs.result(timeout=30)
    quick(x7)
    with open(log_file) as fh:
        assert fh.read().split() == ["slow", "quick"]


@pytest.mark.parametrize("change", ["delete", "donate"])
def test_a_deferred_call_keeps_its_inputs_when_the_caller_drops_them(
        hosts, tmp_path, change):
    """``submit`` of a call deferred behind the thread's call on another
    host kept references to its inputs, not their values: deleting or
    donating one after submit returned failed the call ("Array has been
    deleted"), where a call sent at once had copied them already."""
    log_file = str(tmp_path / "log")
    slow = _writer(log_file, "slow", 0.5)
    quick = _writer(log_file, "quick")
    x0 = _on(0, jnp.ones(4))
    slow(x0), quick(_on(7, jnp.ones(4)))
    for n in (5, 3 << 20):  # in the message; in shared memory
        x7 = _on(7, jnp.arange(n, dtype=jnp.float32))
        fs = slow.submit(x0)
        fq = quick.submit(x7)  # deferred behind fs
        assert not fs.done()
        if change == "delete":
            x7.delete()
        else:
            jax.jit(lambda v: v * 2, donate_argnums=0)(x7)
            assert x7.is_deleted()
        fs.result(timeout=30)
        out = fq.result(timeout=30)
        assert out.sharding == jax.sharding.SingleDeviceSharding(
            jax.devices()[7])
        assert (jax.device_get(out) == jnp.arange(n, dtype=jnp.float32)).all()


def _first(xs):
    return xs[0]


def test_a_deferred_call_is_sent_only_once_its_copies_are_made(hosts):
    """The thread sending deferred calls could take one while its caller
    was still copying its inputs, and send the caller's own arrays: the
    caller, back from submit, deleted them while they were being packed
    ("Array has been deleted", or XLA aborting the process on a buffer
    deleted while held; found by review).  It waits for the copies."""
    a = sleeping_identity(0.02)
    b = jaxcolo.colocated_python(_first).specialize(
        out_specs_fn=lambda xs: xs[0])
    x0 = _on(0, jnp.ones(4))

    def inputs():  # copying these takes longer than the call ahead runs
        return [_on(7, jnp.full(8 << 20, 3.0, jnp.float32))] + \
            [_on(7, jnp.full(4, float(k))) for k in range(300)]
    a(x0), b(inputs())
    for _ in range(3):
        xs = inputs()
        fa = a.submit(x0)  # host 0
        fb = b.submit(xs)  # host 1: deferred behind fa
        for x in xs:       # allowed once submit returned
            x.delete()
        fa.result(timeout=30)
        out = fb.result(timeout=30)
        assert out.shape == (8 << 20,) and float(out[0]) == 3.0


def test_a_deferred_call_timing_out_during_a_restart_says_so(hosts):
    """A call deferred behind the thread's call on another host, whose host
    restarted when its turn came: timed out there, it said it had waited
    "for this thread's earlier calls on other hosts" (found by review)."""
    a, b = sleeping_identity(2), sleeping_identity()
    x0, x7 = _on(0, jnp.ones(4)), _on(7, jnp.ones(4))
    for _ in range(3):  # (the deadline and the restart wait race)
        a(x0), b(x7)
        fa = a.submit(x0)              # host 0, 2 s
        with hosts.timeout(0.5):
            fb = b.submit(x7)          # host 1: deferred behind fa
        time.sleep(0.1)
        os.kill(hosts.worker_pids()[0], signal.SIGKILL)  # a restart
        with pytest.raises(jaxcolo.ExecutorError, match="was lost"):
            fa.result(timeout=30)
        with pytest.raises(jaxcolo.ExecutorError,
                           match=r"call timed out after 0.5s waiting for host "
                                 r"1 to restart; it was not sent$"):
            fb.result(timeout=30)


def test_a_timeout_covers_waiting_for_destroys_stuck_on_another_host():
    """A call with a timeout to a healthy host, made while the destroy of
    an instance on a stopped host waits to be sent, fails at its deadline
    (it waited for the stopped host)."""
    @jaxcolo.colocated_python_class
    class Obj:
        def echo(self, x):
            return x
    f = jaxcolo.colocated_python(lambda x: x + 1).specialize(
        out_specs_fn=lambda x: x)
    g = jaxcolo.colocated_python(lambda x: x).specialize(
        out_specs_fn=lambda x: x)
    x0, x7 = _on(0, jnp.ones(4)), _on(7, jnp.ones(4))
    big0 = _on(0, jnp.zeros(16 << 20, jnp.float32))
    with jaxcolo.ProcessExecutor(num_hosts=2, shm=False,
                                 lost_timeout=60.0) as ex, \
            jaxcolo.use_executor(ex):
        obj = Obj()
        obj.echo(x0)  # an instance on host 0
        f(big0), g(x7)
        pid0 = ex.worker_pids()[0]
        stop_process(pid0)
        try:
            with pytest.raises(ExecutorError, match="timed out"):
                with ex.timeout(1.0):
                    f(big0)  # its rest holds host 0's connection
            del obj
            gc.collect()  # its destroy waits for host 0
            time.sleep(0.3)
            t0 = time.monotonic()
            with pytest.raises(ExecutorError, match="destroys"):
                with ex.timeout(1.0):
                    g(x7)
            assert time.monotonic() - t0 < 5
        finally:
            os.kill(pid0, signal.SIGCONT)
        assert float(g(x7)[0]) == 1.0


def _two_host_input(shape=(8, 8)):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(jax.devices(), ("x",))
    return jax.device_put(jnp.zeros(shape, jnp.float32),
                          NamedSharding(mesh, P("x")))


def _log_order(log_file, tag):
    def write(x):
        with open(log_file, "a") as fh:
            fh.write(f"{tag} {jax.process_index()}\n")
        return x
    return write


def test_a_thread_waits_for_a_multi_host_call_failed_on_one_host(
        hosts, tmp_path):
    """A two-host call whose host 1 raises at once while host 0 still runs
    it: the thread's next call, on host 1, starts after host 0 is done (the
    error came back first, and the next call ran beside the earlier one)."""
    log_file = str(tmp_path / "log")

    def multi(x):
        if jax.process_index() == 1:
            raise ValueError("host 1 fails")
        time.sleep(0.8)
        return _log_order(log_file, "multi")(x)
    fm = jaxcolo.colocated_python(multi).specialize(out_specs_fn=lambda x: x)
    fs = jaxcolo.colocated_python(_log_order(log_file, "next")).specialize(
        out_specs_fn=lambda x: x)
    x7 = _on(7, jnp.ones(4))
    fs(x7)
    open(log_file, "w").close()
    with pytest.raises(ValueError, match="host 1 fails"):
        fm(_two_host_input())
    fs(x7)
    with open(log_file) as fh:
        assert fh.read().split("\n")[:2] == ["multi 0", "next 1"]


def test_a_multi_host_call_timed_out_mid_send_is_not_overtaken(tmp_path):
    """A two-host call timed out while its 64 MiB input is still being
    sent: the thread's next call, on host 1, runs after the earlier call's
    part there (it went down host 1's connection first)."""
    log_file = str(tmp_path / "log")
    fm = jaxcolo.colocated_python(_log_order(log_file, "multi"))
    fs = jaxcolo.colocated_python(_log_order(log_file, "next"))
    big = _two_host_input((8, 2 << 20))
    x7 = _on(7, jnp.ones(4))
    with jaxcolo.ProcessExecutor(num_hosts=2, shm=False) as ex, \
            jaxcolo.use_executor(ex):
        fm(_two_host_input()), fs(x7)
        open(log_file, "w").close()
        with pytest.raises(ExecutorError, match="timed out"):
            with ex.timeout(0.02):
                fm(big)
        fs(x7)
        with open(log_file) as fh:
            lines = fh.read().split()
    assert lines.index("next") > max(
        i for i, w in enumerate(lines) if w == "multi"), lines
