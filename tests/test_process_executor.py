"""ProcessExecutor specifics: multi-host calls on a jax.distributed cluster,
the wire, and faults (each with its exact error and a following successful
call).  The colocated behaviour tests run under it via colocated_support."""

import gc
import logging
import os
import re
import signal
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, \
    SingleDeviceSharding

import jaxcolo
from jaxcolo import versions
from jaxcolo.process import messages
from jaxcolo.transport import channel as ch, handshake
from tests.colocated_support import cpu_devices, ok_call, put, \
    stop_process, wait_collected, wait_processes_exited


def _identity(x):
    return x


@pytest.fixture(scope="module")
def two_hosts():
    with jaxcolo.ProcessExecutor(num_hosts=2) as ex:
        yield ex


@pytest.fixture(scope="module")
def one_host():
    with jaxcolo.ProcessExecutor(num_hosts=1, lost_timeout=5.0) as ex:
        yield ex


# ------------------------------------------------------------ multi-host

@pytest.fixture(scope="module", params=[2, 4], ids=["2hosts", "4hosts"])
def multi_host(request):
    """(executor, H): the module's two-host executor, or four fresh hosts
    owning two devices each."""
    if request.param == 2:
        yield request.getfixturevalue("two_hosts"), 2
        return
    with jaxcolo.ProcessExecutor(num_hosts=4) as ex:
        yield ex, 4


def test_cross_host_reduction_matches_single_process(multi_host):
    ex, hosts = multi_host
    devs = cpu_devices()
    mesh = Mesh(np.array(devs), ("x",))
    x = jax.device_put(np.arange(8 * 3, dtype=np.float32).reshape(8, 3) ** 2,
                       NamedSharding(mesh, P("x")))

    def reduce(x):
        m = x.sharding.mesh
        total = jax.jit(jax.shard_map(
            lambda v: jax.lax.psum(jnp.sum(v, axis=0), "x"), mesh=m,
            in_specs=P("x"), out_specs=P()))(x)
        mean = jax.jit(lambda v: jnp.mean(v, axis=0),
                       out_shardings=NamedSharding(m, P()))(x)
        # Which process holds each row, and how many processes there are.
        where = jax.make_array_from_callback(
            (8,), NamedSharding(m, P("x")),
            lambda idx: np.full((1,), jax.process_index() * 10 +
                                jax.process_count(), np.int32))
        return total, mean, where

    expected_total, expected_mean, _ = reduce(x)  # here: one process
    with jaxcolo.use_executor(ex):
        f = jaxcolo.colocated_python(reduce)
        for _ in range(2):  # discovery, then a warm call
            total, mean, where = f(x)
            np.testing.assert_allclose(jax.device_get(total),
                                       jax.device_get(expected_total))
            np.testing.assert_allclose(jax.device_get(mean),
                                       jax.device_get(expected_mean))
            assert total.sharding == NamedSharding(mesh, P())
            assert total.sharding.device_set == set(devs)
            # Host h (process h of H) holds rows h*8/H .. (h+1)*8/H - 1.
            assert jax.device_get(where).tolist() == [
                10 * (row * hosts // 8) + hosts for row in range(8)]
    prog = jaxcolo.inspect(f.programs()[-1].payload)
    assert prog["device_ids"] == [d.id for d in devs]



def _seven_on_device_5(x):
    d = x.sharding.mesh.devices.flat[5]
    mine = [s.device for s in x.addressable_shards]
    parts = [jax.device_put(jnp.float32(7), d)] if d in mine else []
    return jax.make_array_from_single_device_arrays(
        (), SingleDeviceSharding(d), parts, dtype=jnp.float32)


def test_single_device_output_on_another_hosts_device(multi_host):
    """Every host packed a SingleDeviceSharding output as if it held it:
    the hosts not owning its device failed reading it."""
    ex, _ = multi_host
    devs = cpu_devices()
    x = jax.device_put(np.ones(8, np.float32),
                       NamedSharding(Mesh(np.array(devs), ("x",)), P("x")))
    f = jaxcolo.colocated_python(_seven_on_device_5).specialize(
        out_specs_fn=lambda x: jax.ShapeDtypeStruct(
            (), np.float32, sharding=SingleDeviceSharding(devs[5])))
    with jaxcolo.use_executor(ex):
        out = f(x)
    assert float(out) == 7.0
    assert out.sharding == SingleDeviceSharding(devs[5])


def _dtype_by_host(a):
    return a if jax.process_index() == 0 else a.astype(jnp.int32)


def _on_default_device():
    return jnp.arange(8.0)


def test_output_mismatch_names_devices_as_the_caller_does(two_hosts):
    """Host 1's output on its own default device, against a spec on
    device 0: the error named the worker's device (id 2048) only."""
    devs = cpu_devices()
    spec = jax.ShapeDtypeStruct((8,), jnp.float32,
                                sharding=SingleDeviceSharding(devs[0]))
    f = jaxcolo.colocated_python(_on_default_device).specialize(
        devices=devs, out_specs_fn=lambda: spec)
    with jaxcolo.use_executor(two_hosts):
        with pytest.raises(ValueError, match=(
                r"does not match its out spec: got .*CpuDevice\(id=2048\).*"
                r"\(devices \[4\] in the caller's numbering\), expected")):
            f()


def test_hosts_discovering_different_specs_is_an_error(two_hosts):
    """A discovery call whose hosts return different specs used to take
    host 0's and reinterpret the other hosts' bytes with them."""
    devs = cpu_devices()
    x = jax.device_put(jnp.arange(8.0), NamedSharding(
        Mesh(np.array(devs), ("x",)), P("x")))
    f = jaxcolo.colocated_python(_dtype_by_host)
    with jaxcolo.use_executor(two_hosts):
        for _ in range(2):
            with pytest.raises(ValueError, match=r"_dtype_by_host: hosts 0 "
                               r"and 1 returned outputs of different specs"):
                f(x)
    assert ok_call(two_hosts) == 42
    # with shared-memory outputs: their leases come back (they leaked)
    big = jax.device_put(jnp.zeros(8 << 17), x.sharding)  # 512 KiB a shard
    with jaxcolo.use_executor(two_hosts):
        for _ in range(3):
            with pytest.raises(ValueError, match="different specs"):
                jaxcolo.colocated_python(_dtype_by_host)(big)
    deadline = time.monotonic() + 20
    while any(h.get("leased") for h in two_hosts.stats()["hosts"]):
        assert time.monotonic() < deadline, two_hosts.stats()["hosts"]
        time.sleep(0.1)


def test_single_host_calls_of_a_multi_host_executor(multi_host):
    ex, hosts = multi_host
    devs = cpu_devices()

    @jaxcolo.colocated_python
    def pid(x):
        return jax.device_put(np.int32(os.getpid()), x.sharding)

    per_host = 8 // hosts
    with jaxcolo.use_executor(ex):  # the last device of each host's block
        pids = [int(pid(put(0, devs[(h + 1) * per_host - 1])))
                for h in range(hosts)]
    assert pids == ex.worker_pids() and len(set(pids)) == hosts


# ------------------------------------------------------------------ wire

def test_node_types_a_fresh_worker_has_not_imported():
    """A namedtuple (or registered node) in the specs of a program whose
    module the worker has not imported: the worker imports it through the
    body, as JAX's colocated Python does (it used to refuse every call)."""
    from tests import colocated_types as ct

    dev = cpu_devices()[0]
    x, y = put(np.float32(1), dev), put(np.float32(2), dev)
    with jaxcolo.ProcessExecutor(num_hosts=1) as ex, jaxcolo.use_executor(ex):
        swap = jaxcolo.colocated_python(ct.swap)
        out = swap(ct.Pair(x, y))
        assert type(out) is ct.Pair and float(out.left) == 2.0
        boxed = jaxcolo.colocated_python(ct.boxed)  # a discovery call
        out = boxed(x)
        assert type(out) is ct.Box and float(out.b) == 2.0
        assert float(boxed(y).b) == 4.0


def test_node_types_of_arguments_only():
    """A function whose body does not name its arguments' node type's
    module: the worker had no registration for it and refused every call
    (UnregisteredError).  The body carries the type (by reference), as
    JAX's pickled treedef does, so the worker imports its module."""
    from tests import colocated_types as ct

    dev = cpu_devices()[0]
    x, y = put(np.float32(1), dev), put(np.float32(2), dev)
    ident = jaxcolo.colocated_python(lambda v: v)  # names no module
    with jaxcolo.ProcessExecutor(num_hosts=1) as ex, jaxcolo.use_executor(ex):
        out = ident(ct.Box(x, y))
        assert type(out) is ct.Box and float(out.b) == 2.0
        out = ident({"p": ct.Pair(x, [ct.Box(y, x)])})
        assert type(out["p"]) is ct.Pair and type(out["p"].right[0]) is ct.Box


def test_a_node_type_registered_later_is_used_by_the_same_program():
    """A program whose arguments' node type the worker had not registered
    failed; it went on failing after the type was registered there (by a
    function): the worker kept the first decode's error for the session."""
    from tests import colocated_types as ct

    ct.register_late()
    dev = cpu_devices()[0]
    x = put(np.float32(1), dev)
    ident = jaxcolo.colocated_python(lambda v: v)
    with jaxcolo.ProcessExecutor(num_hosts=1) as ex, jaxcolo.use_executor(ex):
        with pytest.raises(jaxcolo.UnregisteredError, match=(
                "pytree node type 'tests.colocated_types.Late' is not "
                r"registered here \(use .*\); a worker has the "
                "registrations of the modules it imports")):
            ident(ct.Late(x))
        decoded = ex.stats()["hosts"][0]["programs_decoded"]
        notes = []
        for _ in range(3):  # nothing registered since: not decoded again
            with pytest.raises(jaxcolo.UnregisteredError) as info:
                ident(ct.Late(x))
            notes.append("".join(info.value.__notes__))
        assert ex.stats()["hosts"][0]["programs_decoded"] == decoded
        # the worker raised its one kept error object each call: its
        # traceback (and the frames holding each call's buffers) grew
        assert len(set(notes)) == 1, [len(n) for n in notes]
        jaxcolo.colocated_python(ct.register_late_here).specialize(
            out_specs_fn=_identity)(x)
        out = ident(ct.Late(x))
        assert type(out) is ct.Late and float(out.v) == 1.0


def test_a_timeout_covers_copying_inputs_into_shared_memory():
    """A 1 GiB input and a 0.3 s timeout timed out after 1.65 s (found by
    review): the calling thread copied the input into shared memory before
    the deadline was looked at.  The copy goes in 64 MiB pieces, checked."""
    x = put(np.ones(64 << 20, np.float32), cpu_devices()[0])  # 256 MiB
    f = jaxcolo.colocated_python(lambda v: v[:1]).specialize(
        out_specs_fn=lambda s: jax.ShapeDtypeStruct((1,), s.dtype,
                                                    sharding=s.sharding))
    with jaxcolo.ProcessExecutor(num_hosts=1) as ex, jaxcolo.use_executor(ex):
        assert float(f(x)[0]) == 1.0  # warm: the segment exists
        with ex.timeout(0.001), pytest.raises(jaxcolo.ExecutorError, match=(
                r"call timed out after 0\.001s while its inputs were copied "
                r"into shared memory \(\d+ of 268435456 bytes copied\); it "
                "was not sent")):
            f(x)
        assert float(f(x)[0]) == 1.0
        assert ex.stats()["calls"] == 3


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "frames"])
def test_large_arrays_round_trip(shm):
    devs = cpu_devices()
    s = NamedSharding(Mesh(np.array(devs[:2]), ("x",)), P("x"))
    a = np.random.default_rng(0).standard_normal((2, 1 << 19))  # 2 x 4 MiB
    x = jax.device_put(a.astype(np.float32), s)
    f = jaxcolo.colocated_python(lambda v: v * 2).specialize(
        out_specs_fn=_identity)
    with jaxcolo.ProcessExecutor(num_hosts=1, shm=shm) as ex, \
            jaxcolo.use_executor(ex):
        for _ in range(6):
            out = f(x)
            assert out.sharding == s
            np.testing.assert_array_equal(jax.device_get(out),
                                          a.astype(np.float32) * 2)
        del out
        host = ex.stats()["hosts"][0]
    if shm:  # segments are reused, not one per call (a result in use
        # keeps its segments: the previous `out` lives during each call)
        assert 0 < host["segments"] <= 8
    else:
        assert host.get("segments", 0) == 0


