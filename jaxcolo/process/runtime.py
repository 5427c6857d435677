"""A worker process: start-up and the ``jaxcolo worker`` command.

    jaxcolo worker --listen HOST:PORT --authkey-file F [--host-index I
        --num-hosts N --coordinator HOST:PORT] [--local-devices K]

Start-up order matters: the CPU device count (``XLA_FLAGS``) is set before
JAX is imported; with ``--num-hosts`` > 1 the process joins a
``jax.distributed`` cluster (gloo CPU collectives) as process ``I`` of ``N``,
so every worker sees every host's devices and a call spanning hosts can run
cross-host collectives.  Then the device map is installed: host ``p`` owns
controller device ids ``--device-map`` block ``p`` (default: ``p*K ..
p*K+K-1``), its k-th id naming its k-th local device, and every payload this
process reads or writes speaks those ids.  Finally it listens (default
127.0.0.1) and serves one controller session at a time; connections are
authenticated (HMAC challenge with the key in ``--authkey-file``, ``-`` for
stdin) before anything they send is decoded.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import stat
import sys
import threading
import time

log = logging.getLogger("jaxcolo.worker")
READY = "JAXCOLO_WORKER_READY"
MAX_AUTHKEY = 1 << 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="127.0.0.1:0",
                   help="HOST:PORT to listen on (default 127.0.0.1:0, "
                        "port 0: any free port; an IPv6 HOST in brackets, "
                        "[::1]:0), or unix:PATH for a Unix-domain socket "
                        "(same machine)")
    p.add_argument("--authkey-file", required=True,
                   help="file whose bytes, verbatim, are the shared key "
                        "('-': read stdin to EOF)")
    p.add_argument("--host-index", type=int, default=0)
    p.add_argument("--num-hosts", type=int, default=1)
    p.add_argument("--coordinator", default=None,
                   help="jax.distributed coordinator HOST:PORT (needed "
                        "when --num-hosts > 1; host 0 runs it)")
    p.add_argument("--local-devices", type=int, default=None,
                   help="CPU devices of this host (default 8 / num-hosts)")
    p.add_argument("--device-map", default=None,
                   help="controller device ids of every host: "
                        "'0,1,2,3;4,5,6,7' (default: contiguous blocks)")
    p.add_argument("--min-version", type=int, default=None)
    p.add_argument("--max-version", type=int, default=None,
                   help="newest payload version to speak (tests of skew)")
    p.add_argument("--ready-fd", type=int, default=None,
                   help=f"write '{READY} HOST:PORT' to this fd, not stdout")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="exit when this process is no longer the parent")
    p.add_argument("--exit-with-controller", action="store_true",
                   help="serve one controller session, then exit")
    p.add_argument("--shm-retain", type=int, default=None,
                   help="bytes of shared-memory pages this worker's idle "
                        "segments keep for reuse (default 256 MiB)")
    p.add_argument("--init-timeout", type=int, default=60,
                   help="seconds the hosts of a --num-hosts > 1 cluster "
                        "wait for each other to join it (default 60)")
    p.add_argument("--log-level", default="WARNING")


def read_authkey(path: str) -> bytes:
    """The key: every byte of the file (or of stdin for ``-``), verbatim.

    Nothing is stripped, so a binary key ending in a newline byte stays the
    key the controller reads from the same file."""
    if path == "-":
        data = sys.stdin.buffer.read(MAX_AUTHKEY + 1)
    else:
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077:
                    print(f"jaxcolo worker: warning: the authkey file "
                          f"{path!r} is accessible by other users (mode "
                          f"{stat.S_IMODE(st.st_mode):o}); anyone who reads "
                          f"it can run code in this worker: chmod 600 it",
                          file=sys.stderr)
                data = f.read(MAX_AUTHKEY + 1)
        except OSError as e:
            raise SystemExit(f"jaxcolo worker: cannot read the authkey file "
                             f"{path!r}: {e.strerror or e}") from None
    if len(data) > MAX_AUTHKEY:
        raise SystemExit(f"jaxcolo worker: the authkey is longer than "
                         f"{MAX_AUTHKEY} bytes")
    if not data:
        raise SystemExit("jaxcolo worker: the authkey is empty")
    return data


def _set_device_count(n: int) -> None:
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = (
        flags + f" --xla_force_host_platform_device_count={n}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def device_blocks(text: str | None, num_hosts: int, local: int) -> list:
    if text is None:
        return [list(range(p * local, (p + 1) * local))
                for p in range(num_hosts)]
    try:
        blocks = [[int(i) for i in part.split(",") if i.strip()]
                  for part in text.split(";")]
    except ValueError:
        blocks = None
    if blocks is None or len(blocks) != num_hosts or \
            any(len(b) != local for b in blocks):
        raise SystemExit(f"jaxcolo worker: --device-map needs {num_hosts} "
                         f"blocks of {local} ids, got {text!r}")
    ids = [i for b in blocks for i in b]
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= 2**32:
        raise SystemExit(f"jaxcolo worker: --device-map ids must be distinct "
                         f"and in 0..{2**32 - 1}, got {text!r}")
    return blocks


def check_arguments(args) -> None:
    """SystemExit with a one-line reason for arguments the worker could
    start with but never serve (checked before JAX starts)."""
    from jaxcolo import versions
    from jaxcolo.transport import channel, handshake

    def bad(text):
        raise SystemExit(f"jaxcolo worker: {text}")
    if args.num_hosts < 1:
        bad(f"--num-hosts must be >= 1, got {args.num_hosts}")
    if not 0 <= args.host_index < args.num_hosts:
        bad(f"--host-index must be in 0..{args.num_hosts - 1}, got "
            f"{args.host_index}")
    if args.local_devices is not None and args.local_devices < 1:
        bad(f"--local-devices must be >= 1, got {args.local_devices}")
    if args.ready_fd is not None:
        try:
            os.fstat(args.ready_fd)
        except (OSError, OverflowError) as e:
            bad(f"--ready-fd {args.ready_fd}: not an open file "
                f"({getattr(e, 'strerror', None) or e})")
    if args.init_timeout < 1:
        bad(f"--init-timeout must be >= 1 (seconds), got {args.init_timeout}")
    if args.shm_retain is not None and args.shm_retain < 0:
        bad(f"--shm-retain must be >= 0 (bytes), got {args.shm_retain}")
    try:
        handshake.local_hello("worker", min_version=args.min_version,
                              max_version=args.max_version)
    except ValueError as e:
        bad(f"--min-version/--max-version: {e}")
    need = versions.FEATURE_SINCE["message"]
    if args.max_version is not None and args.max_version < need:
        bad(f"--max-version must be >= {need} (executor calls need version "
            f">= {need}), got {args.max_version}")
    try:
        channel.parse_address(args.listen)
    except (ValueError, OverflowError) as e:
        bad(f"--listen {args.listen!r}: {e}")
    if args.num_hosts > 1:
        coordinator = args.coordinator or ""
        host, sep, port = coordinator.rpartition(":")
        if not (host and sep and port.isdigit() and 0 < int(port) < 65536):
            bad(f"--num-hosts > 1 needs --coordinator HOST:PORT (port "
                f"1..65535), got {args.coordinator!r}")


def start_jax(args, local: int, blocks: list):
    """Import JAX with ``local`` CPU devices (joining the cluster when
    there are several hosts) and install the device map ``blocks``."""
    _set_device_count(local)
    import jax
    if args.num_hosts > 1:
        if not args.coordinator:
            raise SystemExit("jaxcolo worker: --num-hosts > 1 needs "
                             "--coordinator HOST:PORT")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_hosts, process_id=args.host_index,
            initialization_timeout=args.init_timeout)
    space = {}
    for p, ids in enumerate(blocks):
        devs = sorted((d for d in jax.devices() if d.process_index == p),
                      key=lambda d: d.id)
        if len(devs) != len(ids):
            raise SystemExit(f"jaxcolo worker: host {p} has {len(devs)} "
                             f"devices, the device map gives it {len(ids)}")
        space.update(zip(ids, devs))
    from jaxcolo.codec.mesh import set_device_space
    set_device_space(space)
    return blocks[args.host_index]


# A worker told to stop (SIGTERM) waits this long for its controller to be
# gone too (the signal went to their process group) before it exits.
TERM_PARENT_WAIT = 1.0


def _watch_parent(pid: int, listen: str, coordinator: bool) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != pid:
            _remove_dead_parents_segments(pid, 0)
            _remove_dead_parents_socket_dir(listen, unlink=True,
                                            coordinator=coordinator)
            os._exit(3)


def _remove_dead_parents_socket_dir(listen: str, unlink: bool,
                                    coordinator: bool = False) -> None:
    """A controller that started its workers on Unix sockets in a
    directory of its own (``jaxcolo-*``) and died cannot remove it: each
    worker removes its socket (``unlink``: not removed by its listener),
    and the last one the directory (only an empty one is removed).

    ``coordinator``: host 0 of a cluster, whose exit makes JAX abort the
    other workers' processes (they lose the coordination service) before
    they could remove their sockets: it waits up to PEER_EXIT_WAIT seconds
    for theirs to go, then removes those nobody listens on any more."""
    if not listen.startswith("unix:"):
        return
    path = listen[len("unix:"):]
    directory = os.path.dirname(path)
    if not os.path.basename(directory).startswith("jaxcolo-"):
        return
    from jaxcolo.transport.listener import unlink_socket
    if unlink:
        unlink_socket(path)
    if coordinator:
        _remove_peer_sockets(directory, path)
    try:
        os.rmdir(directory)
    except OSError:
        pass  # not empty (another host's socket), or gone already


# Host 0 of a cluster whose controller died waits this long for the other
# workers to remove their sockets before it exits.
PEER_EXIT_WAIT = 5.0


def _remove_peer_sockets(directory: str, own: str) -> None:
    """Wait for the other sockets in ``directory`` to go (bounded), then
    remove those that refuse connections (their worker is gone)."""
    def others():
        try:
            return [os.path.join(directory, n) for n in os.listdir(directory)
                    if n.endswith(".sock") and os.path.join(directory, n)
                    != own]
        except OSError:
            return []
    deadline = time.monotonic() + PEER_EXIT_WAIT
    while others() and time.monotonic() < deadline:
        time.sleep(0.05)
    from jaxcolo.transport.listener import remove_stale_socket
    for other in others():
        try:
            remove_stale_socket(other)
        except OSError:
            pass  # in use (a worker still listens), or not a socket


def _remove_dead_parents_segments(pid: int, wait: float) -> None:
    """Once the controller that started this worker (``pid``) is dead --
    waiting up to ``wait`` seconds for this process to be reparented --
    remove its shared-memory segments: killed, it could not, and the ones
    it made but had not sent yet are nobody else's to find."""
    deadline = time.monotonic() + wait
    while os.getppid() == pid:
        if time.monotonic() >= deadline:
            return  # alive: it closed its connection, and cleans up itself
        time.sleep(0.02)
    from jaxcolo.transport import blobs
    blobs.unlink_process_segments(pid)


