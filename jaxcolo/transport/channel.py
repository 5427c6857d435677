"""Authenticated, framed connections between a controller and its workers.

Authentication is multiprocessing.connection's HMAC challenge (both ways,
with a shared key) on a TCP socket; nothing a peer sends is decoded before it
has answered the challenge.  Then each side sends a Hello
(:mod:`jaxcolo.transport.handshake`) and both use the agreed payload version.
After that every frame is one jaxcolo payload, at most ``MAX_FRAME`` bytes
(bulk array bytes travel out of band, see :mod:`jaxcolo.transport.blobs`).

Time bounds: connecting, authenticating and the hello exchange each give up
after ``timeout`` seconds (a silent or slow peer cannot stall a listener: the
socket is shut down, which wakes the blocked read).
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import os
import select
import socket
import struct
import threading
import time

from jaxcolo.errors import ExecutorError, PayloadError, VersionError
from jaxcolo.transport import handshake
from jaxcolo.transport.writer import FrameWriter, SendDeadline

log = logging.getLogger("jaxcolo.transport")

MAX_FRAME = 64 << 20
# Frames are read (multiprocessing.connection's framing: a "!i" length, or
# -1 and a "!Q" length) at most this much per read, so memory grows with the
# bytes that arrive and each read that returns counts as progress.
READ_STEP = 1 << 20
_LENGTH = struct.Struct("!i")
_LENGTH64 = struct.Struct("!Q")
def _seconds_from_env(name: str, default: float, zero: bool,
                      most: float = float("inf")) -> float:
    """Environment variable ``name`` as seconds, up to ``most`` (``inf``:
    never; 0 only if ``zero``), else ``default`` -- with a warning if it is
    set to anything else (a typo must not stop every import of the
    executor)."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 0 if zero else value > 0) or value > most:  # (NaN)
        log.warning("%s=%r is not a %s number of seconds%s; using %s", name,
                    text, "non-negative" if zero else "positive",
                    f" up to {most}" if most < float("inf") else "", default)
        return default
    return value


# Seconds a receiver expecting a frame soon polls without sleeping before it
# blocks (saves a scheduler wake-up per message); JAXCOLO_SPIN overrides
# (0: never spin).
SPIN = _seconds_from_env("JAXCOLO_SPIN", 0.0002, zero=True, most=1.0)
DEFAULT_TIMEOUT = 10.0
# Seconds a frame may take to arrive once its first byte is readable (a peer
# that stalls mid-frame is disconnected); JAXCOLO_FRAME_TIMEOUT overrides.
FRAME_TIMEOUT = _seconds_from_env("JAXCOLO_FRAME_TIMEOUT", 120.0, zero=False)
# A TCP peer that vanishes (host down, network partition) is detected by
# kernel keepalive probes: idle seconds, probe interval, probe count.
KEEPALIVE = (10, 5, 3)


def _tcp_options(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"),
                           KEEPALIVE):
        if hasattr(socket, name):  # Linux; other systems keep defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


UNIX_PREFIX = "unix:"


def parse_address(text: str) -> tuple[str, int] | str:
    """``HOST:PORT`` -> (host, port); ``unix:PATH`` -> PATH (a Unix-domain
    socket: same machine only, cheaper per message than loopback TCP)."""
    if text.startswith(UNIX_PREFIX):
        path = text[len(UNIX_PREFIX):]
        if not path:
            raise ValueError(f"address {text!r} has no socket path")
        return path
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address {text!r} is not HOST:PORT (port 0..65535) "
                         "or unix:PATH")
    if host.startswith("[") and host.endswith("]"):  # an IPv6 literal
        host = host[1:-1]
        if ":" not in host:
            raise ValueError(f"address {text!r}: only IPv6 addresses go in "
                             "brackets")
    elif ":" in host:
        raise ValueError(f"address {text!r}: an IPv6 address goes in "
                         "brackets, [ADDRESS]:PORT")
    return host or "127.0.0.1", int(port)


def format_address(address) -> str:
    if isinstance(address, str):
        return UNIX_PREFIX + address
    host = f"[{address[0]}]" if ":" in address[0] else address[0]
    return f"{host}:{address[1]}"


class FrameTooLarge(ExecutorError):
    """A frame over MAX_FRAME bytes was not sent (the channel is intact)."""


def _check_sizes(frames) -> None:
    for frame in frames:
        n = len(frame) if not isinstance(frame, memoryview) else frame.nbytes
        if n > MAX_FRAME:
            raise FrameTooLarge(f"a message of {n} bytes exceeds the "
                                f"{MAX_FRAME >> 20} MiB frame limit")


class _Watchdog:
    """Shuts a socket down unless cancelled within ``timeout`` seconds."""

    def __init__(self, sock: socket.socket, timeout: float):
        self.fired = False
        self._sock = sock
        self._timer = threading.Timer(timeout, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self):
        self.fired = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def cancel(self):
        self._timer.cancel()