@jaxcolo.colocated_python_class
class _Keeper:
    def __init__(self):
        self.saved = None

    def keep(self, x):
        self.saved = x
        return x

    def get(self, x):
        return self.saved


def test_arrays_in_use_keep_their_shared_memory(one_host):
    """JAX aliases shared-memory buffers: results kept by the caller, inputs
    kept by a host instance, and shards or numpy views taken from them must
    not change when later calls reuse segments."""
    dev = cpu_devices()[0]
    big = lambda v: jax.device_put(np.full(1 << 20, v, np.float32), dev)  # noqa: E731
    f = jaxcolo.colocated_python(lambda x: x + 1).specialize(
        out_specs_fn=_identity)
    with jaxcolo.use_executor(one_host):
        r1 = f(big(0))
        shard, view = r1.addressable_shards[0].data, np.asarray(r1)
        del r1
        for v in (10, 20, 30):
            f(big(v))
        assert float(shard[0]) == 1.0 and view[0] == 1.0
        k = _Keeper()
        k.keep(big(5))
        k.get(big(0))
        k.keep(big(7))
        for v in (100, 200):
            k.get(big(v))
        assert float(k.get(big(0))[0]) == 7.0


def test_timed_out_future_callback_may_make_calls(tmp_path):
    """A done-callback of a timed-out future makes a call while another
    thread reads the host's replies: both complete (the callback ran under
    the executor's lock, and the reader blocked on it for ever)."""
    slow = jaxcolo.colocated_python(
        lambda x: (time.sleep(1.5), x)[1]).specialize(out_specs_fn=_identity)
    quick = jaxcolo.colocated_python(_identity).specialize(
        out_specs_fn=_identity)
    with jaxcolo.ProcessExecutor(num_hosts=1) as ex, jaxcolo.use_executor(ex):
        x = put(np.int32(1), cpu_devices()[0])
        quick(x)
        done = []
        b = threading.Thread(target=lambda: done.append(int(slow(x))))
        b.start()
        time.sleep(0.2)  # b reads host 0's replies now
        with ex.timeout(0.3):
            fut = slow.submit(x)
        fut.add_done_callback(lambda f: done.append(int(quick(x)) + 10))
        b.join(20)
        assert not b.is_alive() and sorted(done) == [1, 11]
        with pytest.raises(jaxcolo.ExecutorError, match="timed out"):
            fut.result()


def test_submitted_future_callback_may_make_calls(one_host):
    """A done-callback of a submitted future makes a call: it completes at
    once (it ran on the link's reader, which then waited for itself until
    the healthy worker was declared lost)."""
    quick = jaxcolo.colocated_python(_identity).specialize(
        out_specs_fn=_identity)
    pids = one_host.worker_pids()
    lost = one_host.stats()["lost"]
    with jaxcolo.use_executor(one_host):
        x = put(np.int32(5), cpu_devices()[0])
        got = []
        finished = threading.Event()

        def callback(f):
            got.append((int(f.result()), int(quick(x + 1))))
            finished.set()

        fut = quick.submit(x)
        fut.add_done_callback(callback)
        assert finished.wait(4.0) and got == [(5, 6)]
        done_fut = quick.submit(x)
        done_fut.result()
        done_fut.add_done_callback(callback)  # done already: runs inline
        assert got[-1] == (5, 6) and len(got) == 2
        order = []
        all_ran = threading.Event()
        fut = quick.submit(x)
        fut.add_done_callback(lambda f: (time.sleep(0.2), order.append(1)))
        fut.add_done_callback(lambda f: order.append(2))
        fut.add_done_callback(lambda f: all_ran.set())
        assert all_ran.wait(4.0) and order == [1, 2]  # in order, one thread
    assert one_host.worker_pids() == pids
    assert one_host.stats()["lost"] == lost


def test_submit_starts_no_thread_per_call(one_host):
    """Only callbacks a user adds get a thread of their own (the chaining of
    submit's result ran on a new thread for every call)."""
    quick = jaxcolo.colocated_python(_identity).specialize(
        out_specs_fn=_identity)
    started = []
    original = threading.Thread.start

    def counting_start(self):
        started.append(self.name)
        return original(self)

    with jaxcolo.use_executor(one_host):
        x = put(np.int32(4), cpu_devices()[0])
        quick(x)
        threading.Thread.start = counting_start
        try:
            futures = [quick.submit(x) for _ in range(100)]
            assert [int(f.result(30)) for f in futures] == [4] * 100
        finally:
            threading.Thread.start = original
    assert started == []


def test_call_timeout_keeps_no_finished_call(one_host):
    """A timeout's bookkeeping lets go of a finished call and its result
    at once, not at its deadline."""
    import gc
    import weakref
    f = jaxcolo.colocated_python(lambda x: x + 1).specialize(
        out_specs_fn=_identity)
    with jaxcolo.use_executor(one_host), one_host.timeout(600):
        x = put(np.zeros(1000, np.float32), cpu_devices()[0])
        r = f(x)
        alive = weakref.ref(r)
        for _ in range(3000):
            f(x)
        del r
        gc.collect()
        assert alive() is None
        assert len(one_host._deadlines) <= 2048  # cleared entries compacted


def test_instance_dropped_inside_a_send_does_not_block(one_host):
    """The destroy of an instance dropped while this thread holds the link's
    send lock (a finalizer run by the garbage collector inside a send) is
    only queued: it goes out with this thread's next call."""
    @jaxcolo.colocated_python_class
    class Thing:
        def echo(self, x):
            return x

    created = one_host.stats()["hosts"][0].get("instances_destroyed", 0)
    with jaxcolo.use_executor(one_host):
        x = put(np.int32(3), cpu_devices()[0])
        thing = Thing()
        assert int(thing.echo(x)) == 3
        returned = threading.Event()

        def drop_holding_send_lock():
            with one_host._links[0].channel._send_lock:
                box.clear()
                gc.collect()
            returned.set()

        box = [thing]
        del thing
        t = threading.Thread(target=drop_holding_send_lock, daemon=True)
        t.start()
        assert returned.wait(5.0)  # it deadlocked on the send lock
        assert ok_call(one_host) == 42  # the call sends the destroy first
        assert one_host.stats()["hosts"][0]["instances_destroyed"] == \
            created + 1


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "1"])
def test_timeouts_are_checked(one_host, bad):
    with pytest.raises(ValueError, match="must be a number of seconds > 0"):
        with one_host.timeout(bad):
            pass
    with pytest.raises(ValueError, match="call_timeout must be"):
        jaxcolo.ProcessExecutor(num_hosts=1, call_timeout=bad)


@pytest.mark.parametrize("name", ["lost_timeout", "heartbeat",
                                  "connect_timeout", "start_timeout"])
@pytest.mark.parametrize("bad", [None, float("inf"), 0, -1.0, "1"])
def test_watchdog_periods_are_checked(name, bad):
    """lost_timeout=None (or -1) was taken: the watchdog thread died of a
    TypeError and a silent worker was never found lost."""
    if name == "heartbeat" and bad is None:
        return  # the default: 1 s, or a quarter of a shorter lost_timeout
    with pytest.raises(ValueError, match=(
            f"^{name} must be a finite number of seconds > 0, got ")):
        jaxcolo.ProcessExecutor(num_hosts=1, **{name: bad})


def test_lost_timeout_spans_heartbeats():
    """lost_timeout=0.5 with the 1 s heartbeat was taken: an idle worker,
    silent between heartbeats, was declared lost again and again (a 3 s
    sleep failed after 0.57 s; the instance's state was lost)."""
    with pytest.raises(ValueError, match=r"lost_timeout \(1\.0s\) must be "
                       r"at least 3x heartbeat \(0\.5s\)"):
        jaxcolo.ProcessExecutor(num_hosts=1, lost_timeout=1.0, heartbeat=0.5)
    nap = jaxcolo.colocated_python(
        lambda x: (time.sleep(2.0), x)[1]).specialize(out_specs_fn=_identity)
    x = put(np.int32(2), cpu_devices()[0])
    # (0.9 s: a 1 s heartbeat loses the worker; the default quarter leaves
    # a loaded machine 0.67 s of slack)
    with jaxcolo.ProcessExecutor(num_hosts=1, lost_timeout=0.9) as ex, \
            jaxcolo.use_executor(ex):
        pid = ex.worker_pids()[0]
        assert int(nap(x)) == 2
        time.sleep(1.5)  # idle between calls
        assert int(nap(x)) == 2
        assert ex.worker_pids()[0] == pid  # never lost, never restarted


def test_infinite_timeout_is_no_timeout(one_host):
    """inf (or anything past threading.TIMEOUT_MAX) used to kill the
    deadline thread: no later call timed out."""
    slow = jaxcolo.colocated_python(
        lambda x: (time.sleep(2), x)[1]).specialize(out_specs_fn=_identity)
    with jaxcolo.use_executor(one_host):
        x = put(np.int32(2), cpu_devices()[0])
        with one_host.timeout(float("inf")):
            assert ok_call(one_host) == 42
        with one_host.timeout(1e12):
            assert ok_call(one_host) == 42
        with one_host.timeout(np.float32(30.0)):  # any real number
            assert ok_call(one_host) == 42
        with one_host.timeout(0.3), pytest.raises(jaxcolo.ExecutorError,
                                                  match="timed out"):
            slow(x)
    assert ok_call(one_host) == 42


