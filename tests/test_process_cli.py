"""``jaxcolo worker`` as its own command, and a ProcessExecutor connecting
to running workers by address (one host, and a two-host cluster)."""

import contextlib
import gc
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxcolo
from jaxcolo.process.launch import free_port
from tests.colocated_support import cpu_devices, ok_call, put, stop_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(keyfile, *args, **env_vars):
    env = dict(os.environ, PYTHONPATH=ROOT, **env_vars)
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxcolo.cli", "worker", "--authkey-file",
         str(keyfile), *args], stdout=subprocess.PIPE, text=True, env=env)
    return proc


def _address(proc) -> str:
    line = proc.stdout.readline()
    assert " listening on 127.0.0.1:" in line, line
    return line.split()[-1]


@contextlib.contextmanager
def _workers(keyfile, *arg_lists, stop="kill"):
    """Worker commands, one started with each of ``arg_lists``: yields
    (processes, their addresses); stopped (``kill`` or ``terminate``) and
    waited for at the end."""
    procs = [_start(keyfile, *args) for args in arg_lists]
    try:
        yield procs, [_address(p) for p in procs]
    finally:
        for p in procs:
            getattr(p, stop)()
        for p in procs:
            p.wait(10)


def _cluster_args(hosts: int = 2) -> list:
    """Worker arguments of a ``hosts``-host jax.distributed cluster."""
    coord = f"127.0.0.1:{free_port()}"
    return [("--num-hosts", str(hosts), "--host-index", str(i),
             "--coordinator", coord) for i in range(hosts)]


@pytest.fixture
def keyfile(tmp_path):
    # A binary key ending in a newline byte: the worker must use the file's
    # bytes verbatim, as the controller does (it once stripped the newline,
    # failing 1 in 256 random keys).
    path = tmp_path / "key"
    path.write_bytes(os.urandom(31) + b"\n")
    path.chmod(0o600)
    return path


def test_authkey_file_is_read_verbatim(keyfile, tmp_path):
    from jaxcolo.process.runtime import read_authkey
    assert read_authkey(str(keyfile)) == keyfile.read_bytes()
    text = tmp_path / "text-key"
    text.write_bytes(b"secret\n\n")
    assert read_authkey(str(text)) == b"secret\n\n"
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with pytest.raises(SystemExit, match="empty"):
        read_authkey(str(empty))


def test_authkey_file_checks(keyfile, tmp_path, capsys):
    """A key file other users can read is warned about (whoever reads it
    can run code in the worker); an endless or huge one is refused (it was
    read whole: --authkey-file /dev/zero ended in a MemoryError)."""
    from jaxcolo.process.runtime import MAX_AUTHKEY, read_authkey
    read_authkey(str(keyfile))
    assert capsys.readouterr().err == ""
    keyfile.chmod(0o644)
    assert read_authkey(str(keyfile)) == keyfile.read_bytes()
    assert "accessible by other users (mode 644)" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="longer than 65536 bytes"):
        read_authkey("/dev/zero")
    huge = tmp_path / "huge"
    huge.write_bytes(b"k" * (MAX_AUTHKEY + 1))
    huge.chmod(0o600)
    with pytest.raises(SystemExit, match="longer than"):
        read_authkey(str(huge))


def test_authkey_must_be_bytes():
    """A str key failed after connecting, blamed on the peer ('does not
    speak the jaxcolo handshake')."""
    for key in ("secret", bytearray(b"secret")):
        with pytest.raises(TypeError, match="authkey must be bytes"):
            jaxcolo.ProcessExecutor(addresses=["127.0.0.1:1"], authkey=key)