class Channel:
    """One authenticated connection after the hello exchange.

    ``send``/``recv`` move whole frames; ``version`` is the agreed payload
    version and ``peer`` the peer's Hello.  Sends are serialised by a lock so
    several threads may send; one thread should receive.  A frame that does
    not complete within ``FRAME_TIMEOUT`` seconds of its start closes the
    channel (a watchdog thread checks once a second).
    """

    def __init__(self, sock: socket.socket, conn: mpc.Connection,
                 peer: handshake.Hello, version: int):
        self._sock = sock
        self._conn = conn
        self.peer = peer
        self.version = version
        self._writer = FrameWriter(sock, lambda: self.closed, self.close)
        self._send_lock = self._writer.lock
        self._poll = select.poll()
        self._poll.register(conn.fileno(), select.POLLIN | select.POLLPRI)
        self.closed = False
        self.frame_timeout = FRAME_TIMEOUT
        self._frame_started = 0.0  # monotonic start of a frame being read
        self.last_frame = time.monotonic()  # when the last frame completed
        self.last_bytes = 0.0  # when the last bytes of a frame arrived
        self._fd = conn.fileno()
        threading.Thread(target=self._watch_frames, daemon=True,
                         name="jaxcolo-frame-watch").start()

    def _watch_frames(self) -> None:
        while not self.closed:
            time.sleep(min(1.0, max(0.05, self.frame_timeout / 4)))
            started = self._frame_started
            if started and time.monotonic() - started > self.frame_timeout:
                log.warning("a frame did not complete within %ss: closing "
                            "the connection", self.frame_timeout)
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return

    def silent_for(self) -> float:
        """Seconds since the last frame arrived or, while one is arriving,
        since its last bytes did (a slow link's frame is a sign of life; a
        peer that stopped in the middle of one is silent)."""
        started = self._frame_started
        if started:
            return time.monotonic() - max(started, self.last_bytes)
        return time.monotonic() - self.last_frame

    def _read_exact(self, n: int, at_start: bool = False) -> bytes:
        """``n`` bytes of the frame being read (EOFError at ``at_start``
        when the peer closed between frames; OSError when in a frame)."""
        read, fd = os.read, self._fd
        chunk = read(fd, min(n, READ_STEP))
        if len(chunk) == n:
            return chunk
        parts = []
        got = 0
        while True:
            if not chunk:
                if at_start and not got:
                    raise EOFError
                raise OSError("got end of file during message")
            self.last_bytes = time.monotonic()
            parts.append(chunk)
            got += len(chunk)
            if got >= n:
                return b"".join(parts)
            chunk = read(fd, min(n - got, READ_STEP))

    def _recv_frame(self, maxsize: int) -> bytes:
        """One frame of at most ``maxsize`` bytes (OSError if longer: the
        frame is refused before its body is read)."""
        size, = _LENGTH.unpack(self._read_exact(4, at_start=True))
        if size == -1:
            size, = _LENGTH64.unpack(self._read_exact(8))
        if size < 0 or size > maxsize:
            raise OSError("bad message length")
        return self._read_exact(size) if size else b""

    def readable(self, timeout: float | None, spin: float = 0.0) -> bool:
        """True when a frame (or EOF, or an error) is waiting, within
        ``timeout`` seconds (None: wait as long as it takes), polling
        without sleeping for the first ``spin`` seconds (a reply expected
        soon then costs no wake-up).  For the one thread receiving."""
        poll = self._poll.poll
        try:
            if spin > 0.0:
                end = time.perf_counter() + spin
                while True:
                    if poll(0):
                        return True
                    if time.perf_counter() >= end:
                        break
            return bool(poll(None if timeout is None else timeout * 1000.0))
        except (OSError, ValueError):
            return True  # recv reports what went wrong

    def input_waiting(self) -> bool:
        """Whether bytes (or EOF) wait to be read, now; for any thread (the
        receiving thread's poll object is not shared)."""
        try:
            p = select.poll()
            p.register(self._fd, select.POLLIN)
            return bool(p.poll(0))
        except (OSError, ValueError):
            return False

    def send(self, frame, deadline: float | None = None) -> None:
        """Send one frame; see :meth:`send_frames`."""
        self.send_frames((frame,), deadline)

    def send_if_idle(self, frame: bytes, wait: float) -> bool:
        """Send one frame unless another send holds the connection for more
        than ``wait`` seconds (a peer that stopped reading): False then,
        nothing sent.  ExecutorError if the connection is lost."""
        try:
            self.send_frames((frame,), time.monotonic() + wait,
                             finish=False)
        except SendDeadline:
            return False
        return True

    def send_frames(self, frames, deadline: float | None = None, *,
                    finish: bool = True) -> None:
        """Send frames with nothing in between (a message and the
        out-of-band buffers that follow it): all, or (FrameTooLarge)
        none; past ``deadline`` see FrameWriter.send_frames."""
        _check_sizes(frames)
        self._writer.send_frames(frames, deadline, finish=finish)

    def recv_buffer(self, size: int, chunk: int):
        """Read ``size`` bytes sent as frames of at most ``chunk`` bytes
        (one empty frame when ``size`` is 0) into a new bytearray.

        Memory grows with the bytes that actually arrive, never with what
        ``size`` or a frame header announces (a frame longer than expected
        is refused before it is read: the connection is then closed)."""
        out = bytearray()
        try:
            while True:
                want = min(chunk, size - len(out))
                self._frame_started = time.monotonic()
                part = self._recv_frame(want)  # OSError if longer
                self._frame_started = 0.0
                self.last_frame = time.monotonic()
                if len(part) != want:
                    raise ExecutorError(f"out-of-band frame of {len(part)} "
                                        f"bytes, expected {want}")
                out += part
                if len(out) >= size:
                    return out
        except ExecutorError:
            self.close()
            raise
        except EOFError:
            self.close()
            raise ExecutorError("connection closed by peer") from None
        except (OSError, MemoryError) as e:
            self.close()
            raise ExecutorError(f"connection lost: {e!r}") from None

    def recv(self, timeout: float | None = None) -> bytes:
        """The next frame; ExecutorError on EOF, timeout or an oversized
        frame (the connection is then closed)."""
        try:
            if timeout is not None and not self._conn.poll(timeout):
                raise ExecutorError(f"no message within {timeout}s")
            self._frame_started = time.monotonic()
            frame = self._recv_frame(MAX_FRAME)
            self._frame_started = 0.0
            self.last_frame = time.monotonic()
            return frame
        except EOFError:
            self.close()
            raise ExecutorError("connection closed by peer") from None
        except OSError as e:  # includes "bad message length"
            self.close()
            raise ExecutorError(f"connection lost: {e}") from None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._fd = -1  # its number may go to another file: reads now fail
        self._conn.close()
        self._sock.close()