def test_messages_are_payloads_without_pickle():
    m = messages.Message(messages.MessageKind.call, call_id=7, lane=3,
                         program_id=b"\x01" * 16,
                         shards=messages.Shards([0], [2], [0], [0], [0], [0],
                                                [4], [0], [0], b"\0\0\0\x07"))
    data = messages.encode(m)
    assert b"\x80\x05" not in data  # no pickle stream
    info = jaxcolo.inspect(data)
    assert info["root_kind"] == "message" and info["kind"] == "call"
    assert info["shards"] == 1 and info["buffers"] == {"message": 1}
    assert jaxcolo.deserialize(data).call_id == 7
    with pytest.raises(jaxcolo.PayloadError, match=r"buffer 0 \(0\+4 bytes\) "
                                                   r"exceeds the 0 data"):
        bad = messages.Shards([0], [2], [0], [0], [0], [0], [4], [0], [0])
        messages.decode(messages.encode(messages.Message(
            messages.MessageKind.call, call_id=1, shards=bad)))


# ---------------------------------------------------------------- faults

def test_a_remote_exception_names_nothing_but_exception_classes(one_host):
    """The controller unpickled the worker's exception with cloudpickle: an
    exception's pickle could make it call any function.  Now only exception
    classes known here are resolved; the rest is an ExecutorError."""
    from tests import colocated_types as ct

    f = jaxcolo.colocated_python(ct.raise_sneaky).specialize(
        out_specs_fn=_identity)
    with jaxcolo.use_executor(one_host):
        with pytest.raises(jaxcolo.ExecutorError, match=r"tests\.colocated_"
                           r"types\.Sneaky: from the host") as info:
            f(put(1, cpu_devices()[0]))
    assert type(info.value) is jaxcolo.ExecutorError
    assert ok_call(one_host) == 42


@pytest.mark.parametrize("fn", ["raise_with_odd_notes", "raise_system_exit"])
def test_remote_errors_that_cannot_be_re_raised_as_such(one_host, fn):
    """An exception whose notes cannot take the remote traceback used to
    kill the link's reader (the host was restarted and the call hung); a
    SystemExit would have ended the caller.  Both are ExecutorErrors."""
    from tests import colocated_types as ct

    pid = one_host.worker_pids()[0]
    f = jaxcolo.colocated_python(getattr(ct, fn)).specialize(
        out_specs_fn=_identity)
    with jaxcolo.use_executor(one_host):
        with pytest.raises(jaxcolo.ExecutorError, match=r"builtins\.("
                           r"ValueError: boom|SystemExit: 3)") as info:
            f(put(1, cpu_devices()[0]))
    assert "Remote traceback" in "\n".join(info.value.__notes__)
    assert ok_call(one_host) == 42 and one_host.worker_pids() == [pid]


_RAISE_HOLDING_A_LOCK = """
import threading

class RequestFailed(Exception):
    def __init__(self, status, conn):
        super().__init__(f"status {status}")
        self.status, self.conn = status, conn

def raise_holding_a_lock(x):
    raise RequestFailed(503, threading.Lock())
"""


def _by_value(source: str, name: str):
    """Function ``name`` of ``source``, defined in a module no process can
    import, so cloudpickle carries it and its classes by value (as it does
    a script's)."""
    namespace = {"__name__": "jaxcolo_tests_not_importable"}
    exec(source, namespace)  # noqa: S102 - the test's own source
    return namespace[name]


def _raise_args_holding_a_lock(x):
    import threading
    raise ValueError("bad row", 17, threading.Lock())


@pytest.mark.parametrize("fn, text", [
    (_by_value(_RAISE_HOLDING_A_LOCK, "raise_holding_a_lock"),
     r"RequestFailed: status 503"),
    (_raise_args_holding_a_lock, r"builtins\.ValueError: \('bad row', 17")])
def test_an_exception_holding_what_does_not_pickle_is_an_executor_error(
        one_host, fn, text):
    """Such an exception came back as its class rebuilt from its text alone
    (made without __init__: attributes gone, args replaced by one string),
    a path meant for pickles over the size limit.  The README promises an
    ExecutorError with its type name and message."""
    f = jaxcolo.colocated_python(fn).specialize(out_specs_fn=_identity)
    with jaxcolo.use_executor(one_host):
        with pytest.raises(jaxcolo.ExecutorError, match=text) as info:
            f(put(1, cpu_devices()[0]))
    assert type(info.value) is jaxcolo.ExecutorError
    assert ok_call(one_host) == 42


def test_remote_error_whose_str_fails_still_reaches_the_caller(one_host):
    """The worker built its error reply with str(e): it raised, no reply
    went out, and the caller waited forever."""
    from tests import colocated_types as ct

    f = jaxcolo.colocated_python(ct.raise_bad_str).specialize(
        out_specs_fn=_identity)
    with jaxcolo.use_executor(one_host):
        fut = f.submit(put(1, cpu_devices()[0]))
        with pytest.raises(ct.BadStr):
            fut.result(timeout=60)
    assert ok_call(one_host) == 42


def test_function_error_keeps_type_and_remote_traceback(one_host):
    class Boom(KeyError):
        pass

    def fail(x):
        raise Boom("from the host")

    with jaxcolo.use_executor(one_host):
        f = jaxcolo.colocated_python(fail).specialize(out_specs_fn=_identity)
        with pytest.raises(Boom, match="from the host") as info:
            f(put(1, cpu_devices()[0]))
    notes = "\n".join(info.value.__notes__)
    assert notes.startswith("Remote traceback from host 0 (unix:")
    assert f"pid {one_host.worker_pids()[0]})" in notes
    assert 'raise Boom("from the host")' in notes
    assert ok_call(one_host) == 42


def test_per_call_timeout(one_host, tmp_path):
    def slow(x):
        time.sleep(3.0)
        return x

    f = jaxcolo.colocated_python(slow).specialize(out_specs_fn=_identity)
    x = put(1, cpu_devices()[0])
    with jaxcolo.use_executor(one_host):
        t0 = time.monotonic()
        with one_host.timeout(0.3), pytest.raises(
                jaxcolo.ExecutorError,
                match=r"^slow: call timed out after 0.3s on host\(s\) \[0\]; "
                      r"it may still run there, its result will be dropped "
                      r"\(a host runs a thread's calls in program order: .*"
                      r"timed out and still runs\)$"):
            f(x)
        assert time.monotonic() - t0 < 2.5  # before the function ends
        assert int(f(x)) == 1  # no timeout outside the block
    assert ok_call(one_host) == 42