def test_bad_ready_fd_is_a_one_line_error(keyfile):
    """--ready-fd naming no open file ended in an OSError traceback after
    JAX had started."""
    out = subprocess.run(
        [sys.executable, "-m", "jaxcolo.cli", "worker", "--authkey-file",
         str(keyfile), "--ready-fd", "987"], capture_output=True, text=True,
        env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert "--ready-fd 987: not an open file" in out.stderr


def test_worker_command_serves_controllers_one_after_another(keyfile):
    proc = _start(keyfile, "--listen", "127.0.0.1:0")
    try:
        addr = _address(proc)
        f = jaxcolo.colocated_python(lambda x: x * 3).specialize(
            out_specs_fn=lambda x: x)
        x = jax.device_put(np.arange(4.0), cpu_devices()[2])
        for _ in range(2):  # the worker outlives each controller session
            with jaxcolo.ProcessExecutor(addresses=[addr],
                                         authkey=keyfile.read_bytes()) as ex:
                assert ex.worker_pids() == [proc.pid]
                with jaxcolo.use_executor(ex):
                    np.testing.assert_array_equal(jax.device_get(f(x)),
                                                  np.arange(4.0) * 3)
        with pytest.raises(jaxcolo.ExecutorError,
                           match="^authentication failed.* \\(the peer at "
                                 + addr.replace(".", "\\.") + "\\)$"):
            jaxcolo.ProcessExecutor(addresses=[addr], authkey=b"wrong")
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(10)


def test_ipv6_loopback_addresses(keyfile):
    """[::1]:PORT was refused by the worker ('Name or service not known')
    and by the controller; bare ::1:PORT is refused as ambiguous."""
    import socket
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    r = subprocess.run(
        [sys.executable, "-m", "jaxcolo.cli", "worker", "--authkey-file",
         str(keyfile), "--listen", "::1:0"], capture_output=True, text=True,
        timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode != 0 and "an IPv6 address goes in brackets" in \
        r.stderr, r.stderr
    proc = _start(keyfile, "--listen", "[::1]:0")
    try:
        line = proc.stdout.readline()
        assert " listening on [::1]:" in line, line
        f = jaxcolo.colocated_python(lambda x: x * 3).specialize(
            out_specs_fn=lambda x: x)
        x = jax.device_put(np.arange(4.0), cpu_devices()[2])
        with jaxcolo.ProcessExecutor(addresses=[line.split()[-1]],
                                     authkey=keyfile.read_bytes()) as ex, \
                jaxcolo.use_executor(ex):
            np.testing.assert_array_equal(jax.device_get(f(x)),
                                          np.arange(4.0) * 3)
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_terminated_worker_command_removes_its_segments(keyfile):
    """SIGTERM stops a ``jaxcolo worker`` at once (os._exit): a result's
    segment the controller had not released yet stayed in tmpfs."""
    def segments(pid):
        return [n for n in os.listdir("/dev/shm")
                if n.startswith(f"jaxcolo-{pid}-")]
    with _workers(keyfile, ("--listen", "127.0.0.1:0"), stop="terminate") \
            as (procs, addrs):
        f = jaxcolo.colocated_python(lambda x: x + 1).specialize(
            out_specs_fn=lambda x: x)
        x = jax.device_put(np.zeros(1 << 20, np.float32), cpu_devices()[0])
        with jaxcolo.ProcessExecutor(addresses=addrs,
                                     authkey=keyfile.read_bytes()) as ex, \
                jaxcolo.use_executor(ex):
            out = f(x)  # 4 MiB in the worker's segment, held here
            assert segments(procs[0].pid)
            procs[0].terminate()
            procs[0].wait(10)
            assert segments(procs[0].pid) == []
            assert float(out[0]) == 1.0  # its mapping lives on


_KILLED_CONTROLLER = """
import os, sys
import jax, numpy as np, jaxcolo
from tests.colocated_support import cpu_devices
f = jaxcolo.colocated_python(lambda x: x + 1).specialize(
    out_specs_fn=lambda x: x)
ex = jaxcolo.ProcessExecutor(addresses=[sys.argv[1]],
                             authkey=open(sys.argv[2], "rb").read())
with jaxcolo.use_executor(ex):
    f(jax.device_put(np.zeros(1 << 20, np.float32), cpu_devices()[0]))
pool = ex._links[0].pool  # a segment made, not announced yet: as if killed
with open(os.path.join("/dev/shm", pool.prefix + "-unsent"), "wb") as seg:
    seg.truncate(1 << 16)  # while it made one for a call
print(pool.prefix, flush=True)
sys.stdin.read()
"""


def test_a_killed_controllers_segments_are_removed_by_its_worker(keyfile):
    """A controller killed (-9) while it used a running worker: the worker
    removed the segments it had been sent, not the ones the controller
    had made and not announced yet (left in tmpfs for good)."""
    with _workers(keyfile, ("--listen", "127.0.0.1:0"),
                  stop="terminate") as (procs, addrs):  # (removes its own)
        env = dict(os.environ, PYTHONPATH=ROOT)
        child = subprocess.Popen(
            [sys.executable, "-c", _KILLED_CONTROLLER, addrs[0],
             str(keyfile)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env)
        try:
            prefix = child.stdout.readline().strip()
            assert prefix.startswith(f"jaxcolo-{child.pid}-")
            assert len([n for n in os.listdir("/dev/shm")
                        if n.startswith(prefix)]) >= 2
        finally:
            child.kill()
            child.wait(10)
        deadline = time.monotonic() + 30  # (slow only on a loaded machine)
        while [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]:
            assert time.monotonic() < deadline, os.listdir("/dev/shm")
            time.sleep(0.05)
        with jaxcolo.ProcessExecutor(addresses=addrs,
                                     authkey=keyfile.read_bytes()) as ex:
            assert ok_call(ex) == 42  # and the worker serves the next one


def test_a_device_no_connected_worker_owns_is_named(keyfile):
    """A controller connected to a worker owning devices 0-3 calling on
    device 5: the error spoke of 'the device resolver' only."""
    with _workers(keyfile, ("--local-devices", "4", "--device-map",
                            "0,1,2,3")) as (procs, addrs):
        f = jaxcolo.colocated_python(lambda x: x + 1)
        with jaxcolo.ProcessExecutor(addresses=addrs,
                                     authkey=keyfile.read_bytes()) as ex, \
                jaxcolo.use_executor(ex):
            with pytest.raises(jaxcolo.PayloadError, match=(
                    r"unknown device id 5: .*no host of this executor owns "
                    r"it \(its hosts own device ids 0-3\)")):
                f(put(np.float32(1), cpu_devices()[5]))
            assert ok_call(ex) == 42


def test_a_controller_stalling_mid_frame_is_disconnected(keyfile):
    """An authenticated controller that sends part of a frame and then goes
    silent held the worker forever (it serves one controller at a time);
    now the frame times out, the session ends and the next controller is
    served."""
    import struct
    from jaxcolo.transport import channel as ch, handshake
    proc = _start(keyfile, "--listen", "127.0.0.1:0",
                  JAXCOLO_FRAME_TIMEOUT="1")
    try:
        addr = _address(proc)
        stalled = ch.connect(addr, keyfile.read_bytes(),
                             handshake.local_hello("controller"))
        stalled._sock.sendall(struct.pack("!i", 100) + b"x" * 10)
        assert stalled.readable(30)  # the worker hangs up on it
        with pytest.raises(jaxcolo.ExecutorError, match="closed by peer"):
            stalled.recv(timeout=5)
        f = jaxcolo.colocated_python(lambda x: x + 1).specialize(
            out_specs_fn=lambda x: x)
        x = jax.device_put(np.int32(1), cpu_devices()[0])
        deadline = time.monotonic() + 10
        while True:  # the session ends right after the hang-up
            try:
                ex = jaxcolo.ProcessExecutor(addresses=[addr],
                                             authkey=keyfile.read_bytes())
                break
            except jaxcolo.ExecutorError as e:
                assert "already serves a controller" in str(e)
                assert time.monotonic() < deadline
                time.sleep(0.1)
        with ex, jaxcolo.use_executor(ex):
            assert int(f(x)) == 2
        stalled.close()
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(10)


def test_two_worker_commands_form_a_cluster(keyfile):
    with _workers(keyfile, *_cluster_args(), stop="terminate") \
            as (procs, addrs):
        devs = cpu_devices()
        x = jax.device_put(np.arange(8.0), NamedSharding(
            Mesh(np.array(devs), ("x",)), P("x")))

        @jaxcolo.colocated_python
        def total(x):
            return jax.jit(lambda v: v.sum(), out_shardings=NamedSharding(
                x.sharding.mesh, P()))(x)

        refuse = jaxcolo.colocated_python(_sum_unless_host0_refuses)
        one = jaxcolo.colocated_python(lambda v: v * 2)
        with jaxcolo.ProcessExecutor(addresses=addrs[::-1],  # any order
                                     authkey=keyfile.read_bytes(),
                                     straggler_timeout=1.0) as ex, \
                jaxcolo.use_executor(ex):
            assert sorted(ex.worker_pids()) == sorted(p.pid for p in procs)
            assert float(total(x)) == 28.0
            assert float(total(x)) == 28.0
            assert float(refuse(x)) == 28.0
            # Host 0 fails a call whose collective host 1 then waits in
            # forever: these workers cannot be restarted from here, so the
            # cluster is marked wedged (multi-host calls fail at once).
            with pytest.raises(ValueError, match="host 0 refuses"):
                refuse(-(x + 1))
            deadline = time.monotonic() + 30  # straggler_timeout passes
            while not ex._wedged:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            with pytest.raises(jaxcolo.ExecutorError,
                               match="jax.distributed cluster is wedged: "
                                     r"host\(s\) \[\d\] still ran "):
                total(x)
            y = jax.device_put(np.float32(3), devs[0])
            assert float(one(y)) == 6.0  # single-host calls go on
        # A new controller: host 1 still waits in that collective, host 0
        # held after it.  Its collectives paired with those (a sum of the
        # wrong inputs, or a hang); now the workers refuse them.
        with jaxcolo.ProcessExecutor(addresses=addrs,
                                     authkey=keyfile.read_bytes(),
                                     straggler_timeout=1.0) as ex, \
                jaxcolo.use_executor(ex), ex.timeout(30):
            with pytest.raises(jaxcolo.HostWedgedError,
                               match=r"refuses multi-host calls: a multi-"
                                     r"host call .*restart every worker"):
                total(x * 100)
            with pytest.raises(jaxcolo.ExecutorError, match="wedged"):
                total(x * 100)
            assert float(one(y)) == 6.0
            # Host 1 (devices 4..7) waits in that collective, which holds
            # every multi-device program there (such a call waited for
            # ever): refused while it runs; host 0's run
            def pair(ds):
                return jax.device_put(np.arange(2.0), NamedSharding(
                    Mesh(np.array(ds), ("x",)), P("x")))

            t0 = time.monotonic()
            with pytest.raises(jaxcolo.HostWedgedError, match=(
                    r"refuses calls on more than one device: a multi-host "
                    r"call of a controller served before still runs here")):
                one(pair(devs[6:8]))
            assert time.monotonic() - t0 < 5
            np.testing.assert_array_equal(np.asarray(one(pair(devs[0:2]))),
                                          [0., 2.])


def _sum_unless_host0_refuses(x):
    if jax.process_index() == 0 and float(x.addressable_shards[0].data[0]) < 0:
        raise ValueError("host 0 refuses")
    return jax.jit(lambda v: v.sum(), out_shardings=NamedSharding(
        x.sharding.mesh, P()))(x)


def test_a_host_lost_during_a_failed_multi_host_call_marks_the_cluster_wedged(
        keyfile):
    """Host 0 failed a call whose collective host 1 waited in; then host
    1's connection dropped.  Host 0 held its multi-host calls for a resume
    that never came, and nothing said why: later multi-host calls hung.
    Now the cluster is marked wedged at once."""
    from tests.throttle import ThrottledProxy

    with _workers(keyfile, *_cluster_args()) as (procs, addrs), \
            contextlib.closing(ThrottledProxy(addrs[1], rate=None)) as proxy:
        devs = cpu_devices()
        x = jax.device_put(np.arange(8.0), NamedSharding(
            Mesh(np.array(devs), ("x",)), P("x")))
        refuse = jaxcolo.colocated_python(_sum_unless_host0_refuses)
        with jaxcolo.ProcessExecutor(addresses=[addrs[0], proxy.address],
                                     authkey=keyfile.read_bytes(),
                                     straggler_timeout=None) as ex, \
                jaxcolo.use_executor(ex), ex.timeout(20):
            assert float(refuse(x)) == 28.0
            with pytest.raises(ValueError, match="host 0 refuses"):
                refuse(-(x + 1))
            proxy.drop()  # host 1's connection fails mid-call
            deadline = time.monotonic() + 10
            while not ex._links[1].is_lost:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            t0 = time.monotonic()
            with pytest.raises(jaxcolo.ExecutorError,
                               match=r"cluster is wedged: host 1 .* was lost "
                                     r"while running _sum_unless_host0_"):
                refuse(x)
            assert time.monotonic() - t0 < 10
            y = jax.device_put(np.float32(3), devs[0])
            one = jaxcolo.colocated_python(lambda v: v * 2)
            assert float(one(y)) == 6.0  # single-host calls go on


class _Adder:
    def __init__(self):
        self.n = 0

    def add(self, x):
        self.n += 1
        return x + self.n


def test_a_lost_worker_does_not_keep_an_instance_alive_on_the_others(
        keyfile):
    """Two independent running workers; an instance used on both; one
    worker is lost.  The instance was forgotten on every host, so dropping
    it sent no destroy to the worker still running: its part stayed until
    the session ended."""
    with _workers(keyfile, *[("--local-devices", "4", "--device-map", ids)
                             for ids in ("0,1,2,3", "4,5,6,7")]) \
            as (procs, addrs):
        Adder = jaxcolo.colocated_python_class(_Adder)
        devs = cpu_devices()
        xa, xb = put(np.float32(1), devs[0]), put(np.float32(1), devs[4])
        with jaxcolo.ProcessExecutor(addresses=addrs,
                                     authkey=keyfile.read_bytes()) as ex, \
                jaxcolo.use_executor(ex), ex.timeout(30):
            adder = Adder()
            assert float(adder.add(xa)) == 2.0
            assert float(adder.add(xb)) == 2.0
            procs[1].kill()
            procs[1].wait(10)
            deadline = time.monotonic() + 10
            while not ex._links[1].is_lost:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with pytest.raises(jaxcolo.ExecutorError, match="was lost"):
                adder.add(xa)  # part of its state is gone
            del adder
            gc.collect()
            one = jaxcolo.colocated_python(lambda v: v * 2)
            assert float(one(xa)) == 2.0  # sends the queued destroy first
            deadline = time.monotonic() + 10
            while ex.stats()["hosts"][0].get("instances_destroyed", 0) < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)


def _raise_everywhere(x):
    raise ValueError("bad input")


def test_closing_right_after_a_failed_multi_host_call_keeps_workers_serving(
        keyfile):
    """A multi-host call failing on every host fails for its caller at the
    first host's error; closing then (an exception leaving the ``with``)
    ended the sessions before the resumes went out, so the workers held and
    refused every later controller's multi-host calls for good."""
    with _workers(keyfile, *_cluster_args()) as (procs, addrs):
        x = jax.device_put(np.arange(8.0), NamedSharding(
            Mesh(np.array(cpu_devices()), ("x",)), P("x")))

        @jaxcolo.colocated_python
        def total(x):
            return jax.jit(lambda v: v.sum(), out_shardings=NamedSharding(
                x.sharding.mesh, P()))(x)

        bad = jaxcolo.colocated_python(_raise_everywhere)
        for _ in range(2):
            with pytest.raises(ValueError, match="bad input"):
                with jaxcolo.ProcessExecutor(
                        addresses=addrs, authkey=keyfile.read_bytes()) as ex, \
                        jaxcolo.use_executor(ex):
                    assert float(total(x)) == 28.0
                    bad(x)


def _sleep_then_sum_everywhere(x):
    import jax.numpy as jnp
    time.sleep(1.5)
    return jax.jit(lambda a: jnp.broadcast_to(a.sum(), a.shape),
                   out_shardings=x.sharding)(x)


def test_closing_during_a_healthy_multi_host_call_keeps_workers_serving(
        keyfile):
    """close() while a multi-host call runs on every host: the call ends
    well (its collectives met), but a reply through shared memory could not
    be packed for a controller that was gone, which counted as the call
    failing after its session ended: the workers refused every later
    controller's multi-host calls for good (inline replies did not)."""
    with _workers(keyfile, *_cluster_args(), stop="terminate") \
            as (procs, addrs):  # (a killed worker leaves its segments)
        f = jaxcolo.colocated_python(_sleep_then_sum_everywhere)
        x = jax.device_put(np.ones(1 << 20, np.float32), NamedSharding(
            Mesh(np.array(cpu_devices()), ("x",)), P("x")))
        with jaxcolo.ProcessExecutor(addresses=addrs,
                                     authkey=keyfile.read_bytes()) as ex, \
                jaxcolo.use_executor(ex):
            assert float(f(x)[0]) == 1 << 20
            future = f.submit(x)
            time.sleep(0.5)
        with pytest.raises(jaxcolo.ExecutorError, match="closed while"):
            future.result()
        time.sleep(2.5)  # the call ends on both hosts
        with jaxcolo.ProcessExecutor(addresses=addrs,
                                     authkey=keyfile.read_bytes()) as ex, \
                jaxcolo.use_executor(ex), ex.timeout(60):
            assert float(f(x)[0]) == 1 << 20


def _sleep_then_add(x):
    time.sleep(float(x.addressable_shards[0].data.ravel()[0]))
    return x + 1


def test_a_host_lost_while_others_run_a_multi_host_call_starts_their_watch(
        keyfile):
    """Host 1's connection failed while both hosts ran a multi-host call:
    the call failed, but host 0's part (which may wait in a collective for
    host 1) got no straggler_timeout, so the thread's next call waited
    until that part ended by itself (forever, for a stuck collective)."""
    from tests.throttle import ThrottledProxy

    with _workers(keyfile, *_cluster_args()) as (procs, addrs), \
            contextlib.closing(ThrottledProxy(addrs[1], rate=None)) as proxy:
        devs = cpu_devices()
        mesh = Mesh(np.array(devs), ("x",))
        sleepy = jaxcolo.colocated_python(_sleep_then_add)
        one = jaxcolo.colocated_python(lambda v: v * 2)
        y = jax.device_put(np.float32(3), devs[0])
        with jaxcolo.ProcessExecutor(addresses=[addrs[0], proxy.address],
                                     authkey=keyfile.read_bytes(),
                                     straggler_timeout=1.0) as ex, \
                jaxcolo.use_executor(ex), ex.timeout(60):
            zeros = jax.device_put(np.zeros(8, np.float32),
                                   NamedSharding(mesh, P("x")))
            sleepy(zeros)
            assert float(one(y)) == 6.0
            fut = sleepy.submit(zeros + 30)
            time.sleep(1.0)
            proxy.drop()  # host 1's connection fails mid-call
            with pytest.raises(jaxcolo.ExecutorError, match="was lost"):
                fut.result()
            t0 = time.monotonic()
            assert float(one(y)) == 6.0
            assert time.monotonic() - t0 < 15  # not the 30 s part


@pytest.mark.parametrize("args,reason", [
    (["--host-index", "-1"], "--host-index must be in 0..0"),
    (["--num-hosts", "0"], "--num-hosts must be >= 1"),
    (["--local-devices", "-2"], "--local-devices must be >= 1"),
    (["--device-map", "0,0,1,2,3,4,5,6"], "ids must be distinct"),
    (["--device-map", "a,b"], "--device-map needs 1 blocks of 8 ids"),
    (["--max-version", "99"], "not within this jaxcolo's"),
    (["--max-version", "2"], "--max-version must be >= 3 (executor calls"),
    (["--listen", "127.0.0.1:99999"], "is not HOST:PORT"),
    (["--num-hosts", "2", "--host-index", "1", "--coordinator", "foo"],
     "needs --coordinator HOST:PORT"),
    (["--num-hosts", "2"], "needs --coordinator HOST:PORT"),
    (["--init-timeout", "0"], "--init-timeout must be >= 1"),
])
def test_worker_refuses_arguments_it_could_never_serve(keyfile, args,
                                                       reason):
    """One line naming the problem, at start (these used to start a
    worker that refused every controller, or end in a traceback)."""
    r = subprocess.run(
        [sys.executable, "-m", "jaxcolo.cli", "worker", "--authkey-file",
         str(keyfile), *args], capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode != 0
    assert reason in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_worker_cannot_read_its_key_file(tmp_path):
    for path in (tmp_path / "missing", tmp_path):
        r = subprocess.run(
            [sys.executable, "-m", "jaxcolo.cli", "worker", "--authkey-file",
             str(path)], capture_output=True, text=True, timeout=120,
            env=dict(os.environ, PYTHONPATH=ROOT))
        assert r.returncode != 0 and "cannot read the authkey file" in \
            r.stderr and "Traceback" not in r.stderr, r.stderr


def test_sigterm_removes_the_unix_socket_so_a_restart_binds(keyfile,
                                                            tmp_path):
    path = tmp_path / "w.sock"
    for _ in range(2):
        proc = _start(keyfile, "--listen", f"unix:{path}")
        line = proc.stdout.readline()
        assert f"listening on unix:{path}" in line, line
        proc.terminate()
        proc.wait(30)
        assert not path.exists()


def _big_reply(x):
    import jax.numpy as jnp
    return jnp.zeros((6 << 20,), jnp.float32) + x  # 24 MiB


def test_a_reply_streaming_longer_than_lost_timeout_is_not_lost(keyfile):
    """Over a slow link, a reply's frames take longer than ``lost_timeout``
    to arrive, and no heartbeat can go out meanwhile: the worker was
    declared lost mid-reply (the call failed, the worker was dropped).
    Frames arriving now count as signs of life."""
    from tests.throttle import ThrottledProxy

    proc = _start(keyfile, "--listen", "127.0.0.1:0")
    proxy = None
    try:
        proxy = ThrottledProxy(_address(proc), rate=6e6)  # ~4 s per reply
        d = cpu_devices()[0]
        f = jaxcolo.colocated_python(_big_reply).specialize(
            out_specs_fn=lambda x: jax.ShapeDtypeStruct(
                (6 << 20,), np.float32, sharding=x.sharding))
        with jaxcolo.ProcessExecutor(addresses=[proxy.address],
                                     authkey=keyfile.read_bytes(), shm=False,
                                     lost_timeout=1.5, heartbeat=0.25) as ex:
            with jaxcolo.use_executor(ex):
                t = time.monotonic()
                out = f(jax.device_put(np.float32(2), d))
                took = time.monotonic() - t
            assert took > 3.0, took  # the link really was that slow
            assert float(out[0]) == 2.0 and float(out[-1]) == 2.0
            assert ex.worker_pids() == [proc.pid]
    finally:
        if proxy is not None:
            proxy.close()
        proc.terminate()
        proc.wait(10)


_SCRIPT_TYPES = r'''
import collections, functools, os, sys, typing
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np
import jaxcolo

Pair = collections.namedtuple("Pair", "a b")
Other = collections.namedtuple("Other", "u v")


class Vec(typing.NamedTuple):
    x: jax.Array
    y: jax.Array

    def __add__(self, other):  # elementwise, not tuple concatenation
        return Vec(self.x + other.x, self.y + other.y)

    def norm2(self):
        return self.x * self.x + self.y * self.y


x = jax.device_put(np.int32(1), jax.devices()[0])
with jaxcolo.ProcessExecutor(num_hosts=1) as ex, jaxcolo.use_executor(ex):
    add = jaxcolo.colocated_python(lambda p: p.a + p.b)  # Pair not named
    print("in", int(add(Pair(x, x))))
    make = jaxcolo.colocated_python(lambda v: Pair(v, v + 1))
    out = make(x)
    print("out", type(out) is Pair, int(out.b))
    same = jaxcolo.colocated_python(
        lambda p: Other(p.u, p.v + 1) if type(p) is Other else None)
    back = same(Other(x, x))  # the body's own class reaches the function
    print("same", type(back) is Other, int(back.v))
    named = jaxcolo.colocated_python(  # Pair: carried for `add` before
        lambda p: p.a + (1 if type(p) is Pair else 100))
    print("named", int(named(Pair(x, x))))
    nested = jaxcolo.colocated_python(  # Pair only inside nested code
        lambda p: jax.tree.map(lambda v: v, (lambda: Pair(p.a, p.b))()))
    print("nested", type(nested(Pair(x, x))) is Pair)
    Pair = collections.namedtuple("Pair", "u v w")  # redefined
    three = jaxcolo.colocated_python(lambda p: Pair(p.u, p.v, p.w + 1))
    print("redefined", int(three(Pair(x, x, x)).w))
    double = jaxcolo.colocated_python(lambda v: v + v)  # Vec not named:
    dv = double(Vec(x, x))  # its methods all the same (it is carried)
    norm2 = jaxcolo.colocated_python(lambda v: v.norm2())
    print("methods", type(dv) is Vec, int(dv.y), int(norm2(Vec(x, x))))
    total = jaxcolo.colocated_python(lambda w: w.total())

    class W(typing.NamedTuple):
        a: jax.Array

        def total(self):
            return self.a + 1
    first = int(total(W(x)))

    class W(typing.NamedTuple):  # a notebook cell edited and run again
        a: jax.Array

        def total(self):
            return self.a + 100
    print("edited", first, int(total(W(x))))

    class Cached(typing.NamedTuple):  # its method pickles by reference:
        a: jax.Array                  # it cannot be carried to a worker

        @functools.lru_cache(maxsize=None)
        def describe(self):
            return "cached"
    plain = jaxcolo.colocated_python(lambda c: c.a + 1)
    print("uncarried", int(plain(Cached(x))))

    class Scale(typing.NamedTuple):
        a: jax.Array

        def k(self):
            return 10
    first = int(jaxcolo.colocated_python(lambda s: s.a * s.k())(Scale(x)))

    class Scale(typing.NamedTuple):  # edited, and no longer carried: its
        a: jax.Array                 # values are made namedtuples, never
                                     # the earlier class's
        def k(self):
            return 1000

        @functools.lru_cache(maxsize=None)
        def describe(self):
            return "scale"
    try:
        again = int(jaxcolo.colocated_python(lambda s: s.a * s.k())(Scale(x)))
    except AttributeError:
        again = "AttributeError"
    print("uncarried edit", first, again)
'''


def test_a_scripts_namedtuples_work_on_workers(tmp_path):
    """Namedtuples defined in the user's script (``__main__``) in inputs
    and outputs, as in JAX: a worker resolves ``__main__:Name`` to the
    class the body carries (also named only in nested code, also redefined
    with other fields; a namedtuple of the arguments is carried even when
    the function does not name it: one made from the payload's fields had
    none of its methods, so ``v + v`` concatenated tuples; a class
    redefined with the same fields is the new one, not the one an earlier
    program carried; and one that cannot be carried leaves the body
    loadable, its values namedtuples made of its name and fields)."""
    script = tmp_path / "script.py"
    script.write_text(_SCRIPT_TYPES)
    out = subprocess.run([sys.executable, str(script)], capture_output=True,
                         text=True, timeout=240,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:10] == [
        "in 2", "out True 2", "same True 2", "named 2", "nested True",
        "redefined 2", "methods True 2 2", "edited 2 101", "uncarried 2",
        "uncarried edit 10 AttributeError"]


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_second_controller_is_told_the_worker_serves_another(
        keyfile, tmp_path, transport):
    """A second controller of a worker listening on a Unix socket mostly
    got 'connection lost: [Errno 32] Broken pipe' (its setup send found
    the connection the worker had closed after writing why), not the
    refusal: it now reads the refusal waiting for it."""
    listen = (f"unix:{tmp_path / 'w.sock'}" if transport == "unix"
              else "127.0.0.1:0")
    proc = _start(keyfile, "--listen", listen)
    try:
        line = proc.stdout.readline()
        assert " listening on " in line, line
        addr = line.split()[-1]
        key = keyfile.read_bytes()
        with jaxcolo.ProcessExecutor(addresses=[addr], authkey=key) as ex:
            for _ in range(10):
                with pytest.raises(jaxcolo.ExecutorError,
                                   match="already serves a controller"):
                    jaxcolo.ProcessExecutor(addresses=[addr], authkey=key)
            assert ok_call(ex) == 42
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_silent_running_worker_is_lost_after_lost_timeout(keyfile):
    """A running worker (addresses=: no pid to watch) that stopped: the
    watchdog thread died on its empty CPU samples (IndexError), so the
    worker was never lost and the call waited for ever."""
    proc = _start(keyfile, "--listen", "127.0.0.1:0")
    try:
        addr = _address(proc)
        f = jaxcolo.colocated_python(lambda x: x * 3).specialize(
            out_specs_fn=lambda x: x)
        x = put(np.float32(2), cpu_devices()[0])
        with jaxcolo.ProcessExecutor(addresses=[addr],
                                     authkey=keyfile.read_bytes(),
                                     lost_timeout=2.0) as ex, \
                jaxcolo.use_executor(ex):
            assert float(f(x)) == 6.0
            stop_process(proc.pid)
            t0 = time.monotonic()
            with pytest.raises(jaxcolo.ExecutorError,
                               match=r"was lost while this call was in "
                                     r"flight \(no message for"):
                f.submit(x).result(timeout=30)
            assert time.monotonic() - t0 < 20
    finally:
        proc.kill()
        proc.wait(10)


_CWD_CONTROLLER = """
import jax, numpy as np, jaxcolo
import helper_in_cwd  # from the current directory ('' on sys.path: -c)
f = jaxcolo.colocated_python(helper_in_cwd.plus_one).specialize(
    out_specs_fn=lambda x: x)
with jaxcolo.ProcessExecutor(num_hosts=1) as ex, jaxcolo.use_executor(ex):
    print(float(f(jax.device_put(np.float32(1), jax.devices()[0]))))
"""


def test_workers_import_what_the_controller_imports(tmp_path):
    """Workers ran ``python -m``, which put the controller's current
    directory first on their path (and not on the controller's, run as a
    script): a ``jaxcolo`` (or ``jax``) there shadowed the installed one in
    the workers only.  A '' on the controller's path (``-c``, an
    interactive session) still reaches its current directory."""
    cwd = tmp_path / "cwd"
    (cwd / "jaxcolo").mkdir(parents=True)
    (cwd / "jaxcolo" / "__init__.py").write_text(
        "raise ImportError('the jaxcolo of the current directory')\n")
    (cwd / "helper_in_cwd.py").write_text(
        "def plus_one(x):\n    return x + 1\n")
    script = tmp_path / "controller.py"  # run as a script: no cwd on path
    script.write_text(_CWD_CONTROLLER.replace("import helper_in_cwd",
                                              "import sys; sys.path.append("
                                              "''); import helper_in_cwd"))
    env = dict(os.environ, PYTHONPATH=ROOT)
    for cmd in ([sys.executable, str(script)],
                [sys.executable, "-c",  # ('' first: the fake jaxcolo too)
                 "import sys; sys.path.remove(''); sys.path.append(''); " +
                 _CWD_CONTROLLER]):
        out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True,
                             text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == ["2.0"]


_PYTEST_MODULE = """
import jax, numpy as np, jaxcolo

def plus_one(x):
    return x + 1

def test_call():
    f = jaxcolo.colocated_python(plus_one).specialize(out_specs_fn=lambda x: x)
    with jaxcolo.ProcessExecutor(num_hosts=1) as ex, jaxcolo.use_executor(ex):
        assert float(f(jax.device_put(np.float32(1), jax.devices()[0]))) == 2.0
"""

_GONE_CWD_CONTROLLER = """
import os, sys, tempfile, jax, numpy as np, jaxcolo
d = tempfile.mkdtemp()
os.chdir(d)
os.rmdir(d)
sys.path.insert(0, '')  # (as -c has it, then removed)
f = jaxcolo.colocated_python(lambda x: x + 1).specialize(out_specs_fn=lambda x: x)
with jaxcolo.ProcessExecutor(num_hosts=1) as ex, jaxcolo.use_executor(ex):
    print(float(f(jax.device_put(np.float32(1), jax.devices()[0]))))
"""


def test_workers_find_modules_only_the_current_directory_holds(tmp_path):
    """Regressions of keeping the current directory off workers' paths
    (found by the second read): pytest's importlib mode imports test
    modules by file, so a worker finds them only in the directory pytest
    ran from (now last on its path); a controller whose current directory
    was removed could not start workers at all (FileNotFoundError)."""
    (tmp_path / "mytests").mkdir()
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "mytests" / "test_x.py").write_text(_PYTEST_MODULE)
    env = dict(os.environ, PYTHONPATH=ROOT)  # (-P: as the pytest script)
    out = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--import-mode=importlib", "mytests/test_x.py"], cwd=tmp_path,
        env=env, capture_output=True, text=True, timeout=120,
        stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    out = subprocess.run([sys.executable, "-c", _GONE_CWD_CONTROLLER],
                         env=env, capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["2.0"]
