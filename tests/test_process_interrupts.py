"""Ctrl-C and the ProcessExecutor: a KeyboardInterrupt in the calling
(main) thread interrupts that call only -- it never leaves a connection out
of step (which used to get the worker declared lost and restarted, with
every instance's state) -- and SIGINT never stops a worker the executor
started."""

import _thread
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import jaxcolo
from jaxcolo.transport import interrupts
from tests.colocated_support import cpu_devices, put, sleeping_identity


# Run as its own program (a KeyboardInterrupt may also land in a garbage
# collection callback: reported as "Exception ignored", harmless, but
# pytest's unraisable-exception hook would turn it into a failure).
_CALLER = r"""
import _thread, json, random, signal, sys, threading, time
import jax, numpy as np, jaxcolo

class Stop(Exception):  # what a "graceful stop" handler raises
    pass

ERROR = {"kbi": KeyboardInterrupt, "stop": Stop}[sys.argv[2]]

class Armed:  # raises only around calls: the bookkeeping is never hit
    armed = False
    no_frame = 0
    def __call__(self, signum, frame):
        self.no_frame += frame is None
        if self.armed:
            raise ERROR

poke = Armed()
before = signal.signal(signal.SIGINT, poke)
f = jaxcolo.colocated_python(lambda x: x).specialize(out_specs_fn=lambda x: x)
dev = jax.devices()[0]
small = jax.device_put(np.int32(7), dev)
big_host = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: several frames
big = jax.device_put(big_host, dev)
stop = threading.Event()

def shoot():
    rnd = random.Random(5)
    while not stop.wait(rnd.uniform(0.0002, 0.004)):
        _thread.interrupt_main()

# shm=False: big arrays cross as out-of-band frames after their message
with jaxcolo.ProcessExecutor(num_hosts=1, shm=False) as ex, \
        jaxcolo.use_executor(ex):
    assert int(f(small)) == 7
    threading.Thread(target=shoot, daemon=True).start()
    completed = interrupted = wrong = 0
    deadline = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < deadline and (completed < 300 or
                                           interrupted < 300):
        x = big if completed % 4 == 3 else small
        try:
            poke.armed = True
            out = f(x)
            poke.armed = False
        except ERROR:
            poke.armed = False
            interrupted += 1
            continue
        ok = (np.array_equal(np.asarray(out), big_host) if x is big
              else int(out) == 7)
        wrong += not ok
        completed += 1
    stop.set()
    time.sleep(0.01)
    last = int(f(small))
    st = ex.stats()
print(json.dumps(dict(completed=completed, interrupted=interrupted,
                      wrong=wrong, last=last, lost=st["lost"],
                      restarts=st["restarts"], refused=st["refused"],
                      refused_by_hosts=st["refused_by_hosts"],
                      no_frame=poke.no_frame,
                      handler_back=signal.getsignal(signal.SIGINT) is poke)))
"""


_MULTI_HOST = r"""
import _thread, json, random, sys, threading, time
import jax, numpy as np, jaxcolo
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()), ("x",))

def total(x):
    return jax.jit(lambda v: v.sum(), out_shardings=NamedSharding(
        x.sharding.mesh, P()))(x)

f = jaxcolo.colocated_python(total).specialize(
    out_specs_fn=lambda x: jax.ShapeDtypeStruct(
        (), x.dtype, sharding=NamedSharding(mesh, P())))
inputs = [jax.device_put(np.full(8, k, np.float32),
                         NamedSharding(mesh, P("x"))) for k in range(50)]
stop = threading.Event()
spacing = [1.0]  # (longer on a loaded machine, where calls take longer)

def shoot():
    rnd = random.Random(11)
    while not stop.wait(rnd.uniform(0.01, 0.1) * spacing[0]):  # a call
        _thread.interrupt_main()                               # ~20 ms

right = wrong = interrupted = failed = 0
with jaxcolo.ProcessExecutor(num_hosts=2, straggler_timeout=1.0) as ex, \
        jaxcolo.use_executor(ex):
    assert float(f(inputs[1])) == 8.0
    threading.Thread(target=shoot, daemon=True).start()
    started = time.monotonic()
    deadline = started + float(sys.argv[1])
    k = 0
    while time.monotonic() < deadline or (
            min(right, interrupted) < 10 and time.monotonic() < started + 90):
        if time.monotonic() > deadline:
            spacing[0] = 4.0
        k = k % 49 + 1
        try:
            with ex.timeout(5):
                got = float(f(inputs[k]))
        except KeyboardInterrupt:
            interrupted += 1
            continue
        except jaxcolo.ExecutorError:
            failed += 1  # lost with its hosts: never a wrong value
            continue
        right += got == 8.0 * k
        wrong += got != 8.0 * k
    stop.set()
    time.sleep(0.05)
    last = None
    end = time.monotonic() + 60
    while last is None and time.monotonic() < end:  # after any restart
        try:
            with ex.timeout(5):
                last = float(f(inputs[3]))
        except (KeyboardInterrupt, jaxcolo.ExecutorError):
            time.sleep(0.1)
print(json.dumps(dict(right=right, wrong=wrong, interrupted=interrupted,
                      failed=failed, last=last)))
"""


