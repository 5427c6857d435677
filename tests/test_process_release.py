"""Who shuts a ProcessExecutor down when close(), its finalizer and the
exit hook race (jaxcolo.process.lifetime): exactly one of them, and
workers a late restart starts after that are not left running."""

import os
import signal
import time

import jaxcolo
from jaxcolo.process import launch, lifetime
from jaxcolo.transport import interrupts
from tests.colocated_support import process_running, wait_processes_exited


def test_close_after_the_exit_hook_released_shuts_down_once(monkeypatch):
    """close() on a daemon thread racing the exit hook ran the shutdown
    steps (hosts, threads, socket directory, SIGINT handler) a second
    time after the hook had run them."""
    ex = jaxcolo.ProcessExecutor(num_hosts=1)
    pids = ex.worker_pids()
    shutdowns = []
    real = lifetime.shut_down_hosts

    def counted(links, workers):
        shutdowns.append(len(links))
        real(links, workers)
    monkeypatch.setattr(lifetime, "shut_down_hosts", counted)
    lifetime.release_now(ex._owned)  # what the exit hook does first
    ex.close()
    assert shutdowns == [1]
    wait_processes_exited(pids)


def test_workers_a_restart_starts_during_the_exit_hook_are_stopped(
        monkeypatch):
    """A restart under way when the exit hook released the executor went
    on to record its new workers as the executor's, after the hook had
    shut down the old ones: nobody stopped them.  (Over TCP: with unix
    sockets, the hook's removal of the socket directory may fail the
    restart's connections first.)"""
    ex = jaxcolo.ProcessExecutor(num_hosts=1, local_transport="tcp")
    old = ex.worker_pids()
    started = []
    real = launch.start_workers

    def start_while_the_hook_runs(*args, **kwargs):
        workers = real(*args, **kwargs)
        started.extend(w.pid for w in workers)
        lifetime.release_now(ex._owned)  # the exit hook, meanwhile
        return workers
    monkeypatch.setattr(launch, "start_workers", start_while_the_hook_runs)
    os.kill(old[0], signal.SIGKILL)  # lost: the restart thread starts
    deadline = time.monotonic() + 60
    while not started or not ex._ready.is_set():
        assert time.monotonic() < deadline, "no restart"
        time.sleep(0.05)
    time.sleep(0.5)  # (a restart the first one caused would start now)
    wait_processes_exited(old + started)
    assert len(started) == 1
    ex.close()  # nothing left to shut down; returns
    interrupts.uninstall(ex._owned.sigint)  # (claimed off the main thread)


def test_the_exit_hook_waits_for_a_close_under_way(monkeypatch):
    """The hook must not return (and let the interpreter exit, cutting a
    daemon thread's close() short) while another thread shuts the
    executor down; nor shut it down a second time."""
    import threading
    ex = jaxcolo.ProcessExecutor(num_hosts=1)
    pids = ex.worker_pids()
    inside, shutdowns = threading.Event(), []
    real = lifetime.shut_down_hosts

    def slow(links, workers):
        inside.set()
        time.sleep(1.0)
        real(links, workers)
        shutdowns.append(time.monotonic())
    monkeypatch.setattr(lifetime, "shut_down_hosts", slow)
    closing = threading.Thread(target=ex.close, daemon=True)
    closing.start()
    assert inside.wait(30)
    lifetime.release_now(ex._owned)  # the exit hook, meanwhile
    assert len(shutdowns) == 1  # close()'s, finished before it returned
    assert not any(process_running(p) for p in pids)
    closing.join(30)
    interrupts.uninstall(ex._owned.sigint)  # (claimed off the main thread)


def _run_script(code: str, tmp_path) -> str:
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(tmp_path / "out", "w+") as out:  # (a stray worker cannot
        subprocess.run([sys.executable, "-c", code, root,  # hold a pipe)
                        os.path.join(root, "generated")], stdout=out,
                       stderr=subprocess.STDOUT, timeout=120)
        out.seek(0)
        return out.read()


_EXIT_DURING_CLOSE = """
import sys, threading, time
sys.path[:0] = sys.argv[1:]
import jaxcolo
from jaxcolo.process import lifetime
ex = jaxcolo.ProcessExecutor(num_hosts=1)
print("worker", ex.worker_pids()[0], flush=True)
real, inside = lifetime.shut_down_hosts, threading.Event()
def slow(links, workers):
    inside.set()
    time.sleep(1.5)
    real(links, workers)
    print("shutdown finished", flush=True)
lifetime.shut_down_hosts = slow
threading.Thread(target=ex.close, daemon=True).start()
inside.wait(30)
print("main thread exits", flush=True)
"""


def test_the_exit_hook_waits_for_a_close_under_way_on_a_daemon_thread(
        tmp_path):
    """close() took the executor out of the hook's table before shutting
    it down: the interpreter exited at once, cutting the shutdown short."""
    out = _run_script(_EXIT_DURING_CLOSE, tmp_path)
    lines = out.splitlines()
    assert "main thread exits" in lines and "shutdown finished" in lines, out
    assert lines.index("shutdown finished") > lines.index("main thread exits")
    pid = int(out.split("worker ", 1)[1].split()[0])
    wait_processes_exited([pid])


_CLOSE_FROM_A_FINALIZER_IN_THE_HOOK = """
import gc, sys, time
sys.path[:0] = sys.argv[1:]
import jaxcolo
from jaxcolo.process import lifetime

class Owner:  # closes the executor when collected (a reference cycle)
    def __init__(self, ex):
        self.ex, self.me = ex, self
    def __del__(self):
        t = time.monotonic()
        self.ex.close()
        print(f"close() in a finalizer took {time.monotonic() - t:.1f}s",
              flush=True)

Owner(jaxcolo.ProcessExecutor(num_hosts=1))
gc.disable()
real = lifetime.shut_down_hosts
def collecting(links, workers):  # as an allocation there may start one
    gc.enable()
    gc.collect()
    real(links, workers)
lifetime.shut_down_hosts = collecting
"""


def test_close_from_a_finalizer_inside_the_exit_hook_does_not_wait(
        tmp_path):
    """A collection inside the hook's shutdown ran a user finalizer calling
    close(), which waited (30 s) for the shutdown its own thread was
    running."""
    t = time.monotonic()
    out = _run_script(_CLOSE_FROM_A_FINALIZER_IN_THE_HOOK, tmp_path)
    assert "close() in a finalizer took 0.0s" in out, out
    assert time.monotonic() - t < 25, out