def run(args) -> int:
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.WARNING),
        format=f"jaxcolo worker h{args.host_index} pid {os.getpid()}: "
               "%(levelname)s %(message)s")
    # (host 0 of a cluster: its exit ends the other workers' processes)
    coordinator = args.num_hosts > 1 and args.host_index == 0
    if args.parent_pid:
        threading.Thread(target=_watch_parent,
                         args=(args.parent_pid, args.listen, coordinator),
                         daemon=True).start()
        # Ctrl-C in the controller's terminal reaches its whole process
        # group: it interrupts the controller's call, never its workers
        # (they end with the controller, or when told to).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    check_arguments(args)
    authkey = read_authkey(args.authkey_file)
    local = args.local_devices or max(1, 8 // args.num_hosts)
    blocks = device_blocks(args.device_map, args.num_hosts, local)
    my_ids = start_jax(args, local, blocks)
    listening = []

    def terminate(*_):
        # jax.distributed installs a SIGTERM (preemption) handler; a worker
        # asked to stop stops, removing its Unix socket and its shared-
        # memory segments first (its controller's mappings live on).
        for listener in listening:
            listener.close()
        from jaxcolo.transport import blobs
        blobs.unlink_process_segments(os.getpid())
        if args.parent_pid:  # the whole process group may be ending
            # (timeout, kill -TERM -PGID, a scheduler): a controller killed
            # with its workers leaves its segments and socket directory
            _remove_dead_parents_segments(args.parent_pid, TERM_PARENT_WAIT)
            if os.getppid() != args.parent_pid:
                _remove_dead_parents_socket_dir(args.listen, unlink=True,
                                                coordinator=coordinator)
        os._exit(0)
    signal.signal(signal.SIGTERM, terminate)

    from jaxcolo.process import main_types
    from jaxcolo.process.messages import Message, encode
    from jaxcolo.process.worker import Session
    main_types.install()  # "__main__:" names are the controller's script's
    from jaxcolo import versions
    from jaxcolo.transport import handshake, listener as listener_mod
    from jaxcolo_fb import MessageKind

    hello = handshake.local_hello(
        "worker", min_version=args.min_version, max_version=args.max_version,
        host_index=args.host_index, device_ids=my_ids)
    lock = threading.Lock()
    state = {"session": None}
    done = threading.Event()

    def ended(session):
        with lock:
            if state["session"] is session:
                state["session"] = None
        if args.parent_pid and not session.shutdown_requested:
            _remove_dead_parents_segments(args.parent_pid, 2.0)
        if args.exit_with_controller:
            done.set()

    def on_channel(channel):
        with lock:
            busy = state["session"] is not None
            if not busy:
                state["session"] = Session(channel, host_index=args.host_index,
                                           on_end=ended,
                                           shm_retain=args.shm_retain)
        if busy:
            log.warning("refused a second controller: this worker serves "
                        "one at a time")
            try:
                channel.send(encode(Message(
                    MessageKind.error, error_type="jaxcolo.ExecutorError",
                    error_message=(f"this worker (--host-index "
                                   f"{args.host_index}) already serves a "
                                   "controller")), channel.version))
            except Exception:
                pass
            channel.close()

    try:
        listener = listener_mod.Listener(args.listen, authkey, lambda: hello,
                               on_channel,
                               need=versions.FEATURE_SINCE["message"])
    except OSError as e:
        raise SystemExit(f"jaxcolo worker: cannot listen on {args.listen}: "
                         f"{e.strerror or e}") from None
    listening.append(listener)
    where = listener.address_text
    line = f"{READY} {where}\n"
    if args.ready_fd is not None:
        with os.fdopen(args.ready_fd, "w") as f:
            f.write(line)
    else:
        sys.stdout.write(f"jaxcolo worker (host {args.host_index} of "
                         f"{args.num_hosts}, devices {my_ids}) listening on "
                         f"{where}\n")
        sys.stdout.flush()
    try:
        while not done.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    listener.close()
    if args.parent_pid and os.getppid() != args.parent_pid:
        _remove_dead_parents_socket_dir(args.listen, unlink=False,
                                        coordinator=coordinator)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no atexit: a jax.distributed shutdown would wait for peers