def _first_call_discovering(f, call) -> threading.Thread:
    """Start ``call`` (a first call of ``f``) on a thread; return once it is
    discovering the output specs."""
    first = threading.Thread(target=call)
    first.start()
    deadline = time.monotonic() + 10
    while not any(sp._discovering for sp in f._cache.values()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return first


def test_timeout_covers_waiting_for_another_threads_discovery(one_host):
    """A call waiting for another thread's first call (which discovers the
    output specs) waited as long as that took, whatever its timeout."""
    def slow_first(x):
        time.sleep(3.0)
        return x

    f = jaxcolo.colocated_python(slow_first)
    x = put(1, cpu_devices()[0])
    results = []
    with jaxcolo.use_executor(one_host):
        first = _first_call_discovering(
            f, lambda: results.append(int(f(x))))
        t0 = time.monotonic()
        with one_host.timeout(0.3), pytest.raises(
                jaxcolo.ExecutorError,
                match=r"^slow_first: call timed out waiting for "
                      "another thread's first call to discover the output "
                      "specs; it was not sent$"):
            f(x)
        assert time.monotonic() - t0 < 2.5  # before the first call ends
        first.join(30)
        assert results == [1]
        assert int(f(x)) == 1


def test_timeout_covers_waiting_for_a_restart():
    """A call made while its host restarts waited for the restart (seconds:
    a new process importing JAX), whatever its timeout."""
    with jaxcolo.ProcessExecutor(num_hosts=1) as ex:
        assert ok_call(ex) == 42
        pid = ex.worker_pids()[0]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not ex._links[0].is_lost:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        f = jaxcolo.colocated_python(lambda x: x + 1).specialize(
            out_specs_fn=_identity)
        t0 = time.monotonic()
        with jaxcolo.use_executor(ex), ex.timeout(0.3), pytest.raises(
                jaxcolo.ExecutorError,
                match=r"^call timed out after 0.3s waiting for host 0 to "
                      r"restart; it was not sent$"):
            f(put(np.int32(1), cpu_devices()[0]))
        assert time.monotonic() - t0 < 1.0
        assert ok_call(ex) == 42 and ex.worker_pids()[0] != pid


def test_a_multi_host_call_timing_out_during_a_restart_says_so():
    """A multi-host call that timed out while a host restarted said it had
    waited "for this thread's earlier calls on other hosts" (it had none),
    where a single-host call names the restart."""
    devs = cpu_devices()
    span = put(np.arange(8.0, dtype=np.float32),
               NamedSharding(Mesh(np.array(devs), ("x",)), P("x")))
    f = jaxcolo.colocated_python(_identity).specialize(
        out_specs_fn=_identity)
    with jaxcolo.ProcessExecutor(num_hosts=2) as ex, \
            jaxcolo.use_executor(ex):
        f(span)
        os.kill(ex.worker_pids()[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not ex._links[1].is_lost:
            assert time.monotonic() < deadline
            time.sleep(0.01)

        def restarting():
            return not ex._ready.is_set() or any(
                link.is_lost for link in ex._links)
        attempts = 0
        while restarting():  # (a restart takes seconds)
            try:
                with ex.timeout(0.3):
                    f(span)
                outcome = "returned"
            except jaxcolo.ExecutorError as e:
                outcome = str(e)
            if restarting():  # it waited all along for the restart
                attempts += 1
                assert re.search(r"call timed out after 0.3s waiting for "
                                 r"host [01] to restart; it was not sent$",
                                 outcome), outcome
        assert attempts
        out = f(span)  # (after the restart)
        np.testing.assert_array_equal(jax.device_get(out), np.arange(8.0))


def _children() -> set:
    out = set()
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            with open(f"/proc/{os.getpid()}/task/{task}/children") as fh:
                out |= {int(p) for p in fh.read().split()}
        except OSError:
            pass
    return out


def _host_index_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            args = fh.read().split(b"\0")
    except OSError:
        return None
    if b"--host-index" not in args:
        return None
    return int(args[args.index(b"--host-index") + 1])


def test_a_worker_dying_while_the_cluster_restarts_fails_that_start_at_once():
    """A restarting cluster's host-1 worker killed while it started: the
    start waited for host 0, which waited in jax.distributed for host 1
    until its init timeout (60 s), so every call waited over a minute.
    Every worker's exit is watched together now: the next start begins at
    once."""
    with jaxcolo.ProcessExecutor(num_hosts=2) as ex:
        assert ok_call(ex) == 42
        old = set(ex.worker_pids())
        before = _children()
        os.kill(ex.worker_pids()[1], signal.SIGKILL)  # the cluster restarts
        deadline = time.monotonic() + 60
        victim = None
        while victim is None:  # the new host 1, while it starts
            assert time.monotonic() < deadline, "no new host-1 worker"
            for pid in _children() - before - old:
                if _host_index_of(pid) == 1:
                    victim = pid
            time.sleep(0.005)
        time.sleep(0.3)
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        assert ok_call(ex) == 42
        assert time.monotonic() - t0 < 40  # (60 s and more before)
        assert victim not in ex.worker_pids()


def _worker_config(x):
    c = jax.config
    return x * 0 + (int(c.jax_enable_x64) +
                    2 * (c.jax_default_prng_impl == "rbg") +
                    4 * (c.jax_numpy_rank_promotion == "raise"))


def test_started_workers_get_the_controllers_jax_config():
    """x64 (and the default PRNG impl, ...) set in code on the controller
    did not reach the workers: float64 inputs came back float32 there, keys
    were made by another impl."""
    names = ("jax_enable_x64", "jax_default_prng_impl",
             "jax_numpy_rank_promotion")
    before = {n: getattr(jax.config, n) for n in names}
    f = jaxcolo.colocated_python(_worker_config).specialize(
        out_specs_fn=_identity)
    try:
        jax.config.update("jax_default_prng_impl", "rbg")
        jax.config.update("jax_numpy_rank_promotion", "raise")
        with jax.enable_x64(True):  # this thread's value, at the start
            ex = jaxcolo.ProcessExecutor(num_hosts=1)
            with jaxcolo.use_executor(ex):
                assert int(f(put(np.int32(5), cpu_devices()[0]))) == 7
                y = f(jax.device_put(np.float64(1.5), cpu_devices()[0]))
            assert y.dtype == np.float64 and float(y) == 7.0
        with ex:  # a restart (on a thread of its own) starts them alike
            pid = ex.worker_pids()[0]
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            with jaxcolo.use_executor(ex):
                while True:
                    try:
                        out = int(f(put(np.int32(5), cpu_devices()[0])))
                        break
                    except jaxcolo.ExecutorError:
                        assert time.monotonic() < deadline
                        time.sleep(0.1)
            assert out == 7 and ex.worker_pids()[0] != pid
    finally:
        for n, v in before.items():
            jax.config.update(n, v)


def _plus_one(x):
    return x + 1


def test_64_bit_arrays_a_worker_without_x64_cannot_hold_are_refused(one_host):
    """x64 turned on after the workers started: float64 inputs were made
    float32 there, silently dropping the values' low bits (or the reply
    did not match its spec)."""
    f = jaxcolo.colocated_python(_plus_one)
    dev = cpu_devices()[0]
    with jaxcolo.use_executor(one_host):
        with jax.enable_x64(True):
            x = jax.device_put(np.array([2.0**40 + 1, 1 / 3]), dev)
            assert x.dtype == np.float64
            with pytest.raises(ValueError,
                               match=r"float64 arrays, but jax_enable_x64 "
                                     r"is off in this process"):
                f(x)
        assert float(f(put(np.float32(1.5), dev))) == 2.5  # still serving


def _hold_the_gil(seconds):
    """Run Python for ``seconds`` without letting another thread of this
    process run (as C code holding the GIL does), burning CPU."""
    import sys
    old = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 30)
    try:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    finally:
        sys.setswitchinterval(old)


def _busy_then_plus_one(x):
    _hold_the_gil(2.5)
    return x + 1


@pytest.mark.parametrize("where", ["controller", "worker"])
def test_a_busy_process_loses_no_worker(caplog, where):
    """A process holding its GIL longer than lost_timeout: the controller
    (its readers and watchdog stopped while the heartbeats waited unread)
    lost its healthy worker when it resumed, and a function holding the
    worker's GIL (no heartbeats, but working) got its worker killed.
    Class instances living there were lost with it."""
    f = jaxcolo.colocated_python(_plus_one)
    busy = jaxcolo.colocated_python(_busy_then_plus_one)
    dev = cpu_devices()[0]
    with jaxcolo.ProcessExecutor(num_hosts=1, lost_timeout=1.0,
                                 heartbeat=0.2) as ex, \
            jaxcolo.use_executor(ex), \
            caplog.at_level(logging.WARNING, logger="jaxcolo.executor"):
        pid = ex.worker_pids()[0]
        assert int(f(put(np.int32(1), dev))) == 2
        if where == "controller":
            _hold_the_gil(2.5)
            time.sleep(0.5)  # (its watchdog looks again)
        else:
            assert int(busy(put(np.int32(3), dev))) == 4
        assert int(f(put(np.int32(2), dev))) == 3
        assert ex.worker_pids() == [pid]
    assert "was lost" not in caplog.text


def _used_and_dropped():
    ex = jaxcolo.ProcessExecutor(num_hosts=2)
    f = jaxcolo.colocated_python(lambda x: x + 1).specialize(
        out_specs_fn=_identity)
    with jaxcolo.use_executor(ex):
        assert int(f(put(np.int32(1), cpu_devices()[0]))) == 2
        assert int(f.submit(put(np.int32(2), cpu_devices()[0])).result()) == 3
    return weakref.ref(ex), ex.worker_pids()


def test_an_executor_dropped_without_close_is_collected_and_stops():
    """Its threads held it (callbacks bound to it), so an executor dropped
    without close() lived, with its workers, until the process exited."""
    ref, pids = _used_and_dropped()
    gc.collect()
    assert ref() is None
    wait_processes_exited(pids)


def _half_second_plus_one(x):
    time.sleep(0.5)
    return x + 1


def _submitted_and_dropped(timeout):
    ex = jaxcolo.ProcessExecutor(num_hosts=2, call_timeout=timeout)
    f = jaxcolo.colocated_python(_half_second_plus_one).specialize(
        out_specs_fn=_identity)
    x = jax.device_put(np.arange(8, dtype=np.int32), NamedSharding(
        Mesh(np.array(cpu_devices()), ("x",)), P("x")))
    with jaxcolo.use_executor(ex):
        return f.submit(x), weakref.ref(ex), ex.worker_pids()


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_a_dropped_executor_finishes_the_calls_its_futures_wait_for(
        timeout):
    """An executor dropped without close() while a submitted call ran was
    collected and shut down under it: the call's future never completed
    (its timeout never fired either)."""
    fut, ref, pids = _submitted_and_dropped(timeout)
    gc.collect()
    assert ref() is not None  # the pending future holds it
    np.testing.assert_array_equal(fut.result(timeout=30), np.arange(1, 9))
    wait_collected(ref)  # and lets it go once done (still held itself)
    wait_processes_exited(pids)


def test_a_dropped_executor_is_freed_once_its_submitted_calls_finish():
    """An executor dropped with submitted calls running finishes them, then
    is freed by reference counting alone (no cycle through it: a future
    holding its executor made one, kept until a cyclic collection)."""
    gc.disable()
    try:
        fut, ref, pids = _submitted_and_dropped(None)
        del fut
        assert ref() is not None  # its call runs on
        deadline = time.monotonic() + 30
        while ref() is not None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        gc.enable()
    wait_processes_exited(pids)


def test_a_submitted_calls_callbacks_run_with_its_future_not_held():
    """f.submit(x).add_done_callback(cb), the future not kept: the future
    reached from the executor only weakly was freed, and cb never ran."""
    f = jaxcolo.colocated_python(_identity).specialize(
        out_specs_fn=_identity)
    x = put(0, cpu_devices()[0])
    done = threading.Event()
    seen = []

    def step(fut):  # a pipeline driven by callbacks: 5 steps
        v = int(fut.result())
        seen.append(v)
        if v == 4:
            done.set()
        else:
            f.submit(put(v + 1, cpu_devices()[0])).add_done_callback(step)
    with jaxcolo.ProcessExecutor(num_hosts=1) as ex, \
            jaxcolo.use_executor(ex):
        f(x)
        f.submit(x).add_done_callback(step)
        assert done.wait(30), seen
    assert seen == [0, 1, 2, 3, 4]


def test_a_dropped_executor_stops_the_coordinator_host_last(capfd):
    """Released without close() (by its finalizer), an executor told host 0
    (the jax.distributed coordinator) to exit first, as close() did."""
    ex = jaxcolo.ProcessExecutor(num_hosts=2)
    assert ok_call(ex) == 42
    pids = ex.worker_pids()
    stop_process(pids[1])
    timer = threading.Timer(1.0, os.kill, (pids[1], signal.SIGCONT))
    timer.start()
    del ex
    gc.collect()
    timer.join()
    wait_processes_exited(pids)
    time.sleep(0.5)
    assert "Terminating process" not in capfd.readouterr().err


_EXIT_AFTER_RESULT = """
import os, signal, sys
mode = sys.argv.pop()
sys.path[:0] = sys.argv[1:]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np, jaxcolo

def slow_plus_one(x):
    import time
    time.sleep(0.5)
    return x + 1

def submit_and_drop():
    ex = jaxcolo.ProcessExecutor(num_hosts=2)
    f = jaxcolo.colocated_python(slow_plus_one).specialize(
        out_specs_fn=lambda x: x)
    with jaxcolo.use_executor(ex):
        fut = f.submit(jax.device_put(np.int32(7), jax.devices()[0]))
    pids = ex.worker_pids()
    if mode == "stop":  # slow to exit: the executor's release
        os.kill(pids[1], signal.SIGSTOP)  # waits, then kills it
    return fut, pids, ex._socket_dir

fut, pids, socket_dir = submit_and_drop()
print(int(fut.result(timeout=60)), socket_dir, *pids, flush=True)
"""


def _run_script(tmp_path, script: str, mode: str) -> str:
    """The stdout of ``python -c script ROOT ROOT/generated mode`` (which
    must exit 0), through files: a worker left behind would hold a pipe
    open."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(tmp_path / "out", "w+") as out, \
            open(tmp_path / "err", "w+") as err:
        code = subprocess.run(
            [sys.executable, "-c", script, root,
             os.path.join(root, "generated"), mode], stdout=out,
            stderr=err, timeout=120).returncode
        out.seek(0)
        err.seek(0)
        assert code == 0, err.read()[-2000:]
        return out.read()


def _kill_left(pids) -> None:
    """Kill the processes ``pids`` that are still there."""
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_dropped_executor_cleans_up_before_the_interpreter_exits(
        tmp_path):
    """Freed when its last call completed (on a daemon reader thread), a
    dropped executor removed its socket directory there and released the
    rest on a daemon thread: interpreter exit cut both short (its socket
    directory stayed, 2 runs in 8). Freed on the reader thread just after
    the exit hook ran, its release was cut short too: a worker that could
    not exit on its own (stopped) stayed (1 CI run in 3)."""
    for mode in ("run", "stop", "stop"):
        value, socket_dir, *pids = _run_script(
            tmp_path, _EXIT_AFTER_RESULT, mode).split()
        assert value == "8"
        try:
            wait_processes_exited([int(p) for p in pids])
        finally:
            _kill_left([int(p) for p in pids])
        assert not os.path.exists(socket_dir)


_COLLECTED_UNDER_THE_RELEASE_LOCK = """
import gc, os, sys
sys.path[:0] = sys.argv[1:]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jaxcolo
from jaxcolo.process import lifetime

ex = jaxcolo.ProcessExecutor(num_hosts=1)
pids = ex.worker_pids()
with lifetime._LIVE_LOCK:  # as a collection run by an allocation there
    del ex
    gc.collect()
print(*pids, flush=True)
"""


def test_an_executor_collected_under_the_release_lock_is_released(
        tmp_path):
    """A collection may run any executor's finalizer on a thread inside
    the release bookkeeping's lock (its allocations can start one): with
    a non-reentrant lock, that thread deadlocked."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(tmp_path / "out", "w+") as out:
        code = subprocess.run(
            [sys.executable, "-c", _COLLECTED_UNDER_THE_RELEASE_LOCK, root,
             os.path.join(root, "generated")], stdout=out, timeout=120
        ).returncode
        out.seek(0)
        pids = [int(p) for p in out.read().split()]
    assert code == 0 and pids
    wait_processes_exited(pids)


class _Plus:
    def add(self, x):
        return x + 1


def test_a_live_instance_does_not_keep_a_dropped_executor():
    """Instances held the executors their methods ran on: one dropped
    without close() lived on, with its workers, while any such instance
    did (nothing can reach that host state any more)."""
    ex = jaxcolo.ProcessExecutor(num_hosts=1)
    pids = ex.worker_pids()
    plus = jaxcolo.colocated_python_class(_Plus)()
    with jaxcolo.use_executor(ex):
        assert int(plus.add(put(np.int32(1), cpu_devices()[0]))) == 2
    ref = weakref.ref(ex)
    del ex
    gc.collect()
    assert ref() is None
    wait_processes_exited(pids)
    del plus  # its destroy finds no executor: nothing to do
    gc.collect()


def _one_second(x):
    time.sleep(1.0)
    return x


def test_timeout_counts_the_wait_for_another_threads_discovery(one_host):
    """After waiting for another thread's discovery, the call got its whole
    timeout again: a 1.5 s timeout took 2 s.  Its message names the
    timeout set, not what was left of it after the wait."""
    f = jaxcolo.colocated_python(_one_second)
    x = put(1, cpu_devices()[0])
    with jaxcolo.use_executor(one_host):
        first = _first_call_discovering(f, lambda: f(x))
        t0 = time.monotonic()
        with one_host.timeout(1.5), pytest.raises(
                jaxcolo.ExecutorError,
                match=r"^_one_second: call timed out after 1\.5s on host"):
            f(x)
        assert time.monotonic() - t0 < 1.9
        first.join(30)


def _kill_mid_call(ex, tmp_path, devices, host):
    log = tmp_path / "runs"

    def slow(x):
        with open(log, "a") as f:
            f.write("run\n")
        time.sleep(60)
        return x

    f = jaxcolo.colocated_python(slow).specialize(out_specs_fn=_identity,
                                                  devices=devices)
    x = jax.device_put(np.zeros(len(devices), np.float32), NamedSharding(
        Mesh(np.array(devices), ("x",)), P("x")))
    old = ex.worker_pids()
    with jaxcolo.use_executor(ex):
        fut = f.submit(x)
        deadline = time.monotonic() + 30
        while (not log.exists() or
               log.read_text().count("run") < len(set(
                   ex._owner[d.id] for d in devices))):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        t0 = time.monotonic()
        os.kill(old[host], signal.SIGKILL)
        with pytest.raises(jaxcolo.ExecutorError) as info:
            fut.result(timeout=30)
        elapsed = time.monotonic() - t0
    return info.value, elapsed, old, log


def test_worker_killed_mid_call(one_host, tmp_path):
    err, elapsed, old, log = _kill_mid_call(one_host, tmp_path,
                                            cpu_devices()[:1], 0)
    assert str(err).startswith("host 0 (unix:")
    assert f"pid {old[0]}) was lost while this call was in flight " in str(err)
    assert str(err).endswith("; the call was not retried")
    assert elapsed < 5.0  # EOF: no need to wait for the heartbeat timeout
    assert ok_call(one_host) == 42  # after the restart
    assert one_host.worker_pids()[0] != old[0]
    assert log.read_text() == "run\n"  # ran once, never retried
    assert one_host.stats()["restarts"] == 1


@pytest.mark.parametrize("hosts", [2, 4])
def test_worker_killed_mid_call_multi_host(tmp_path, hosts, capfd):
    with jaxcolo.ProcessExecutor(num_hosts=hosts) as ex:
        err, elapsed, old, log = _kill_mid_call(ex, tmp_path, cpu_devices(),
                                                hosts - 1)
        assert f"pid {old[-1]}) was lost while this call was in flight" in \
            str(err)
        assert elapsed < 5.0
        assert ok_call(ex) == 42
        new = ex.worker_pids()
        assert not set(new) & set(old)  # the whole cluster restarted
        assert log.read_text() == "run\n" * hosts  # once per host, no retry
    # the restart killed host 0 (the coordinator) last: the other hosts did
    # not see it vanish and log that as a fatal error
    assert "Terminating process" not in capfd.readouterr().err


def test_host_lost_while_sending_never_reaches_the_restarted_cluster(
        tmp_path):
    """Kill host 1 and call at once with large shards: whatever the timing,
    a failed call ran on no host of the restarted cluster (a part sent
    there would run alone), and a call that succeeded ran on both of its
    new hosts."""
    log = tmp_path / "runs"

    def mark(x):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {int(x.addressable_shards[0].data[0, 0])}"
                    "\n")
        return x

    fc = jaxcolo.colocated_python(mark).specialize(out_specs_fn=_identity)
    devs = cpu_devices()
    sharding = NamedSharding(Mesh(np.array(devs), ("x",)), P("x"))
    with jaxcolo.ProcessExecutor(num_hosts=2) as ex, jaxcolo.use_executor(ex):
        fc(jax.device_put(np.zeros((8, 1 << 20), np.float32), sharding))
        for round_ in range(1, 3):
            x = jax.device_put(np.full((8, 16 << 20), round_, np.float32),
                               sharding)
            old = ex.worker_pids()
            os.kill(old[1], signal.SIGKILL)
            try:
                fc(x)
                failed = False
            except jaxcolo.ExecutorError:
                failed = True
            deadline = time.monotonic() + 60
            while ex.stats()["restarts"] < round_:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert ok_call(ex) == 42
            new = ex.worker_pids()
            assert not set(new) & set(old)
            runs = [int(p) for p, v in map(str.split,
                                           log.read_text().splitlines())
                    if v == str(round_)]
            if failed:
                assert not set(runs) & set(new), (runs, old, new)
            else:
                assert sorted(runs) == sorted(new), (runs, old, new)


def test_without_restart_a_lost_cluster_says_which_host_was_lost():
    """restart=False: host 1 killed takes its cluster down.  Calls to
    host 0 said only that host 0 "was lost (restart is off)" -- not that
    it went down with host 1, nor why host 1 was lost."""
    f = jaxcolo.colocated_python(_identity).specialize(
        out_specs_fn=_identity)
    devs = cpu_devices()
    both = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(
        Mesh(np.array(devs), ("x",)), P("x")))
    on0, on1 = put(3, devs[0]), put(4, devs[-1])
    with jaxcolo.ProcessExecutor(num_hosts=2, restart=False) as ex, \
            jaxcolo.use_executor(ex):
        assert int(f(on0)) == 3 and int(f(on1)) == 4
        pids = ex.worker_pids()
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not ex._links[0].is_lost:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        lost1 = (rf"host 1 \(unix:[^,]*, pid {pids[1]}\) was lost \(restart "
                 r"is off\): connection closed by peer")
        lost0 = (rf"^host 0 \(unix:[^,]*, pid {pids[0]}\) was lost \(restart "
                 r"is off\): its cluster went down with host 1 \(unix:[^,]*, "
                 rf"pid {pids[1]}\), lost: connection closed by peer$")
        for x, expected in ((both, lost0), (on0, lost0), (on1, f"^{lost1}$")):
            with pytest.raises(jaxcolo.ExecutorError, match=expected):
                f(x)
        assert ex.stats()["restarts"] == 0
    wait_processes_exited(pids)


