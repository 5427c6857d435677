"""The executor side of an adversarial review: frames and calls from an
authenticated but misbehaving peer are refused without ending the session,
announced sizes never drive allocation, dropped results give their shared
memory back, and the Executor interface checks every call's arguments."""

import gc
import multiprocessing.connection as mpc
import os
import resource
import socket
import struct
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, \
    SingleDeviceSharding

import jaxcolo
from jaxcolo.codec import spec_tree
from jaxcolo.colocated.body import dumps_body
from jaxcolo.colocated.program import ProgramRef, encode_program
from jaxcolo.errors import ExecutorError, PayloadError
from jaxcolo.process import arrays, messages, packing
from jaxcolo.process.messages import MessageKind as K
from jaxcolo.transport.channel import Channel
from tests.colocated_support import cpu_devices, ok_call, put, \
    stop_process


@pytest.fixture(scope="module")
def host():
    with jaxcolo.ProcessExecutor(num_hosts=1) as ex:
        yield ex


def _program(spec, fn=lambda x: x, out=True):
    return encode_program(
        name="p", kind="function", body=dumps_body(fn),
        in_specs=spec_tree.encode_spec_tree(((spec,), {})),
        out_specs=spec_tree.encode_spec_tree(spec) if out else None,
        device_ids=sorted(d.id for d in spec.sharding.device_set))


def _refused(ex):
    return ex.stats()["hosts"][0].get("refused", 0)


