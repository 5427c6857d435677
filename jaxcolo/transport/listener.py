"""The listening side of channels: accepts connections, authenticates and
greets each in its own thread (at most MAX_PENDING_SETUPS at once), and hands
the resulting :class:`~jaxcolo.transport.channel.Channel` on."""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import threading
import time
from typing import Callable

from jaxcolo.transport import handshake
from jaxcolo.transport.channel import DEFAULT_TIMEOUT, Channel, \
    _authenticate_and_greet, _tcp_options, format_address, parse_address

log = logging.getLogger("jaxcolo.transport")
# Connections being authenticated at once (each holds 2 fds and 2 threads);
# more are closed on arrival, so a flood of silent peers stays bounded.
MAX_PENDING_SETUPS = 64


def unlink_socket(path: str) -> None:
    """Remove ``path`` if it is a Unix socket (a dead listener's, or one
    whose listener is done with it); nothing if it is gone already."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except OSError:
        pass


def remove_stale_socket(path: str) -> None:
    """Unlink a Unix socket left by a dead listener (nothing accepts on it);
    OSError if ``path`` is in use or is not a socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # stale: its listener is gone
        return
    except OSError:
        pass
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"{path} is in use by a running listener")


class Listener:
    """Accepts connections; each is authenticated and greeted in its own
    thread, then handed to ``on_channel(channel)``.  Refused peers (wrong
    key, no common version, malformed hello, silence) are logged and
    dropped; the listener keeps serving."""

    def __init__(self, address: str | tuple, authkey: bytes,
                 hello_fn: Callable[[], "handshake.Hello"],
                 on_channel: Callable[[Channel], None], *,
                 timeout: float = DEFAULT_TIMEOUT, need: int = 1):
        if isinstance(address, str):
            address = parse_address(address)
        self._path = None
        if isinstance(address, str):   # a Unix-domain socket path
            remove_stale_socket(address)
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self._sock.bind(address)
                self._sock.listen()
            except OSError:
                self._sock.close()
                raise
            self._path = self.address = address
        else:
            self._sock = socket.create_server(address, family=(
                socket.AF_INET6 if ":" in address[0] else socket.AF_INET))
            self.address = self._sock.getsockname()[:2]
        self._authkey = authkey
        self._hello_fn = hello_fn
        self._on_channel = on_channel
        self._timeout = timeout
        self._need = need
        self.refused = 0  # connections refused so far (set-up slot free)
        self._refused_lock = threading.Lock()
        self._closed = False
        self._pending = threading.BoundedSemaphore(MAX_PENDING_SETUPS)
        self._last_warning = 0.0
        self._thread = threading.Thread(target=self._accept_loop,
                                        name="jaxcolo-listener", daemon=True)
        self._thread.start()

    def _accept_loop(self):
        """Accept until closed.  Running out of fds or threads (a flood)
        pauses accepting, it never ends it."""
        while not self._closed:
            try:
                sock, peer = self._sock.accept()
            except OSError as e:
                if self._closed or e.errno in (errno.EBADF, errno.EINVAL):
                    return  # the listening socket is gone
                self._warn(f"accept failed ({e}); retrying")
                time.sleep(0.05)
                continue
            if not self._pending.acquire(blocking=False):
                sock.close()
                self._count_refused()
                self._warn(f"refused a connection: {MAX_PENDING_SETUPS} "
                           "are already being set up")
                continue
            try:
                if self._path is None:
                    _tcp_options(sock)
                    peer = format_address(peer[:2])
                else:
                    peer = format_address(self._path)
                threading.Thread(target=self._setup, args=(sock, peer),
                                 daemon=True).start()
            except Exception as e:  # noqa: BLE001 - e.g. no thread to start
                sock.close()
                self._pending.release()
                self._warn(f"dropped a connection: {e!r}")
                time.sleep(0.05)

    def _warn(self, text: str) -> None:
        """Log ``text``, at most once a second (floods must not flood logs)."""
        now = time.monotonic()
        if now - self._last_warning >= 1.0:
            self._last_warning = now
            log.warning("listener %s: %s", self.address_text, text)

    def _setup(self, sock, peer):
        channel = None
        try:
            channel = _authenticate_and_greet(
                sock, self._authkey, self._hello_fn(), self._timeout, True,
                self._need)
        except Exception as e:  # noqa: BLE001 - refuse, log, keep serving
            error = e
        finally:
            self._pending.release()
        if channel is None:
            log.warning("refused connection from %s: %s", peer, error)
            self._count_refused()  # last (slot free): tests wait on it
            return
        self._on_channel(channel)

    def _count_refused(self) -> None:
        with self._refused_lock:
            self.refused += 1

    def close(self):
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self._path is not None:
            try:
                os.unlink(self._path)
            except OSError:
                pass

    @property
    def address_text(self) -> str:
        """Where to connect: ``HOST:PORT`` or ``unix:PATH``."""
        return format_address(self.address)