def test_close_stops_the_coordinator_host_last(capfd):
    """close() told host 0 (the jax.distributed coordinator) to exit
    first: a host still busy then (here: stopped for a second) found the
    coordinator gone and aborted with a fatal error on stderr."""
    with jaxcolo.ProcessExecutor(num_hosts=2) as ex:
        assert ok_call(ex) == 42
        pids = ex.worker_pids()
        stop_process(pids[1])
        timer = threading.Timer(1.0, os.kill, (pids[1], signal.SIGCONT))
        timer.start()
    timer.join()
    wait_processes_exited(pids)
    time.sleep(0.5)  # (a fatal error would be written by now)
    err = capfd.readouterr().err
    assert "Terminating process" not in err and "coordination" not in err, \
        err[-2000:]


def test_close_waits_for_hung_workers_together():
    """close() gave each worker that did not exit 5 s, one after another:
    three stopped workers held it 15 s."""
    ex = jaxcolo.ProcessExecutor(num_hosts=4)
    pids = ex.worker_pids()
    for pid in pids[1:]:
        stop_process(pid)
    t0 = time.monotonic()
    ex.close()
    assert time.monotonic() - t0 < 9
    wait_processes_exited(pids)


def test_a_failed_start_leaves_no_socket_directory():
    """The socket directory of workers that failed to start was removed
    only by a finalizer of the half-made executor."""
    import glob
    import tempfile
    pattern = os.path.join(tempfile.gettempdir(), "jaxcolo-*")
    before = set(glob.glob(pattern))
    with pytest.raises(jaxcolo.ExecutorError, match="exited with code 2 "
                       "before listening"):
        jaxcolo.ProcessExecutor(num_hosts=1, worker_args=("--bogus",))
    assert set(glob.glob(pattern)) <= before