def test_ctrl_c_during_multi_host_calls_never_gives_wrong_results():
    """A Ctrl-C while a multi-host call was half sent (it reached host 0
    only) left host 0 in the call's collective: the next calls paired with
    it and returned sums of other calls' inputs."""
    out = subprocess.run([sys.executable, "-c", _MULTI_HOST, "8"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["interrupted"] >= 10 and r["right"] >= 10, r
    assert r["wrong"] == 0 and r["last"] == 24.0, r


@pytest.mark.parametrize("error", ["kbi", "stop"])
def test_ctrl_c_in_the_main_thread_loses_no_host(error):
    """Also with a handler raising an Exception of its own (it used to be
    taken for the reader failing), which gets the signal's frame."""
    out = subprocess.run([sys.executable, "-c", _CALLER, "8", error],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["interrupted"] >= 50, r  # the interrupts did land
    assert r["completed"] >= 20 and r["wrong"] == 0 and r["last"] == 7, r
    assert r["lost"] == 0 and r["restarts"] == 0, r
    assert r["refused"] == 0 and r["refused_by_hosts"] == 0, r
    assert r["handler_back"] and r["no_frame"] == 0, r  # put back at close


def test_sigint_does_not_stop_a_started_worker():
    f = jaxcolo.colocated_python(lambda x: x + 1).specialize(
        out_specs_fn=lambda x: x)
    x = put(np.int32(1), cpu_devices()[0])
    with jaxcolo.ProcessExecutor(num_hosts=1) as ex, jaxcolo.use_executor(ex):
        assert int(f(x)) == 2
        (pid,) = ex.worker_pids()
        os.kill(pid, signal.SIGINT)  # as Ctrl-C in the terminal does
        time.sleep(0.5)
        assert int(f(x)) == 2
        assert ex.worker_pids() == [pid]
        assert ex.stats()["lost"] == 0


@pytest.mark.parametrize("handler", [signal.SIG_IGN, "custom"])
def test_other_sigint_handlers_are_kept(handler):
    """An ignored SIGINT stays ignored; a user's handler is still called
    (outside sections at once) and is put back at close."""
    seen = []
    if handler == "custom":
        handler = lambda signum, frame: seen.append(signum)  # noqa: E731
    previous = signal.signal(signal.SIGINT, handler)
    try:
        with jaxcolo.ProcessExecutor(num_hosts=1) as ex:
            _thread.interrupt_main()
            time.sleep(0.01)
            assert ex.num_hosts == 1
        assert signal.getsignal(signal.SIGINT) is handler
        assert seen == ([] if handler is signal.SIG_IGN else [signal.SIGINT])
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_handler_replaced_while_open_is_not_put_back_later():
    """Executor A open; a scope installs H, opens and closes B, and puts its
    saved handler back: closing A must restore the original, not H."""
    original = signal.getsignal(signal.SIGINT)
    seen = []

    def scoped(signum, frame):
        seen.append(signum)

    with jaxcolo.ProcessExecutor(num_hosts=1):
        saved = signal.signal(signal.SIGINT, scoped)
        with jaxcolo.ProcessExecutor(num_hosts=1):
            pass
        signal.signal(signal.SIGINT, saved)
    assert signal.getsignal(signal.SIGINT) is original
    assert seen == []


def test_deferral_stays_while_any_executor_is_open():
    original = signal.getsignal(signal.SIGINT)
    a = jaxcolo.ProcessExecutor(num_hosts=1)
    b = jaxcolo.ProcessExecutor(num_hosts=1)
    try:
        a.close()  # the first one closed: b still defers SIGINT
        assert signal.getsignal(signal.SIGINT) is interrupts._handler
    finally:
        a.close()
        b.close()
    assert signal.getsignal(signal.SIGINT) is original


def test_ctrl_c_in_a_deferred_submit_costs_only_that_call():
    """Ctrl-C landing in submit after its (deferred) call was queued but
    before the caller had said its copies of the inputs were made: the
    thread sending deferred calls waited for that forever, and every later
    call of the caller's thread was deferred behind it (found by review).
    The interrupted call fails; the next ones run."""
    import inspect
    import jax
    import jax.numpy as jnp
    from jaxcolo.process import lane_order

    a, b = sleeping_identity(0.5), sleeping_identity()
    code = lane_order.LaneOrder.admit.__code__
    src, first = inspect.getsourcelines(lane_order.LaneOrder.admit)
    line = first + next(i for i, text in enumerate(src)
                        if "self._keep_copies(entry, args)" in text)

    def tracer(frame, event, arg):  # a Ctrl-C arriving at that line
        if frame.f_code is not code:
            return None

        def local(frame, event, arg):
            if event == "line" and frame.f_lineno == line:
                sys.settrace(None)
                raise KeyboardInterrupt
            return local
        return local

    with jaxcolo.ProcessExecutor(num_hosts=2) as ex, \
            jaxcolo.use_executor(ex):
        x0 = jax.device_put(jnp.ones(4), jax.devices()[0])
        x7 = jax.device_put(jnp.ones(4), jax.devices()[7])
        a(x0), b(x7)
        fa = a.submit(x0)          # host 0, 0.5 s
        sys.settrace(tracer)
        try:
            with pytest.raises(KeyboardInterrupt):
                b.submit(x7)       # host 1: deferred behind fa
        finally:
            sys.settrace(None)
        fa.result(timeout=30)
        with ex.timeout(20):
            assert float(b(x7)[0]) == 1.0
            assert float(b.submit(x7).result(timeout=20)[0]) == 1.0


def _wait_gone(pid: int, why: str, seconds: float = 30) -> None:
    """Wait until process ``pid`` no longer exists (fail with ``why``)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except OSError:
            return
        time.sleep(0.1)
    pytest.fail(why)


_KILLED_MID_CALL = r"""
import time, jax, numpy as np, jaxcolo

@jaxcolo.colocated_python
def slow(x):
    import time
    time.sleep(60)
    return x

slow = slow.specialize(out_specs_fn=lambda x: x)
big = jax.device_put(np.ones(1 << 20, np.float32), jax.devices()[0])
ex = jaxcolo.ProcessExecutor(num_hosts=1)
with jaxcolo.use_executor(ex):
    future = slow.submit(big)  # 4 MiB: sent in a shared-memory segment
    print(ex.worker_pids()[0], ex._socket_dir, flush=True)
    time.sleep(600)
"""


def test_a_killed_controllers_segments_are_removed_by_its_worker():
    """The controller is killed with a shared-memory input in flight: its
    worker, whose session ends, unlinks the segments it was sent (and
    removes the socket directory the controller made for it, which stayed
    in /tmp)."""
    def segments(pid):
        return [n for n in os.listdir("/dev/shm")
                if n.startswith(f"jaxcolo-{pid}-")]
    p = subprocess.Popen([sys.executable, "-c", _KILLED_MID_CALL],
                         stdout=subprocess.PIPE, text=True)
    try:
        worker, socket_dir = p.stdout.readline().split()
        worker = int(worker)
        assert os.path.isdir(socket_dir)
        deadline = time.monotonic() + 30
        while not segments(p.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert segments(p.pid), "no segment in flight"
        time.sleep(0.5)  # the worker has mapped it and runs the call
    finally:
        p.kill()
        p.wait()
    _wait_gone(worker, "the worker outlived its controller")
    assert segments(p.pid) == []
    assert not os.path.exists(socket_dir)


_TERMINATED_GROUP = r"""
import sys, time, jax, numpy as np, jaxcolo
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

@jaxcolo.colocated_python
def slow(x):
    import time
    time.sleep(60)
    return x

devs = jaxcolo.colocated_cpu_devices(jax.local_devices())
big = jax.device_put(np.ones((8, 1 << 20), np.float32),
                     NamedSharding(Mesh(np.array(devs), ("x",)), P("x")))
ex = jaxcolo.ProcessExecutor(num_hosts=2)
with jaxcolo.use_executor(ex):
    if sys.argv[1] == "busy":  # 4 MiB shards: in shared-memory segments
        future = slow.specialize(out_specs_fn=lambda x: x).submit(big)
    print(*ex.worker_pids(), ex._socket_dir, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("state", ["busy", "idle"])
def test_a_process_group_terminated_leaves_no_segments_nor_socket_dir(state):
    """SIGTERM to the controller and its workers together (``timeout``,
    ``kill -TERM -PGID``, a scheduler ending a job) left the controller's
    segments in /dev/shm (RAM; a call in flight) and its socket directory
    in /tmp: each worker removed only its own.  A worker told to stop now
    also cleans up after a controller that died with it."""
    def segments(pid):
        return [n for n in os.listdir("/dev/shm")
                if n.startswith(f"jaxcolo-{pid}-")]
    p = subprocess.Popen([sys.executable, "-c", _TERMINATED_GROUP, state],
                         stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        *workers, socket_dir = p.stdout.readline().split()
        workers = [int(w) for w in workers]
        assert os.path.isdir(socket_dir)
        if state == "busy":
            deadline = time.monotonic() + 30
            while not segments(p.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert segments(p.pid), "no segment in flight"
            time.sleep(0.5)  # the workers have mapped them and run the call
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    for w in workers:
        _wait_gone(w, "a worker outlived SIGTERM")
    assert segments(p.pid) == []
    assert not os.path.exists(socket_dir)


_RESTARTED_THEN_KILLED = r"""
import os, signal, time, jax, numpy as np, jaxcolo
f = jaxcolo.colocated_python(lambda x: x).specialize(out_specs_fn=lambda x: x)
x = jax.device_put(np.float32(1), jax.devices()[0])
ex = jaxcolo.ProcessExecutor(num_hosts=2)
with jaxcolo.use_executor(ex):
    f(x)
    os.kill(ex.worker_pids()[1], signal.SIGKILL)  # the cluster restarts
    deadline = time.monotonic() + 60
    while True:
        try:
            f(x)
            break
        except jaxcolo.ExecutorError:
            assert time.monotonic() < deadline
    print(*ex.worker_pids(), ex._socket_dir, flush=True)
    time.sleep(600)
"""


def test_a_killed_controllers_socket_dir_goes_after_a_restart():
    """The workers a cluster restart replaced (killed: they could not
    remove their sockets) left their socket files in the controller's
    directory, so when the controller was killed later, its last worker
    could not remove the directory (found while testing a fix)."""
    p = subprocess.Popen([sys.executable, "-c", _RESTARTED_THEN_KILLED],
                         stdout=subprocess.PIPE, text=True)
    try:
        *workers, socket_dir = p.stdout.readline().split()
        assert len(os.listdir(socket_dir)) == 2  # the live workers' only
    finally:
        p.kill()
        p.wait()
    for w in workers:
        _wait_gone(int(w), "a worker outlived its controller")
    assert not os.path.exists(socket_dir)


_KILLED_BEFORE_SENDING = r"""
import os, time, jax, numpy as np, jaxcolo

f = jaxcolo.colocated_python(lambda x: x).specialize(out_specs_fn=lambda x: x)
ex = jaxcolo.ProcessExecutor(num_hosts=1)
with jaxcolo.use_executor(ex):
    f(jax.device_put(np.ones(4, np.float32), jax.devices()[0]))
    # as a segment leased for a message not sent yet: no worker saw it
    name = f"/dev/shm/jaxcolo-{os.getpid()}-0123456789ab-c0-7"
    with open(name, "wb") as fh:
        fh.write(b"x" * 4096)
    print(ex.worker_pids()[0], flush=True)
    time.sleep(600)
"""


def test_a_killed_controllers_unsent_segments_are_removed_by_its_worker():
    """A controller killed while it filled a segment for a message it had
    not sent: the worker never saw the segment, so ending its session
    left the file in tmpfs (RAM) for good (found by review: 350 MiB after
    3 kills).  A worker whose controller died removes every segment of
    that process."""
    p = subprocess.Popen([sys.executable, "-c", _KILLED_BEFORE_SENDING],
                         stdout=subprocess.PIPE, text=True)
    name = f"jaxcolo-{p.pid}-0123456789ab-c0-7"
    try:
        worker = int(p.stdout.readline())
        assert name in os.listdir("/dev/shm")
    finally:
        p.kill()
        p.wait()
    _wait_gone(worker, "the worker outlived its controller")
    assert name not in os.listdir("/dev/shm")


def test_a_local_worker_killed_leaves_no_segments():
    """A cluster restart cleans up the other hosts' links, then kills their
    workers, which went on making segments until then: those stayed in
    tmpfs (298 files, about 300 MB, after one test run).  Killing a local
    worker now removes its segments once it is gone."""
    with jaxcolo.ProcessExecutor(num_hosts=1) as ex:
        worker = ex._workers[0]
        # as a segment made after its link was cleaned up
        name = f"jaxcolo-{worker.pid}-feedfacecafe-w0-7"
        with open(os.path.join("/dev/shm", name), "wb") as f:
            f.write(b"x" * 4096)
        worker.kill()
        assert name not in os.listdir("/dev/shm")


def test_a_handler_set_between_two_executors_is_put_back():
    """A open, the user installs H, B opens (replacing H) and closes: H is
    back, and closing A leaves it."""
    original = signal.getsignal(signal.SIGINT)

    def user(signum, frame):
        pass
    try:
        with jaxcolo.ProcessExecutor(num_hosts=1):
            signal.signal(signal.SIGINT, user)
            with jaxcolo.ProcessExecutor(num_hosts=1):
                assert signal.getsignal(signal.SIGINT) is interrupts._handler
            assert signal.getsignal(signal.SIGINT) is user
        assert signal.getsignal(signal.SIGINT) is user
    finally:
        signal.signal(signal.SIGINT, original)


def test_installs_closed_first_opened_first_keep_the_users_handler():
    """A opens, the user sets U, B opens (replacing U); A closes first:
    deferral stays for B, and closing B puts U back."""
    original = signal.getsignal(signal.SIGINT)

    def user(signum, frame):
        pass
    try:
        a = interrupts.install()
        signal.signal(signal.SIGINT, user)
        b = interrupts.install()
        interrupts.uninstall(a)
        assert signal.getsignal(signal.SIGINT) is interrupts._handler
        interrupts.uninstall(b)
        assert signal.getsignal(signal.SIGINT) is user
    finally:
        signal.signal(signal.SIGINT, original)


_WHILE_REGISTERING = r"""
import _thread, json, sys
import jax, numpy as np, jaxcolo
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxcolo.process import hosts

real = hosts.HostLink.ensure_registered
armed = [False]

def ensure_registered(self, program, deadline=None):
    if armed[0] and program.id not in self.registered:
        armed[0] = False
        _thread.interrupt_main()  # Ctrl-C lands while registering
    return real(self, program, deadline)

hosts.HostLink.ensure_registered = ensure_registered

@jaxcolo.colocated_python_class
class Keeper:
    def __init__(self):
        self.n = 0
    def bump(self, x):
        self.n += 1
        return x

mesh = Mesh(np.array(jax.devices()), ("x",))
x = jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(mesh, P("x")))
with jaxcolo.ProcessExecutor(num_hosts=2) as ex, jaxcolo.use_executor(ex):
    k = Keeper()
    k.bump(x)
    f = jaxcolo.colocated_python(lambda v: v * 1).specialize(
        out_specs_fn=lambda v: v)
    armed[0] = True
    try:
        f(x)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    pending = len(ex._pending)
    k.bump(x)  # its host was never lost
    out = float(f(x).sum())
    print(json.dumps(dict(interrupted=interrupted, pending=pending,
                          lost=ex.stats()["lost"], out=out)))
"""


def test_ctrl_c_while_registering_a_program_loses_nothing():
    """Ctrl-C while a call's program was being registered left the call's
    entry pending: a multi-host call, none of which was sent, was taken
    for one that reached some hosts -- they were lost and restarted, with
    their instances (a single-host call's entry leaked)."""
    out = subprocess.run([sys.executable, "-c", _WHILE_REGISTERING],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r == dict(interrupted=True, pending=0, lost=0, out=28.0), r