def test_odd_messages_do_not_end_the_session(host):
    """Top-bit ids, and a program whose in_specs JAX cannot lay out, once
    ended the worker's session (a restart); now each is one refusal."""
    pid = host.worker_pids()[0]
    link = host._links[0]
    refused = _refused(host)
    bad_sharding = jax.ShapeDtypeStruct((3,), np.float32, sharding=NamedSharding(
        Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y")), P("x")))
    ref = ProgramRef.of(_program(bad_sharding))
    data = np.int32(5).tobytes()
    shards = messages.Shards(leaf=[0], device=[0], buffer=[0], where=[0],
                             format=[0], offset=[0], size=[4], segment=[0],
                             lease=[2**63], data=data)
    for m in (messages.Message(K.call, call_id=2**63, lane=2**64 - 1,
                               program_id=bytes(16)),
              messages.Message(K.call, call_id=3, lane=1,
                               program_id=bytes(16), shards=shards),
              messages.Message(K.register, program_id=ref.id,
                               program=ref.payload),
              messages.Message(K.call, call_id=4, lane=1,
                               program_id=ref.id),
              messages.Message(K.setup, heartbeat_ms=1)):  # twice: refused
        link.channel.send(messages._encode(m))
    assert ok_call(host) == 42
    assert host.worker_pids()[0] == pid and host.stats()["restarts"] == 0
    deadline = time.monotonic() + 10
    while _refused(host) < refused + 1:  # the second setup (the rest are
        assert time.monotonic() < deadline  # answered as call errors)
        time.sleep(0.05)


def _channel_pair():
    a, b = socket.socketpair()
    conn = mpc.Connection(os.dup(a.fileno()))
    return Channel(a, conn, None, jaxcolo.SCHEMA_VERSION), \
        mpc.Connection(os.dup(b.fileno())), b


def test_announced_sizes_do_not_allocate():
    """A call announcing a 3 GiB out-of-band buffer, then sending 10 bytes,
    allocated 3 GiB; a frame header announcing 2**62 bytes raised
    MemoryError.  Now memory follows the bytes that arrive."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ch, peer, keep = _channel_pair()
    peer.send_bytes(b"x" * 10)
    with pytest.raises(ExecutorError, match="out-of-band frame of 10 bytes, "
                                            "expected 16777216"):
        ch.recv_buffer(3 << 30, arrays.FRAME_CHUNK)
    assert ch.closed
    ch, peer, keep = _channel_pair()
    keep.sendall(struct.pack("!i", -1) + struct.pack("!Q", 2**62) + b"xx")
    with pytest.raises(ExecutorError, match="connection lost"):
        ch.recv_buffer(100, arrays.FRAME_CHUNK)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) \
        / 1024
    assert grown_mb < 200
    ch, peer, keep = _channel_pair()  # what a correct sender sends is read
    for part in (b"a" * 7, b"b" * 7, b"c" * 2):
        peer.send_bytes(part)
    assert ch.recv_buffer(16, 7) == b"a" * 7 + b"b" * 7 + b"cc"


def test_shards_must_match_the_layout():
    d0, d1 = jax.devices()[:2]
    spec = jax.ShapeDtypeStruct((), np.int32, sharding=SingleDeviceSharding(d0))
    lay = arrays.Layout(spec, True)
    one = np.int32(7).tobytes()

    def shards(devices):
        n = len(devices)
        return messages.Shards(leaf=[0] * n, device=devices, buffer=[0] * n,
                               where=[0], format=[0], offset=[0], size=[4],
                               segment=[0], lease=[0], data=one)
    found = arrays.buffers_by_device(shards([d0.id]), 1, lambda j: one, "$")
    assert int(arrays.assemble(lay, found[0], 0, "input")) == 7
    with pytest.raises(PayloadError, match=r"two shards of leaf 0 on device "
                       rf"{d0.id} - at \$\.device"):
        arrays.buffers_by_device(shards([d0.id, d0.id]), 1, lambda j: one, "$")
    found = arrays.buffers_by_device(shards([d0.id, 99]), 1, lambda j: one, "$")
    with pytest.raises(PayloadError, match=r"shards for devices \[99\] that "
                       r"the spec does not place here - at input\[0\]"):
        arrays.assemble(lay, found[0], 0, "input")


def test_bool_buffers_hold_only_zeros_and_ones():
    """A peer's bool bytes 2 and 255 were taken: numpy showed them as they
    were, XLA as True (found by review)."""
    d0 = jax.devices()[0]
    spec = jax.ShapeDtypeStruct((4,), np.bool_,
                                sharding=SingleDeviceSharding(d0))
    lay = arrays.Layout(spec, True)
    ok = arrays.assemble(lay, {d0.id: (bytes([0, 1, 1, 0]), 0)}, 0, "input")
    assert np.asarray(ok).tolist() == [False, True, True, False]
    with pytest.raises(PayloadError, match=(
            r"^a bool buffer holds bytes other than 0 and 1 .* - at "
            rf"input\[0\] on device {d0.id}$")):
        arrays.assemble(lay, {d0.id: (bytes([0, 1, 2, 255]), 0)}, 0, "input")


def test_string_lengths_cannot_wrap_around():
    raw = struct.pack("<QQ", 2**64 - 1, 7) + b"abcdef"
    with pytest.raises(PayloadError, match="string lengths do not match"):
        arrays.decode_strings(raw, 2, (2,), "$")
    ok = packing.encode_strings(np.array(["ab", ""], np.dtypes.StringDType()))
    assert arrays.decode_strings(ok, 2, (2,), "$").tolist() == ["ab", ""]


@pytest.mark.parametrize("make", [jaxcolo.InlineExecutor,
                                  lambda: jaxcolo.ProcessExecutor(num_hosts=1)])
def test_executor_interface_checks_every_call(make):
    """A float32 argument for an int32 program after a good call ran on the
    reinterpreted bytes (1.0 -> 1065353217)."""
    d0 = jax.devices()[0]
    spec = jax.ShapeDtypeStruct((), np.int32, sharding=SingleDeviceSharding(d0))
    ref = ProgramRef.of(_program(spec, lambda x: x + 1))
    with make() as ex:
        assert int(ex.call(ref, [jax.device_put(np.int32(1), d0)],
                           lane=1)[0]) == 2
        with pytest.raises(ValueError, match="input 0 does not match"):
            ex.call(ref, [jax.device_put(np.float32(1), d0)], lane=1)


def _slow_big(x):
    time.sleep(0.5)
    return jnp.zeros((1 << 20,), jnp.float32) + x


def test_dropped_results_return_their_shared_memory(host):
    """Late results of timed-out calls were never released: every one
    pinned a 4 MiB segment on the worker."""
    f = jaxcolo.colocated_python(_slow_big).specialize(
        out_specs_fn=lambda s: jax.ShapeDtypeStruct(
            (1 << 20,), np.float32, sharding=s.sharding))
    x = put(np.float32(1), cpu_devices()[0])
    with jaxcolo.use_executor(host):
        assert float(f(x)[0]) == 1.0
        for _ in range(4):
            with host.timeout(0.1), pytest.raises(ExecutorError,
                                                  match="timed out"):
                f(x)
        deadline = time.monotonic() + 20
        while True:  # the late results arrive, are dropped and released
            # (a timed-out call's buffers can sit in a reference cycle until
            # the cyclic collector runs: leases go back once mappings die)
            gc.collect()
            h = host.stats()["hosts"][0]
            if h.get("leased") == 0 and h.get("calls", 0) >= 5:
                break
            assert time.monotonic() < deadline, h
            time.sleep(0.2)
        assert h["segments"] <= 2
        assert float(f(x)[0]) == 1.0


_FULL_SHM = r"""
import sys
import jax, numpy as np, jaxcolo

@jaxcolo.colocated_python
def twice(x):
    return x * 2

x = jax.device_put(np.arange(int(sys.argv[1]), dtype=np.float32),
                   jax.devices()[0])
with jaxcolo.ProcessExecutor(num_hosts=1) as ex, jaxcolo.use_executor(ex):
    for _ in range(2):
        y = twice(x)
        assert y.sharding == x.sharding
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)
    assert ex.stats()["lost"] == 0
print("ok")
"""


@pytest.mark.parametrize("shm_mib,floats,fits", [
    (8, 3 << 20, False),         # 12 MiB each way: more than /dev/shm holds
    (40, (2 << 20) + 1, True)])  # 8 MiB + 4 B each way, in 16 MiB segments
def test_a_full_dev_shm_sends_buffers_in_frames(shm_mib, floats, fits):
    """/dev/shm (of a private mount namespace) is small: a tmpfs file is
    sparse, so writing a mapped segment past its room was a SIGBUS killing
    the controller (input) or the worker (output); buffers now go in frames
    then.  Segments reserve the pages their buffers use, not their whole
    power-of-two size (three 16 MiB segments did not fit in 40)."""
    import shutil
    import subprocess
    import sys
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("needs a private mount namespace (unshare -m)")
    script = (f"mount -t tmpfs -o size={shm_mib}m tmpfs /dev/shm && exec "
              f"{sys.executable} -c \"$0\" {floats}")
    out = subprocess.run(["unshare", "-m", "sh", "-c", script, _FULL_SHM],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ok"
    assert ("no shared memory for a" in out.stderr) is not fits, \
        out.stderr[-3000:]


def _stalling_worker(authkey: bytes):
    """A peer speaking the worker protocol over a real socket: it answers
    setup, sends heartbeats, and answers the first call with 10 bytes of
    a 1000-byte frame, then nothing (a worker stalled mid-reply)."""
    import threading
    from jaxcolo import versions
    from jaxcolo.transport import handshake
    from jaxcolo.transport.listener import Listener
    hello = handshake.local_hello("worker", host_index=0,
                                  device_ids=list(range(8)))

    def serve(c):
        while True:
            try:
                m = messages.decode(c.recv(), c.version)
            except Exception:  # noqa: BLE001 - the controller went away
                return
            if m.kind == K.setup:
                c.send(messages.encode(messages.Message(
                    K.setup, pid=os.getpid()), c.version))

                def beat(period=m.heartbeat_ms / 1000):
                    while not c.closed:
                        try:
                            c.send(messages.encode(messages.Message(K.ping),
                                                   c.version))
                        except Exception:  # noqa: BLE001
                            return
                        time.sleep(period)
                threading.Thread(target=beat, daemon=True).start()
            elif m.kind in (K.call, K.discover):
                with c._send_lock:  # heartbeats stop with the frame
                    c._sock.sendall(struct.pack("!i", 1000) + b"x" * 10)
                    time.sleep(60)
                return

    def on_channel(c):
        threading.Thread(target=serve, args=(c,), daemon=True).start()
    return Listener("127.0.0.1:0", authkey, lambda: hello, on_channel,
                       need=versions.FEATURE_SINCE["message"])


def test_a_worker_stalled_mid_frame_is_lost_after_lost_timeout():
    """A reply frame that stops arriving midway is silence since its last
    bytes: the call fails after lost_timeout, not the frame timeout (120 s);
    a slow link's frames still count as signs of life
    (test_process_cli.test_a_reply_streaming_longer_than_lost_timeout_...)."""
    key = b"k" * 32
    listener = _stalling_worker(key)
    f = jaxcolo.colocated_python(lambda x: x).specialize(
        out_specs_fn=lambda x: x)
    x = jax.device_put(jnp.zeros(4), jax.devices()[0])
    ex = jaxcolo.ProcessExecutor(addresses=[listener.address_text],
                                 authkey=key, lost_timeout=2.0)
    try:
        with jaxcolo.use_executor(ex):
            t0 = time.monotonic()
            with pytest.raises(ExecutorError, match="timed out|lost|no "
                               "message"):
                with ex.timeout(1.0):
                    f(x)
            assert time.monotonic() - t0 < 10
    finally:
        ex.close()
        listener.close()


def test_close_is_not_held_by_a_send_the_worker_stopped_reading():
    """A worker stopped (SIGSTOP) while a 64 MiB input is sent to it in
    frames: close() fails that call and returns without waiting for the
    send (it waited for lost_timeout)."""
    import signal
    import threading
    f = jaxcolo.colocated_python(lambda x: x + 1).specialize(
        out_specs_fn=lambda x: x)
    big = jax.device_put(jnp.zeros(16 << 20, jnp.float32), jax.devices()[0])
    ex = jaxcolo.ProcessExecutor(num_hosts=1, shm=False, lost_timeout=60.0)
    errors = []
    with jaxcolo.use_executor(ex):
        f(big)
        pid = ex.worker_pids()[0]
        stop_process(pid)
        try:
            def call():
                try:
                    f(big)
                except ExecutorError as e:
                    errors.append(e)
            caller = threading.Thread(target=call)
            caller.start()
            time.sleep(1.0)  # the send is blocked: the socket buffer is full
            t0 = time.monotonic()
            ex.close()
            assert time.monotonic() - t0 < 20
            caller.join(20)
            assert not caller.is_alive() and len(errors) == 1
        finally:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _stopped(pid):
    """Context: worker ``pid`` stopped (SIGSTOP), continued at the end."""
    import contextlib
    import signal

    @contextlib.contextmanager
    def stopped():
        stop_process(pid)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)
    return stopped()


def test_a_call_timeout_covers_a_send_the_worker_stopped_reading():
    """A 64 MiB input sent in frames to a stopped worker: the call times out
    at its deadline (it waited for lost_timeout), the rest of the message
    goes on in the background, and once the worker runs again the same
    connection serves the next call (no restart)."""
    f = jaxcolo.colocated_python(lambda x: x + 1).specialize(
        out_specs_fn=lambda x: x)
    big = jax.device_put(jnp.zeros(16 << 20, jnp.float32), jax.devices()[0])
    with jaxcolo.ProcessExecutor(num_hosts=1, shm=False,
                                 lost_timeout=60.0) as ex, \
            jaxcolo.use_executor(ex):
        f(big)
        pid = ex.worker_pids()[0]
        with _stopped(pid):
            t0 = time.monotonic()
            with pytest.raises(ExecutorError, match="timed out after 1.0s"):
                with ex.timeout(1.0):
                    f(big)
            assert time.monotonic() - t0 < 5
        out = f(big)
        assert float(out[0]) == 1.0 and float(out[-1]) == 1.0
        assert ex.worker_pids() == [pid]
        assert ex.stats()["restarts"] == 0


def test_a_call_timeout_covers_waiting_behind_another_send(tmp_path):
    """A call queued behind another thread's send to a stopped worker times
    out at its deadline with nothing sent: once the worker runs again the
    first call completes, and the timed-out one never ran."""
    import threading
    log_file = tmp_path / "ran"

    def mark(x):
        with open(log_file, "a") as fh:
            fh.write("ran\n")
        return x
    mark_call = jaxcolo.colocated_python(mark).specialize(
        out_specs_fn=lambda x: x)
    f = jaxcolo.colocated_python(lambda x: x + 1).specialize(
        out_specs_fn=lambda x: x)
    big = jax.device_put(jnp.zeros(16 << 20, jnp.float32), jax.devices()[0])
    small = jax.device_put(jnp.ones(4), jax.devices()[0])
    results = []
    with jaxcolo.ProcessExecutor(num_hosts=1, shm=False,
                                 lost_timeout=60.0) as ex, \
            jaxcolo.use_executor(ex):
        f(big)
        mark_call(small)  # registered and discovered: 1 run
        pid = ex.worker_pids()[0]
        with _stopped(pid):
            sender = threading.Thread(
                target=lambda: results.append(float(f(big)[0])))
            sender.start()
            lock = ex._links[0].channel._send_lock
            deadline = time.monotonic() + 30
            while not lock.locked():  # its send blocks: the socket buffer
                assert time.monotonic() < deadline  # fills
                time.sleep(0.01)
            time.sleep(0.2)
            assert lock.locked() and sender.is_alive()
            t0 = time.monotonic()
            with pytest.raises(ExecutorError, match="it was not sent"):
                with ex.timeout(1.0):
                    mark_call(small)
            assert time.monotonic() - t0 < 5
        sender.join(30)
        assert results == [1.0]
        mark_call(small)
        assert log_file.read_text().count("ran") == 2
        assert ex.stats()["restarts"] == 0


@pytest.mark.parametrize("max_version", [None, 6], ids=["current", "v6"])
def test_a_multi_host_call_timeout_covers_its_sends(max_version):
    """A two-host call whose second host stopped reading: the call times out
    at its deadline, every host still gets its part (none is stranded in a
    collective), and the cluster serves the next call unrestarted -- also
    with v6 sessions, whose hosts cannot hold a failed call (the send
    stopped at the timeout, as after a host's error, and the cluster
    restarted)."""
    devs = cpu_devices()
    mesh = Mesh(np.array(devs), ("x",))
    x = jax.device_put(np.ones((8, 1 << 21), np.float32),
                       NamedSharding(mesh, P("x")))

    def total(v):
        m = v.sharding.mesh
        return jax.jit(jax.shard_map(
            lambda a: jax.lax.psum(jnp.sum(a), "x"), mesh=m, in_specs=P("x"),
            out_specs=P()))(v)
    f = jaxcolo.colocated_python(total)
    with jaxcolo.ProcessExecutor(num_hosts=2, shm=False, lost_timeout=60.0,
                                 max_version=max_version) as ex, \
            jaxcolo.use_executor(ex):
        assert float(f(x)) == 8 << 21
        pids = ex.worker_pids()
        with _stopped(pids[0]):  # the first host: the second is sent late
            t0 = time.monotonic()
            with pytest.raises(ExecutorError, match="timed out after 1.0s"):
                with ex.timeout(1.0):
                    f(x)
            assert time.monotonic() - t0 < 5
        assert float(f(x)) == 8 << 21
        assert ex.worker_pids() == pids
        assert ex.stats()["restarts"] == 0