def test_close_wakes_a_stats_request_waiting_for_its_reply():
    """stats() on another thread, waiting for a worker that had not
    answered yet, was not woken by close() and waited out its timeout."""
    ex = jaxcolo.ProcessExecutor(num_hosts=1)
    pid = ex.worker_pids()[0]
    stop_process(pid)  # a worker that does not answer (yet)
    out = {}

    def ask():
        t0 = time.monotonic()
        out["hosts"] = ex.stats(timeout=60)["hosts"]
        out["took"] = time.monotonic() - t0
    t = threading.Thread(target=ask)
    t.start()
    time.sleep(0.3)  # (asked; no reply)
    ex.close()  # waits 5 s for the stopped worker, then kills it
    t.join(60)
    assert out["took"] < 10, out
    assert list(out["hosts"][0]) == ["error"], out  # (and why)
    wait_processes_exited([pid])


def test_instances_on_a_restarted_host_fail_clearly(tmp_path):
    @jaxcolo.colocated_python_class
    class Counter:
        def __init__(self):
            self.n = 0

        def bump(self, x):
            self.n += 1
            return jax.device_put(np.int32(self.n), x.sharding)

    x = put(0, cpu_devices()[0])
    with jaxcolo.ProcessExecutor(num_hosts=1) as ex, jaxcolo.use_executor(ex):
        c = Counter()
        assert int(c.bump(x)) == 1 and int(c.bump(x)) == 2
        old = ex.worker_pids()[0]
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while ex.worker_pids()[0] == old:  # restarted (no call was lost)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert ok_call(ex) == 42
        with pytest.raises(jaxcolo.ExecutorError,
                           match=r"^Counter.bump: the host instance \d+ was "
                                 r"lost \(host 0 .* was lost\); its state is "
                                 "gone, make a new instance$"):
            c.bump(x)
        assert int(Counter().bump(x)) == 1


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_wrong_key_is_refused_and_logged(capfd, transport):
    # A fresh executor: its worker writes its log to this test's stderr.
    one_host = jaxcolo.ProcessExecutor(num_hosts=1, local_transport=transport)
    addr = one_host.addresses()[0]
    with pytest.raises(jaxcolo.ExecutorError,
                       match="^authentication failed: digest sent was "
                             r"rejected \(the peer at "):
        ch.connect(addr, b"not the key", handshake.local_hello("controller"),
                   timeout=5)
    deadline = time.monotonic() + 10
    err = ""
    while "refused connection" not in err and time.monotonic() < deadline:
        time.sleep(0.05)
        err += capfd.readouterr().err
    assert addr.startswith("unix:/" if transport == "unix" else "127.0.0.1:")
    assert ("WARNING refused connection from "
            + ("unix:/" if transport == "unix" else "127.0.0.1:")) in err
    assert "authentication failed: digest received was wrong" in err
    assert ok_call(one_host) == 42
    one_host.close()


@pytest.mark.parametrize("old_side", ["controller", "worker"])
def test_version_skew_is_refused_with_both_ranges(old_side, one_host):
    kwargs = ({"max_version": 1} if old_side == "controller" else
              {"min_version": 8, "worker_args": ["--max-version", "5"]})
    # (told to speak an older version than its jaxcolo writes)
    advice = (r"raise this controller's max_version \(its jaxcolo writes up "
              if old_side == "controller" else
              r"raise the worker's --max-version \(its jaxcolo writes up ")
    new, need = jaxcolo.SCHEMA_VERSION, versions.FEATURE_SINCE["message"]
    ranges = (rf"this controller speaks 1\.\.1 .*, the worker speaks 1\.\.{new} "
              if old_side == "controller" else
              rf"this controller speaks 8\.\.{new} .*, the worker speaks 1\.\.5 ")
    with pytest.raises(jaxcolo.VersionError,
                       match=r"^no common payload version: " + ranges +
                             rf".*\(executor calls need version >= {need}\); " +
                             advice + r".* - at \$\.hello$"):
        jaxcolo.ProcessExecutor(num_hosts=1, start_timeout=60, **kwargs)
    assert ok_call(one_host) == 42


def test_malformed_frames_are_refused_and_logged(one_host, caplog):
    link = one_host._links[0]
    before = one_host.stats()["refused"]
    good = messages.encode(messages.Message(messages.MessageKind.ping))
    corrupt = good[:-1] + bytes([good[-1] ^ 0xFF])
    wrong_kind = messages.encode(messages.Message(messages.MessageKind.result,
                                                  call_id=99))
    with caplog.at_level(logging.WARNING, logger="jaxcolo.executor"):
        for frame in (b"garbage, not a payload", corrupt, wrong_kind):
            link.channel.send(frame)
        assert ok_call(one_host) == 42  # the worker lives on, in order
        deadline = time.monotonic() + 10
        while len([r for r in caplog.records if "refused" in r.message]) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    texts = [r.getMessage() for r in caplog.records if "refused" in
             r.getMessage()]
    pid = one_host.worker_pids()[0]
    assert texts[0] == (
        f"host 0 (pid {pid}) refused a message: malformed message: not a "
        "jaxcolo payload (magic b'garb', expected b'JXCO') - at "
        "$.header.magic")
    assert texts[1].endswith("malformed message: checksum mismatch: the "
                             "payload is corrupt or truncated - at "
                             "$.header.crc32")
    assert texts[2].endswith("refused a message: unexpected result message")
    assert one_host.stats()["refused"] == before + 3
    assert ok_call(one_host, 1) == 2


def test_close_with_calls_in_flight(tmp_path):
    log = tmp_path / "started"

    def slow(x):
        log.write_text("started")
        time.sleep(30)
        return x

    f = jaxcolo.colocated_python(slow).specialize(out_specs_fn=_identity)
    x = put(1, cpu_devices()[0])
    ex = jaxcolo.ProcessExecutor(num_hosts=1)
    with jaxcolo.use_executor(ex):
        futs = [f.submit(x) for _ in range(3)]
        deadline = time.monotonic() + 30
        while not log.exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        t0 = time.monotonic()
        ex.close()
        assert time.monotonic() - t0 < 10
        for fut in futs:
            with pytest.raises(jaxcolo.ExecutorError,
                               match=r"^ProcessExecutor closed while this "
                                     r"call was in flight on host 0 "):
                fut.result(timeout=5)
        with pytest.raises(jaxcolo.ExecutorError,
                           match="^ProcessExecutor is closed$"):
            f(x)
    with jaxcolo.ProcessExecutor(num_hosts=1) as again:
        assert ok_call(again) == 42


def test_unowned_devices_and_bad_arguments():
    with pytest.raises(ValueError, match="give either num_hosts"):
        jaxcolo.ProcessExecutor()
    with pytest.raises(ValueError, match="8 devices do not split into 3"):
        jaxcolo.ProcessExecutor(num_hosts=3)
    with pytest.raises(ValueError, match="needs authkey"):
        jaxcolo.ProcessExecutor(addresses=["127.0.0.1:1"])
    # (were "min() arg is an empty sequence", and a str taken per character)
    with pytest.raises(ValueError, match="addresses is empty"):
        jaxcolo.ProcessExecutor(addresses=[], authkey=b"k")
    with pytest.raises(TypeError, match="addresses must be a list of "
                       r"'HOST:PORT' .* not a str$"):
        jaxcolo.ProcessExecutor(addresses="127.0.0.1:5000", authkey=b"k")


def test_concurrent_multi_host_calls_from_several_threads(two_hosts):
    """Calls spanning hosts, from 4 threads at once: every host runs them in
    the same order, so their collectives line up (no deadlock)."""
    devs = cpu_devices()
    mesh = Mesh(np.array(devs), ("x",))

    def total(x):
        return jax.jit(lambda v: v.sum(), out_shardings=NamedSharding(
            x.sharding.mesh, P()))(x)

    f = jaxcolo.colocated_python(total).specialize(
        out_specs_fn=lambda x: jax.ShapeDtypeStruct(
            (), x.dtype, sharding=NamedSharding(mesh, P())))
    errors = []

    def run(t):
        try:
            for i in range(10):
                x = jax.device_put(np.full(8, t * 100 + i, np.float32),
                                   NamedSharding(mesh, P("x")))
                assert float(f(x)) == 8.0 * (t * 100 + i)
        except BaseException as e:
            errors.append(e)

    with jaxcolo.use_executor(two_hosts):
        threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
    assert errors == []


def _sum_unless_host0_refuses(x):
    """Host 0 raises for negative inputs, before the collective its other
    hosts enter."""
    k = float(x.addressable_shards[0].data[0])
    if jax.process_index() == 0 and k < 0:
        if k <= -2:  # late: later calls are sent to it meanwhile
            time.sleep(0.5)
        raise ValueError("host 0 refuses")
    return jax.jit(lambda v: v.sum(), out_shardings=NamedSharding(
        x.sharding.mesh, P()))(x)


def _raise_on(hosts):
    def fail_on_some(x):
        if jax.process_index() in hosts:
            raise KeyError(f"host {jax.process_index()}")
        return x
    return fail_on_some


def _sum_program():
    mesh = Mesh(np.array(cpu_devices()), ("x",))
    f = jaxcolo.colocated_python(_sum_unless_host0_refuses).specialize(
        out_specs_fn=lambda x: jax.ShapeDtypeStruct(
            (), x.dtype, sharding=NamedSharding(mesh, P())))
    return f, lambda k: jax.device_put(np.full(8, k, np.float32),
                                       NamedSharding(mesh, P("x")))


