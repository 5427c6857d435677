"""Shared fixtures and helpers of the colocated tests.

``executor`` is parametrised over EXECUTORS: every colocated behaviour test
runs against each executor kind.  A new executor (e.g. a process executor)
adds an entry here instead of copying tests.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
import pytest

import jaxcolo
from jaxcolo.colocated.inline import InlineExecutor
from jaxcolo.colocated.program import read_program

# name -> factory; each factory returns a fresh executor.
EXECUTORS = {
    "inline": InlineExecutor,
    "process1": lambda: jaxcolo.ProcessExecutor(num_hosts=1),
    "process2": lambda: jaxcolo.ProcessExecutor(num_hosts=2),
}


@pytest.fixture(params=sorted(EXECUTORS), scope="module")
def executor(request):
    """An executor, installed with use_executor for the test module."""
    ex = EXECUTORS[request.param]()
    with ex, jaxcolo.use_executor(ex):
        yield ex


def cpu_devices():
    return jaxcolo.colocated_cpu_devices(jax.local_devices())


def put(value, where):
    """device_put onto a device or a sharding."""
    return jax.device_put(np.asarray(value) if not isinstance(value, list)
                          else value, where)


def ok_call(ex, value=41) -> int:
    """A successful call on ``ex`` (the 'following successful call' after a
    fault): ``value + 1``, computed where ``ex`` runs colocated code."""
    f = jaxcolo.colocated_python(lambda x: x + 1).specialize(
        out_specs_fn=lambda x: x)
    with jaxcolo.use_executor(ex):
        return int(f(put(np.int32(value), cpu_devices()[0])))


def sleeping_identity(seconds: float = 0.0):
    """A colocated function returning its input after ``seconds`` on its
    host (a call the thread's next calls on other hosts wait behind),
    specialised with ``out_specs_fn`` the identity."""
    def sleep_then_return(x):
        if seconds:
            time.sleep(seconds)
        return x
    return jaxcolo.colocated_python(sleep_then_return).specialize(
        out_specs_fn=lambda x: x)


def signatures(fn) -> int:
    """Distinct input signatures ``fn`` has built programs for."""
    return len({read_program(p.payload).in_specs
                for p in fn.programs()})


def on_host(fn, device=None):
    """Run ``fn()`` where the current executor runs colocated code for
    ``device`` (default: the first CPU device) and return its result
    (None -> 0) as numpy: host-side state, under every executor."""
    d = device or cpu_devices()[0]

    def body():
        value = fn()
        return jax.device_put(np.asarray(0 if value is None else value), d)

    f = jaxcolo.colocated_python(body).specialize(devices=[d])
    return np.asarray(jax.device_get(f()))


def set_state(**values):
    """Set attributes of tests.colocated_state on the host."""
    from tests import colocated_state
    on_host(lambda: colocated_state.__dict__.update(values))


def pop_state(*names):
    from tests import colocated_state
    on_host(lambda: [colocated_state.__dict__.pop(n, None) for n in names]
            and None)


def get_state(name):
    from tests import colocated_state
    return on_host(lambda: getattr(colocated_state, name))


def _process_state(pid: int) -> str | None:
    """Process ``pid``'s state letter (R, S, T, Z, ...), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # (reaped meanwhile)
        return None


def process_running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    return _process_state(pid) not in (None, "Z")


def wait_collected(ref, seconds: float = 10.0, until=None) -> None:
    """Collect garbage until weakref ``ref`` is dead (AssertionError after
    ``seconds``, or once ``until()`` is true first): the thread that
    completed a future may hold its call a moment longer."""
    import gc
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        if ref() is None:
            return
        assert time.monotonic() < deadline and not (until and until()), \
            f"{ref()!r} was not collected"
        time.sleep(0.01)


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP process ``pid`` and return once it is stopped.  The signal
    lands asynchronously: until one of its threads takes it, the others
    keep running (a loaded machine let a "stopped" worker still answer)."""
    import signal
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        if _process_state(pid) in ("T", "t"):
            return
        assert time.monotonic() < deadline, f"pid {pid} did not stop"
        time.sleep(0.001)


def wait_processes_exited(pids, seconds: float = 10) -> None:
    """Wait until none of the (worker) processes ``pids`` runs any more;
    AssertionError naming those still running after ``seconds``."""
    deadline = time.monotonic() + seconds
    while any(process_running(p) for p in pids):
        assert time.monotonic() < deadline, \
            [p for p in pids if process_running(p)]
        time.sleep(0.05)