def _authenticate_and_greet(sock, authkey: bytes, hello, timeout: float,
                            server: bool, need: int) -> Channel:
    conn = mpc.Connection(os.dup(sock.fileno()))
    dog = _Watchdog(sock, timeout)
    try:
        if server:
            mpc.deliver_challenge(conn, authkey)
            mpc.answer_challenge(conn, authkey)
        else:
            mpc.answer_challenge(conn, authkey)
            mpc.deliver_challenge(conn, authkey)
        conn.send_bytes(handshake.encode_hello(hello))
        peer = handshake.decode_hello(conn.recv_bytes(4096))
    except mpc.AuthenticationError as e:
        conn.close()
        sock.close()
        raise ExecutorError(f"authentication failed: {e}") from None
    except (EOFError, OSError) as e:
        conn.close()
        sock.close()
        why = ("timed out" if dog.fired else
               "failed: the peer closed the connection"
               if isinstance(e, EOFError) else
               f"failed ({str(e) or type(e).__name__})")
        raise ExecutorError(f"connection setup {why}") from None
    except PayloadError:
        conn.close()
        sock.close()
        raise
    except Exception as e:  # noqa: BLE001 - e.g. multiprocessing's assert
        conn.close()        # on a frame that is not a challenge
        sock.close()
        raise ExecutorError(f"connection setup failed: the peer does not "
                            f"speak the jaxcolo handshake ({type(e).__name__}"
                            f": {str(e)[:200]})") from None
    finally:
        dog.cancel()
    try:
        version = handshake.negotiate(hello, peer, need=need)
    except Exception:
        conn.close()
        sock.close()
        raise
    return Channel(sock, conn, peer, version)


def connect(address: str | tuple, authkey: bytes, hello, *,
            timeout: float = DEFAULT_TIMEOUT, need: int = 1) -> Channel:
    """Connect, authenticate and exchange hellos (client side)."""
    if isinstance(address, str):
        address = parse_address(address)
    try:
        if isinstance(address, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect(address)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection(address, timeout=timeout)
            _tcp_options(sock)
    except OSError as e:
        raise ExecutorError(f"cannot connect to {format_address(address)}: "
                            f"{e}") from None
    sock.settimeout(None)
    where = f"(the peer at {format_address(address)})"
    try:
        return _authenticate_and_greet(sock, authkey, hello, timeout, False,
                                       need)
    except VersionError as e:  # which of several peers it was
        raise VersionError(f"{e.reason} {where}", e.path) from None
    except ExecutorError as e:
        raise ExecutorError(f"{e} {where}") from None