def test_stats_of_a_host_lost_while_asked_say_why_there_are_none():
    """A worker lost while stats() waited for its reply: stats() raised
    AttributeError ('NoneType' object has no attribute 'get'; found by
    review).  That host's stats say why there are none (they were {},
    as if the host had nothing to count)."""
    with jaxcolo.ProcessExecutor(num_hosts=1, lost_timeout=1.0,
                                 heartbeat=0.25) as ex:
        pid = ex.worker_pids()[0]
        stop_process(pid)
        try:
            out = ex.stats(timeout=10.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert out["hosts"] == [{"error": f"host 0 ({ex.addresses()[0]}, "
                                          f"pid {pid}) was lost before it "
                                          "replied with its stats"}]
        assert ok_call(ex) == 42 and ex.stats()["lost"] == 1


@pytest.mark.parametrize("max_version", [None, 6], ids=["v8", "v6"])
def test_calls_submitted_after_a_host_failed_before_a_collective(max_version):
    """Submitted, the calls after the failed one are sent while host 1
    still waits in its collective: at v6 they returned 4.0 and 20.0 for 16
    and 24, then hung (found by review).  Each is right or fails."""
    f, make = _sum_program()
    with jaxcolo.ProcessExecutor(num_hosts=2, straggler_timeout=1.0,
                                 max_version=max_version) as ex, \
            jaxcolo.use_executor(ex):
        assert float(f(make(1))) == 8.0
        with pytest.raises(ValueError, match="host 0 refuses"):
            f(make(-1))
        futures = {k: f.submit(make(k)) for k in (2, 3, 4)}
        for k, future in futures.items():
            try:
                assert float(future.result(60)) == 8.0 * k
            except jaxcolo.ExecutorError as e:
                assert "was lost while this call was in flight" in str(e)
        assert float(f(make(5))) == 40.0


@pytest.mark.parametrize("max_version", [None, 6], ids=["v8", "v6"])
def test_calls_sent_before_a_host_failed_before_a_collective(max_version):
    """Submitted before host 0's failure came, the calls behind it ran at
    once on host 0 (a session before v7 cannot hold) while host 1 waited
    in the failed call's collective: at v6 they returned 12.0 and 36.0 for
    32 and 40, then hung (found by review).  Each is right or fails."""
    f, make = _sum_program()
    with jaxcolo.ProcessExecutor(num_hosts=2, straggler_timeout=1.0,
                                 max_version=max_version) as ex, \
            jaxcolo.use_executor(ex):
        assert float(f(make(1))) == 8.0
        futures = {k: f.submit(make(k)) for k in (-2, 4, 5, 6)}
        with pytest.raises(ValueError, match="host 0 refuses"):
            futures.pop(-2).result(60)
        for k, future in futures.items():
            try:
                assert float(future.result(60)) == 8.0 * k
            except jaxcolo.ExecutorError as e:
                assert "was lost while this call was in flight" in str(e)
        assert float(f(make(7))) == 56.0


def _right_or_interrupted(f, make, ks, why: str) -> None:
    """Sums of ``make(k)`` for ``ks``: each is right, or fails with an
    ExecutorError saying ``why`` -- never wrong; the last is right."""
    outcomes = []
    for k in ks:
        try:
            outcomes.append(float(f(make(k))) == 8.0 * k)
        except jaxcolo.ExecutorError as e:
            assert why in str(e)
            outcomes.append("interrupted")
    assert outcomes[-1] is True and False not in outcomes, outcomes


@pytest.mark.parametrize("max_version", [None, 6], ids=["v8", "v6"])
def test_a_host_failing_before_a_collective_restarts_the_cluster(
        max_version):
    """Host 0 raised while host 1 waited in the call's collective.  Host 1
    then paired that collective with host 0's *next* call: later calls
    returned sums of the wrong inputs (or hung), forever.  Now the host
    that failed holds its next multi-host calls until the others are done
    (sessions before v7, whose hosts cannot hold: the controller, which
    sent them at once -- found by review); a host still stuck after
    straggler_timeout gets the cluster restarted."""
    f, make = _sum_program()
    with jaxcolo.ProcessExecutor(num_hosts=2, straggler_timeout=1.0,
                                 max_version=max_version) as ex:
        pids = ex.worker_pids()
        with jaxcolo.use_executor(ex):
            assert float(f(make(1))) == 8.0
            with pytest.raises(ValueError, match="host 0 refuses"):
                f(make(-1))
            _right_or_interrupted(f, make, range(2, 6),
                                  "after it failed or timed out")
        assert ex.stats()["restarts"] == 1
        assert set(ex.worker_pids()).isdisjoint(pids)


def test_a_host_failing_before_the_first_collective_restarts_the_cluster():
    """The same, with no collective run before on those devices: host 1's
    gloo setup timed out after 30 s (not a hang), so its part ended, the
    hosts counted as done and host 0 was resumed.  But host 1 had set up
    gloo state host 0 had not: the next call failed with that gloo error,
    the one after waited 60 s for host 0's stuck collective.  Now a part
    failing in gloo restarts the cluster at once."""
    f, make = _sum_program()
    with jaxcolo.ProcessExecutor(num_hosts=2) as ex:  # straggler: 60 s
        pids = ex.worker_pids()
        with jaxcolo.use_executor(ex):
            with pytest.raises(ValueError, match="host 0 refuses"):
                f(make(-1))
            started = time.monotonic()
            _right_or_interrupted(f, make, range(2, 5),
                                  "collectives are out of step")
            assert time.monotonic() - started < 55  # not straggler_timeout
        assert ex.stats()["restarts"] == 1
        assert set(ex.worker_pids()).isdisjoint(pids)


def _gloo_fails_on_host1(x):
    if jax.process_index() == 1:  # what a host's all-reduce raises when a
        raise jax.errors.JaxRuntimeError(  # peer died in the middle of it
            "INTERNAL: Gloo all-reduce failed: Connection closed by peer")
    return x


def test_a_part_failing_in_the_collectives_is_an_executor_error():
    """A worker killed in the middle of a multi-host call's collectives:
    the other host's part fails in gloo, and when its reply came before the
    killed worker's end was seen, the caller got that JaxRuntimeError, not
    the ExecutorError of a worker lost mid-call (found by review, 3 of 8
    kills).  A part failing in the collectives is an executor event (the
    cluster restarts): ExecutorError, caused by the remote error."""
    f = jaxcolo.colocated_python(_gloo_fails_on_host1).specialize(
        out_specs_fn=lambda x: x)
    g, make = _sum_program()
    with jaxcolo.ProcessExecutor(num_hosts=2) as ex, \
            jaxcolo.use_executor(ex):
        pids = ex.worker_pids()
        with pytest.raises(jaxcolo.ExecutorError,
                           match=r"host 1's part failed in the hosts' "
                                 r"collectives \(jax.errors.JaxRuntimeError: "
                                 r"INTERNAL: Gloo all-reduce failed.*out of "
                                 r"step") as info:
            f(make(1))
        assert isinstance(info.value.__cause__, jax.errors.JaxRuntimeError)
        assert float(g(make(2))) == 16.0  # (after the restart)
        assert ex.stats()["restarts"] == 1
        assert set(ex.worker_pids()).isdisjoint(pids)


@pytest.mark.parametrize("failing", [(0,), (0, 1)], ids=["one", "both"])
def test_a_multi_host_call_failing_without_collectives_resumes(two_hosts,
                                                               failing):
    """The hosts whose part failed hold their next multi-host calls until
    every host is done, then go on: no restart, results right."""
    f, make = _sum_program()
    g = jaxcolo.colocated_python(_raise_on(failing)).specialize(
        out_specs_fn=lambda x: x)
    pids = two_hosts.worker_pids()
    restarts = two_hosts.stats()["restarts"]
    with jaxcolo.use_executor(two_hosts), two_hosts.timeout(60):
        for k in range(1, 4):
            with pytest.raises(KeyError, match="host [01]"):
                g(make(k))
            assert float(f(make(k))) == 8.0 * k
    assert two_hosts.worker_pids() == pids
    assert two_hosts.stats()["restarts"] == restarts


def test_failed_multi_host_calls_keep_nothing_alive(two_hosts):
    """Each failed multi-host call started a 60 s timer thread holding the
    call -- its exception, traceback and inputs -- until it fired."""
    f, make = _sum_program()
    g = jaxcolo.colocated_python(_raise_on((0,))).specialize(
        out_specs_fn=lambda x: x)
    with jaxcolo.use_executor(two_hosts):
        with pytest.raises(KeyError):
            g(make(1))
        threads = threading.active_count()
        for k in range(20):
            with pytest.raises(KeyError):
                g(make(k))
        assert float(f(make(2))) == 16.0
    assert threading.active_count() < threads + 5




def test_hung_worker_is_lost_after_lost_timeout(tmp_path):
    with jaxcolo.ProcessExecutor(num_hosts=1, lost_timeout=2.0,
                                 heartbeat=0.25) as ex:
        pid = ex.worker_pids()[0]
        f = jaxcolo.colocated_python(lambda x: x).specialize(
            out_specs_fn=_identity)
        with jaxcolo.use_executor(ex):
            x = put(1, cpu_devices()[0])
            assert int(f(x)) == 1
            stop_process(pid)  # alive, but silent
            try:
                t0 = time.monotonic()
                with pytest.raises(jaxcolo.ExecutorError,
                                   match=r"was lost while this call was in "
                                         r"flight \(no message for 2\.\d+s "
                                         r"\(heartbeats stopped\)\)"):
                    f(x)
                assert 1.5 < time.monotonic() - t0 < 8
            finally:
                os.kill(pid, signal.SIGCONT)
            assert int(f(x)) == 1  # on the restarted worker
        assert ex.worker_pids()[0] != pid


def test_an_exception_text_utf8_cannot_hold_comes_back(one_host):
    """A function raising with a lone surrogate in its text: the worker
    could not encode its error reply, and the call waited for its
    timeout."""
    def bad(v):
        raise ValueError("bad \ud800 text")
    f = jaxcolo.colocated_python(bad)
    with jaxcolo.use_executor(one_host):
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="bad"):
            with one_host.timeout(30.0):
                f(put(np.int32(1), cpu_devices()[0]))
        assert time.monotonic() - t0 < 10
        assert ok_call(one_host) == 42


def test_sessions_before_v7_refuse_weak_arguments_and_leave_causes_out(
        monkeypatch):
    """Workers before version 7 built arguments strongly typed (a weak f32
    + bf16 gave f32 there, bf16 in-process, silently) and controllers
    before 7 rebuild exceptions from three arguments (every remote
    exception reached them as an ExecutorError: causes made it four).
    Sessions before 7 refuse weakly typed arguments and pickle exceptions
    without causes; sessions from 7 keep both."""
    from jaxcolo.process import remote_errors
    from tests import colocated_types as ct

    real = remote_errors.rebuild_exception
    for version, cause in ((6, None), (7, KeyError)):
        try:
            raise ct.Coded(3, where="here") from KeyError("missing")
        except ct.Coded as e:
            msg = remote_errors.error_message(1, e, "w", version)
        plain = remote_errors.error_message(1, KeyError("k"), "w", version)
        with monkeypatch.context() as m:  # a controller before version 7
            m.setattr(remote_errors, "rebuild_exception",
                      lambda cls, args, state: real(cls, args, state))
            back = remote_errors.loads_exception(msg.error_pickle)
            assert (type(back) is ct.Coded) == (cause is None)
            assert type(remote_errors.loads_exception(
                plain.error_pickle)) is KeyError
        back = remote_errors.loads_exception(msg.error_pickle)
        assert type(back) is ct.Coded and back.code == 3
        assert type(back.__cause__) is (KeyError if cause else type(None))

    d = cpu_devices()[0]
    weak, strong = jax.device_put(2.0, d), put(np.float32(2.0), d)
    b = put(np.ones(3, jnp.bfloat16), d)
    add = jaxcolo.colocated_python(lambda a, b: a + b)
    raiser = jaxcolo.colocated_python(ct.raise_with_cause).specialize(
        out_specs_fn=lambda x: x)
    for version in (6, 7):
        with jaxcolo.ProcessExecutor(num_hosts=1, max_version=version) as ex, \
                jaxcolo.use_executor(ex):
            assert ex.payload_version == version
            if version < 7:
                with pytest.raises(jaxcolo.EncodeError, match=(
                        r"a weakly typed argument; workers of a version-6 "
                        r"session would make it strongly typed .* - at "
                        r"\$\[0\]\[0\]$")):
                    add(weak, b)
            else:
                assert add(weak, b).dtype == jnp.bfloat16
            assert add(strong, b).dtype == jnp.float32
            with pytest.raises(ct.Coded, match="error 3 at the lookup") as e:
                raiser(put(1, d))
            assert type(e.value.__cause__) is \
                (KeyError if version >= 7 else type(None))


