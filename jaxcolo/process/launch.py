"""Starting worker processes on this machine for a ProcessExecutor.

Each worker runs ``python -m jaxcolo.cli worker`` (the ``jaxcolo worker``
command) with: the shared key on its stdin, a pipe on which it writes its
address once it listens, this process as the parent it watches (a worker
exits when its controller process is gone), and ``--exit-with-controller``.
Its Python path is the controller's, so functions pickled by reference
(defined in importable modules) load there too.  Its stdout and stderr are
the controller's.
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import subprocess
import sys
import time

from jaxcolo.errors import ExecutorError
from jaxcolo.process.runtime import READY
from jaxcolo.transport import blobs
from jaxcolo.transport.listener import unlink_socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# jax.config options that change what a function computes: a started worker
# gets the controller's values (set in code or by environment) at its start.
SEMANTIC_OPTIONS = (
    "jax_enable_x64", "jax_default_prng_impl", "jax_threefry_partitionable",
    "jax_numpy_rank_promotion", "jax_numpy_dtype_promotion",
    "jax_default_matmul_precision", "jax_debug_nans", "jax_debug_infs",
    "jax_legacy_prng_key",
)


def worker_env() -> dict:
    """This process's environment with its SEMANTIC_OPTIONS values, as this
    thread sees them now (an executor takes it once, at its start, and
    gives it to every worker it starts or restarts); an option unset here
    is unset there too."""
    import jax
    env = dict(os.environ)
    holders = getattr(jax.config, "_value_holders", {})
    for name in SEMANTIC_OPTIONS:
        holder = holders.get(name)
        if holder is None:  # pragma: no cover - another JAX release
            continue
        value = holder.value
        value = getattr(value, "value", value)  # str-valued enums
        if isinstance(value, bool):
            env[name.upper()] = "true" if value else "false"
        elif isinstance(value, str):
            env[name.upper()] = value
        elif value is None:
            env.pop(name.upper(), None)
    return env


def _worker_path() -> list:
    """A worker's import path: this process's sys.path (its '' spelt out
    as the current directory), then the current directory, last -- modules
    only found there (pytest's importlib mode imports test modules by file)
    are found, and never shadow what this process imports."""
    try:
        cwd = os.getcwd()
    except OSError:  # removed: nothing to import from there
        cwd = None
    path = [p or cwd for p in sys.path if p or cwd]
    if cwd is not None and cwd not in path:
        path.append(cwd)
    return path


class LocalWorker:
    """One worker process standing for host ``host_index``."""

    def __init__(self, host_index: int, num_hosts: int, device_map: list,
                 authkey: bytes, coordinator: str | None,
                 extra_args=(), env=None, listen: str = "127.0.0.1:0"):
        self.host_index = host_index
        self.address = None
        self.listen = listen
        r, w = os.pipe()
        # -P: its current directory not first on its path (-m would put it
        # there, shadowing what this process imports); see _worker_path
        cmd = [sys.executable, "-P", "-m", "jaxcolo.cli", "worker",
               "--listen", listen, "--authkey-file", "-",
               "--host-index", str(host_index), "--num-hosts", str(num_hosts),
               "--local-devices", str(len(device_map[host_index])),
               "--device-map", ";".join(",".join(map(str, b))
                                        for b in device_map),
               "--ready-fd", str(w), "--parent-pid", str(os.getpid()),
               "--exit-with-controller", *extra_args]
        if coordinator:
            cmd += ["--coordinator", coordinator]
        full_env = dict(os.environ if env is None else env)
        full_env["PYTHONPATH"] = os.pathsep.join(
            _worker_path() +
            [p for p in full_env.get("PYTHONPATH", "").split(os.pathsep) if p])
        full_env.setdefault("JAX_PLATFORMS", "cpu")
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE,
                                         pass_fds=(w,), env=full_env)
        finally:
            os.close(w)
        self._ready = r
        self._buf = b""
        try:
            self.proc.stdin.write(authkey)  # verbatim, to EOF
            self.proc.stdin.close()
        except OSError:
            pass

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _take_ready(self) -> bool:
        """Read what the ready pipe holds (it is readable): True once the
        address line is in; ExecutorError if the worker exited first."""
        chunk = os.read(self._ready, 4096)
        if not chunk:
            code = self.proc.wait(5)
            raise ExecutorError(
                f"worker for host {self.host_index} (pid {self.pid}) exited "
                f"with code {code} before listening (see its stderr above)")
        self._buf += chunk
        return b"\n" in self._buf

    def _take_address(self) -> str:
        line = self._buf.split(b"\n", 1)[0].decode(errors="replace")
        if not line.startswith(READY + " "):
            raise ExecutorError(f"worker for host {self.host_index} wrote "
                                f"{line!r} instead of its address")
        self.address = line.split(" ", 1)[1]
        return self.address

    def _close_pipe(self) -> None:
        if self._ready is not None:
            os.close(self._ready)
            self._ready = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        """Wait for a clean exit, then kill."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        else:
            self._reaped()
        self._close_pipe()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        else:
            self._reaped()
        self._close_pipe()

    def _reaped(self) -> None:
        """The process is gone: remove its shared-memory segments and its
        Unix socket (one killed, or dying on its own, could not; a
        restart's links were cleaned up before their workers were killed,
        and they made segments until then).  A socket left behind kept the
        directory from being removed when the controller died later."""
        blobs.unlink_process_segments(self.proc.pid)
        if self.listen.startswith("unix:"):
            unlink_socket(self.listen[len("unix:"):])


def start_workers(num_hosts: int, device_map: list, authkey: bytes,
                  timeout: float, extra_args=(), env=None,
                  socket_dir: str | None = None) -> list:
    """Start every host's worker (a jax.distributed cluster when there are
    several) and wait until all listen.  Kills them all on failure.

    ``socket_dir``: listen on Unix-domain sockets there (fresh names per
    start); None: on loopback TCP."""
    coordinator = f"127.0.0.1:{free_port()}" if num_hosts > 1 else None
    tag = secrets.token_hex(4)
    workers = [LocalWorker(i, num_hosts, device_map, authkey, coordinator,
                           extra_args, env,
                           listen=(f"unix:{socket_dir}/h{i}-{tag}.sock"
                                   if socket_dir else "127.0.0.1:0"))
               for i in range(num_hosts)]
    deadline = time.monotonic() + timeout
    try:
        wait_ready(workers, deadline)
    except BaseException:
        for w in reversed(workers):  # host 0, the coordinator, last
            w.kill()
        raise
    return workers


def wait_ready(workers: list, deadline: float) -> list:
    """Every worker's HOST:PORT once all listen; ExecutorError as soon as
    any of them exits (a cluster's other workers would wait for it in
    jax.distributed until their init timeout), or when they are not all
    there by ``deadline`` (time.monotonic)."""
    pending = {w._ready: w for w in workers}
    try:
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                late = min(pending.values(), key=lambda w: w.host_index)
                raise ExecutorError(
                    f"worker for host {late.host_index} (pid {late.pid}) "
                    "did not start in time")
            ready, _, _ = select.select(list(pending), [], [], min(left, 0.2))
            for fd in ready:
                if pending[fd]._take_ready():
                    del pending[fd]
    finally:
        for w in workers:
            if b"\n" in w._buf or w.proc.poll() is not None:
                w._close_pipe()
    return [w._take_address() for w in workers]