_SUBMIT_THEN_EXIT = """
import os, sys
keep = sys.argv.pop() == "keep"
sys.path[:0] = sys.argv[1:]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np, jaxcolo

def slow_plus_one(x):
    import time
    time.sleep(1.0)
    return x + 1

def report(u):
    import time
    time.sleep(0.5)  # (a callback that takes a moment runs to its end)
    print("done", int(u.result()), flush=True)

ex = jaxcolo.ProcessExecutor(num_hosts=1)
f = jaxcolo.colocated_python(slow_plus_one).specialize(
    out_specs_fn=lambda x: x)
x = jax.device_put(np.int32(7), jax.devices()[0])
with jaxcolo.use_executor(ex):
    fut = f.submit(x)
fut.add_done_callback(report)

def flood():  # a daemon thread submitting for ever: refused at exit
    try:
        with jaxcolo.use_executor(ex):
            while True:
                f.submit(x).result()
    except jaxcolo.ExecutorError as e:
        print("refused:", e, flush=True)

if keep:
    import threading
    threading.Thread(target=flood, daemon=True).start()
print("pids", *ex.worker_pids(), flush=True)
if not keep:
    del ex
"""


def test_interpreter_exit_lets_submitted_calls_finish(tmp_path):
    """A call submitted just before the script ended was cut off: weakref's
    own exit hook ran the executor's finalizer first, which stopped its
    workers mid-call; the future stayed running and its callbacks never
    ran, whether the executor was dropped or still held.  Exit now refuses
    new submits (a daemon thread submitting in a loop kept it waiting for
    ever), waits for the calls submitted before and their callbacks (one
    still running on its thread was cut off), as a ThreadPoolExecutor's
    does, then shuts the executor down."""
    for mode in ("drop", "keep"):
        lines = _run_script(tmp_path, _SUBMIT_THEN_EXIT, mode).split("\n")
        pids = [int(p) for p in lines[0].split()[1:]]
        try:
            assert "done 8" in lines, lines
            if mode == "keep":
                assert "refused: the interpreter is exiting: no new calls " \
                    "are submitted (those submitted before finish)" in lines
            assert lines[-1] == "", lines
            wait_processes_exited(pids)
        finally:
            _kill_left(pids)


_CALLBACK_EXITS = """
import os, sys, time
close = sys.argv.pop() == "close"
sys.path[:0] = sys.argv[1:]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np, jaxcolo

def nap_plus_one(x):
    import time
    time.sleep(0.3)
    return x + 1

ex = jaxcolo.ProcessExecutor(num_hosts=1)
f = jaxcolo.colocated_python(nap_plus_one).specialize(
    out_specs_fn=lambda x: x)
x = jax.device_put(np.int32(7), jax.devices()[0])
print("pids", *ex.worker_pids(), ex._socket_dir, flush=True)
with jaxcolo.use_executor(ex):
    futs = [f.submit(x) for _ in range(3)]
for u in futs:
    u.add_done_callback(lambda u: sys.exit(3))
if close:  # the callbacks run inline in close(), failing the calls
    try:
        ex.close()
    except SystemExit as e:
        print("close raised SystemExit", e.code, flush=True)
    print("failed", sum(isinstance(u.exception(), jaxcolo.ExecutorError)
                        for u in futs), flush=True)
else:
    print("results", [int(u.result(30)) for u in futs], flush=True)
    time.sleep(0.2)
"""


def test_a_done_callback_raising_system_exit_stops_nothing(tmp_path):
    """sys.exit in a submitted call's done-callback skipped the bookkeeping
    after it: interpreter exit then waited for that call for ever.  Run
    inline by close() (failing the calls in flight), it cut close() short:
    the other calls never failed, the workers stayed, and exit hung."""
    for mode in ("run", "close"):
        lines = _run_script(tmp_path, _CALLBACK_EXITS, mode).split("\n")
        pids = [int(p) for p in lines[0].split()[1:-1]]
        try:
            if mode == "close":
                assert "close raised SystemExit 3" in lines, lines
                assert "failed 3" in lines, lines
            else:
                assert "results [8, 8, 8]" in lines, lines
            wait_processes_exited(pids)
            assert not os.path.exists(lines[0].split()[-1])
        finally:
            _kill_left(pids)


def test_inline_lane_outlives_a_callback_raising_system_exit():
    """InlineExecutor: sys.exit in a done-callback killed the lane's
    thread with the lane marked running; its later calls never ran."""
    import sys
    nap = jaxcolo.colocated_python(
        lambda x: (time.sleep(0.1), x + 1)[1]).specialize(
            out_specs_fn=_identity)
    x = put(np.int32(1), cpu_devices()[0])
    with jaxcolo.InlineExecutor() as ex, jaxcolo.use_executor(ex):
        u = nap.submit(x)
        u.add_done_callback(lambda _: sys.exit(1))
        assert int(u.result(10)) == 2
        assert int(nap.submit(x).result(10)) == 2


def test_inline_close_outlives_a_callback_raising_system_exit():
    """InlineExecutor.close() failed the queued calls inline, under its
    lock: sys.exit in one's callback cut close() short, and the calls
    queued behind it then ran, after the close."""
    import sys
    nap = jaxcolo.colocated_python(
        lambda x: (time.sleep(0.5), x + 1)[1]).specialize(
            out_specs_fn=_identity)
    x = put(np.int32(1), cpu_devices()[0])
    ex = jaxcolo.InlineExecutor()
    with jaxcolo.use_executor(ex):
        futs = [nap.submit(x) for _ in range(4)]  # one runs, three queue
    futs[1].add_done_callback(lambda _: sys.exit(3))
    time.sleep(0.1)
    with pytest.raises(SystemExit):
        ex.close()
    assert int(futs[0].result(10)) == 2
    for u in futs[1:]:
        with pytest.raises(jaxcolo.ExecutorError, match="closed before"):
            u.result(10)


def test_a_send_that_finds_the_worker_gone_declares_it_lost():
    """A worker killed while the executor idled: the next call's send fails
    (broken pipe) before the background reader sees the EOF.  That failure
    did not declare the worker lost, so the call after it went to the same
    dead connection and failed too, instead of waiting for the restart."""
    f = jaxcolo.colocated_python(_identity).specialize(
        out_specs_fn=_identity)
    x = put(3, cpu_devices()[0])
    failed = 0
    with jaxcolo.ProcessExecutor(num_hosts=1) as ex, jaxcolo.use_executor(ex):
        assert int(f(x)) == 3
        for rep in range(3):
            link = ex._links[0]
            os.kill(ex.worker_pids()[0], signal.SIGKILL)
            # its end of the connection closed, well before the background
            # reader's next read (the kernel may close a killed process's
            # sockets some time after it is a zombie: a send before that
            # still succeeds, and the reply's read finds the reset)
            deadline = time.monotonic() + 10
            while not link.channel.input_waiting() and \
                    time.monotonic() < deadline:
                time.sleep(0.001)
            try:
                assert int(f(x)) == 3  # (the restart came first)
            except jaxcolo.ExecutorError as e:
                failed += 1
                assert re.match(r"host 0 .* was lost before the call could "
                                r"be sent \(connection lost: .*\); it was "
                                r"not sent$", str(e)), str(e)
                assert int(f(x)) == 3  # waits for the restart
        assert ex.stats()["restarts"] == 3
    assert failed, "no call met the dead connection: the test tested nothing"


@pytest.mark.parametrize("context", ["numpy key", "over the size limit",
                                     "module not imported here"])
def test_a_context_that_cannot_travel_costs_only_itself(context):
    """An exception raised while handling another (its __context__ travels)
    came back as an ExecutorError when the controller could not rebuild the
    context (a KeyError of a numpy key; a class of a module the worker
    imported and the controller did not), or lost its attributes when the
    context took it over the size limit; only the context is dropped now."""
    import sys
    import types
    from jaxcolo.process import remote_errors
    from tests import colocated_types as ct

    module = types.ModuleType("jaxcolo_tests_worker_only")
    exec("class ConfigError(Exception):\n    pass", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        try:
            try:
                if context == "numpy key":
                    {}[np.int64(6)]
                if context == "module not imported here":
                    raise module.ConfigError("bad config")
                raise ValueError("x" * (remote_errors.MAX_ERROR_PICKLE + 1))
            except Exception:
                raise ct.Coded(5, where="the handler")
        except ct.Coded as e:
            msg = remote_errors.error_message(1, e, "w",
                                              versions.SCHEMA_VERSION)
    finally:
        del sys.modules[module.__name__]  # (the controller never had it)
    back = remote_errors.loads_exception(msg.error_pickle)
    assert type(back) is ct.Coded and back.code == 5
    assert back.args == ("error 5 at the handler",)
    assert back.__context__ is None


def test_a_suppressed_context_stays_suppressed():
    """``raise ... from None``: the context the user suppressed travelled
    and showed in the caller's traceback ("During handling of ...")."""
    import traceback
    from jaxcolo.process import remote_errors

    try:
        try:
            {}["k"]
        except KeyError:
            raise ValueError("clean message") from None
    except ValueError as e:
        msg = remote_errors.error_message(1, e, "w", versions.SCHEMA_VERSION)
    back = remote_errors.loads_exception(msg.error_pickle)
    assert type(back) is ValueError and back.__context__ is None
    assert "During handling" not in "".join(traceback.format_exception(back))


def test_stats_of_a_closed_executor_or_lost_host_say_why():
    """stats() after close() gave each host 'connection lost: [Errno 9]
    Bad file descriptor'; a host lost (restart off) gave a send's errno
    instead of why it was lost."""
    ex = jaxcolo.ProcessExecutor(num_hosts=1, restart=False)
    try:
        pid = ex.worker_pids()[0]
        os.kill(pid, signal.SIGKILL)
        wait_processes_exited([pid])
        deadline = time.monotonic() + 20
        while "error" not in ex.stats()["hosts"][0]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert ex.stats()["hosts"][0]["error"].startswith(
            f"host 0 ({ex.addresses()[0]}, pid {pid}) was lost: ")
    finally:
        ex.close()
    assert ex.stats()["hosts"] == [{"error": "ProcessExecutor is closed"}]
