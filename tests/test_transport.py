"""Authenticated channels and the hello handshake, over real loopback sockets."""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import os
import queue
import socket
import threading
import time

import numpy as np
import pytest

import jaxcolo
from jaxcolo import versions
from jaxcolo.errors import ExecutorError
from jaxcolo.transport import channel as ch
from jaxcolo.transport import listener as listener_mod
from jaxcolo.transport.listener import Listener
from jaxcolo.transport import handshake as hs
from jaxcolo.transport import peer_segments

KEY = b"test-key-123"


def _echo_listener(hello=None, need=1, timeout=5.0, address="127.0.0.1:0"):
    got = queue.Queue()

    def on_channel(c):
        got.put(c)

        def loop():
            while True:
                try:
                    c.send(c.recv())
                except ExecutorError:
                    return
        threading.Thread(target=loop, daemon=True).start()
    hello_fn = hello or (lambda: hs.local_hello("worker", host_index=1,
                                                device_ids=[2, 3]))
    return Listener(address, KEY, hello_fn, on_channel,
                       timeout=timeout, need=need), got


def test_hello_round_trip_and_checks():
    h = hs.local_hello("worker", host_index=3, device_ids=[4, 5, 6])
    assert hs.decode_hello(hs.encode_hello(h)) == h
    info = jaxcolo.inspect(hs.encode_hello(h))
    assert info["root_kind"] == "hello" and info["hello"]["device_ids"] == [4, 5, 6]
    assert jaxcolo.deserialize(hs.encode_hello(h)) == h
    with pytest.raises(jaxcolo.PayloadError, match=r"expected a Hello"):
        hs.decode_hello(jaxcolo.serialize(None))
    bad = hs.Hello(3, 2, "worker")
    with pytest.raises(jaxcolo.PayloadError, match=r"invalid version range "
                                                   r"3\.\.2 - at \$\.min_version"):
        hs.decode_hello(hs.encode_hello(bad))
    with pytest.raises(jaxcolo.PayloadError, match=r"unknown role 'x' - at \$\.role"):
        hs.decode_hello(hs.encode_hello(hs.Hello(1, 2, "x")))


def test_negotiate_highest_common_and_refusal_names_both_ranges():
    ctl = hs.Hello(1, 5, "controller", "new")
    assert hs.negotiate(ctl, hs.Hello(2, 3, "worker", "old")) == 3
    assert hs.negotiate(hs.Hello(1, 3, "controller"),
                        hs.Hello(1, 9, "worker")) == 3
    with pytest.raises(jaxcolo.VersionError,
                       match=r"this controller speaks 1\.\.1 \(old\), the worker "
                             r"speaks 2\.\.4 \(new\).*upgrade this controller"):
        hs.negotiate(hs.Hello(1, 1, "controller", "old"),
                     hs.Hello(2, 4, "worker", "new"))
    with pytest.raises(jaxcolo.VersionError, match=r"upgrade the worker"):
        hs.negotiate(hs.Hello(5, 6, "controller"), hs.Hello(1, 3, "worker"))
    # Told to speak older versions than its jaxcolo writes: raise the
    # limit, when that reaches what is needed; else upgrade.
    for (lo, hi), need, advice in [
            ((14, 20), 2, r"upgrade this controller's jaxcolo"),
            ((2, 20), 2, r"raise this controller's max_version \(its jaxcolo "
                         r"writes up to version 12\)")]:
        with pytest.raises(jaxcolo.VersionError, match=advice):
            hs.negotiate(
                hs.Hello(1, 1, "controller", "jaxcolo schema 12 / jax 0.10.2"),
                hs.Hello(lo, hi, "worker", "jaxcolo schema 20"), need=need)
    with pytest.raises(jaxcolo.VersionError, match=r"upgrade the worker's"):
        hs.negotiate(hs.Hello(14, 20, "controller", "jaxcolo schema 20"),
                     hs.Hello(1, 3, "worker", "jaxcolo schema 12"), need=2)
    with pytest.raises(jaxcolo.VersionError, match=r"need version >= 2"):
        hs.negotiate(hs.Hello(1, 1, "controller"), hs.Hello(1, 1, "worker"),
                     need=2)


def test_authenticated_echo_with_agreed_version():
    lis, got = _echo_listener()
    try:
        c = ch.connect(lis.address, KEY, hs.local_hello("controller"))
        assert c.version == versions.SCHEMA_VERSION
        assert c.peer.role == "worker" and c.peer.device_ids == (2, 3)
        for n in (0, 1, 1000, 5 << 20):
            frame = os.urandom(n)
            c.send(frame)
            assert c.recv(timeout=10) == frame
        c.close()
    finally:
        lis.close()


def test_unix_socket_channel_authenticates_and_echoes(tmp_path, caplog):
    path = str(tmp_path / "w.sock")
    lis, got = _echo_listener(address="unix:" + path)
    try:
        assert lis.address_text == "unix:" + path
        with caplog.at_level(logging.WARNING, logger="jaxcolo.transport"):
            with pytest.raises(ExecutorError, match="authentication failed"):
                ch.connect(lis.address_text, b"wrong",
                           hs.local_hello("controller"))
            deadline = time.time() + 20
            while not lis.refused and time.time() < deadline:
                time.sleep(0.02)
        assert f"refused connection from unix:{path}" in caplog.text
        c = ch.connect(lis.address_text, KEY, hs.local_hello("controller"))
        assert c.peer.device_ids == (2, 3)
        for n in (0, 7, 3 << 20):
            frame = os.urandom(n)
            c.send(frame)
            assert c.readable(10.0, spin=0.001)
            assert c.recv(timeout=10) == frame
        assert not c.readable(0.01, spin=0.001)  # nothing waiting: False
        c.close()
    finally:
        lis.close()
    assert not os.path.exists(path)  # the listener removed its socket
    with pytest.raises(ExecutorError, match="cannot connect to unix:"):
        ch.connect("unix:" + path, KEY, hs.local_hello("controller"),
                   timeout=2)
    with pytest.raises(ValueError, match="no socket path"):
        ch.parse_address("unix:")


def test_wrong_key_refused_logged_and_listener_keeps_serving(caplog):
    lis, got = _echo_listener()
    try:
        with caplog.at_level(logging.WARNING, logger="jaxcolo.transport"):
            with pytest.raises(ExecutorError, match="authentication failed"):
                ch.connect(lis.address, b"wrong", hs.local_hello("controller"))
            deadline = time.time() + 20
            while not lis.refused and time.time() < deadline:
                time.sleep(0.02)
        assert lis.refused == 1 and got.empty()
        assert "refused connection" in caplog.text
        c = ch.connect(lis.address, KEY, hs.local_hello("controller"))
        c.send(b"ok")
        assert c.recv(timeout=10) == b"ok"
        c.close()
    finally:
        lis.close()


def test_version_skew_refused_on_both_sides():
    lis, got = _echo_listener(need=2)
    try:
        old = hs.local_hello("controller", min_version=1, max_version=1)
        with pytest.raises(jaxcolo.VersionError,
                           match=r"this controller speaks 1\.\.1.*worker speaks "
                                 rf"1\.\.{versions.SCHEMA_VERSION}"):
            ch.connect(lis.address, KEY, old, need=2)
        c = ch.connect(lis.address, KEY, hs.local_hello("controller"), need=2)
        assert c.version == versions.SCHEMA_VERSION
        c.close()
    finally:
        lis.close()


def test_silent_and_malformed_peers_are_dropped():
    lis, got = _echo_listener(timeout=0.5)
    try:
        silent = socket.create_connection(lis.address)  # never answers
        # Authenticates, then sends garbage instead of a Hello.
        raw = socket.create_connection(lis.address)
        conn = mpc.Connection(os.dup(raw.fileno()))
        mpc.answer_challenge(conn, KEY)
        mpc.deliver_challenge(conn, KEY)
        conn.send_bytes(b"JXCO" + b"\x00" * 40)
        deadline = time.time() + 20
        while lis.refused < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert lis.refused == 2 and got.empty()
        silent.close(), conn.close(), raw.close()
        c = ch.connect(lis.address, KEY, hs.local_hello("controller"))
        c.close()
    finally:
        lis.close()


def test_a_peer_closing_during_setup_is_named():
    """A server that accepts and closes (as a worker busy greeting other
    peers does): the error read 'connection setup failed ()'."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def accept_and_close():
        conn, _ = srv.accept()
        conn.close()
    t = threading.Thread(target=accept_and_close, daemon=True)
    t.start()
    try:
        with pytest.raises(ExecutorError, match=r"^connection setup failed: "
                                                r"the peer closed the "
                                                r"connection"):
            ch.connect(srv.getsockname(), KEY, hs.local_hello("controller"))
    finally:
        t.join(10)
        srv.close()


def test_recv_timeout_and_peer_close():
    lis, got = _echo_listener()
    try:
        c = ch.connect(lis.address, KEY, hs.local_hello("controller"))
        with pytest.raises(ExecutorError, match="no message within"):
            c.recv(timeout=0.1)
        got.get(timeout=5).close()
        with pytest.raises(ExecutorError, match="closed by peer|lost"):
            c.recv(timeout=5)
    finally:
        lis.close()


# --------------------------------------------- listener under abuse (review)

def _wait_for(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_connections_in_setup_are_capped_and_the_listener_recovers(
        monkeypatch):
    """Silent peers (never answering the HMAC challenge) beyond the cap are
    closed on arrival, so fds and threads stay bounded; once they go, a
    real controller connects."""
    monkeypatch.setattr(listener_mod, "MAX_PENDING_SETUPS", 4)
    listener, got = _echo_listener(timeout=30.0)
    silent = [socket.create_connection(listener.address) for _ in range(12)]
    try:
        _wait_for(lambda: listener.refused >= 8)
        for s in silent[4:]:  # closed by the listener: EOF after the bytes
            s.settimeout(5)   # of nothing (no challenge was sent)
            assert s.recv(1024) == b""
    finally:
        for s in silent:
            s.close()
    # The four in set-up fail on EOF; each frees its slot before it counts.
    _wait_for(lambda: listener.refused >= 12)
    c = ch.connect(listener.address, KEY, hs.local_hello("controller"))
    c.send(b"ping")
    assert c.recv() == b"ping"
    c.close()
    listener.close()


def test_a_peer_speaking_something_else_is_refused_and_closed():
    """A peer that answers the challenge, then sends a frame that is not
    one (multiprocessing asserts on it): the worker side closes the
    connection at once (it leaked until GC) and the controller side gets
    an ExecutorError (it got a bare AssertionError)."""
    listener, _ = _echo_listener()
    sock = socket.create_connection(listener.address)
    conn = mpc.Connection(sock.detach())
    mpc.answer_challenge(conn, KEY)
    conn.send_bytes(b"not a challenge")
    t0 = time.monotonic()
    with pytest.raises((EOFError, OSError)):
        while True:
            conn.recv_bytes()
    assert time.monotonic() - t0 < 3
    conn.close()
    listener.close()

    server = socket.create_server(("127.0.0.1", 0))

    def speak_other():
        s, _ = server.accept()
        other = mpc.Connection(s.detach())
        other.send_bytes(b"hello")
        time.sleep(1)
        other.close()
    threading.Thread(target=speak_other, daemon=True).start()
    with pytest.raises(ExecutorError, match="does not speak the jaxcolo "
                                            "handshake"):
        ch.connect(server.getsockname()[:2], KEY,
                   hs.local_hello("controller"), timeout=5)
    server.close()


def test_unix_socket_paths_stale_in_use_or_not_sockets(tmp_path):
    path = str(tmp_path / "w.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)  # a socket file nobody accepts on (a killed worker's)
    stale.close()
    listener, _ = _echo_listener(address="unix:" + path)
    with pytest.raises(OSError, match="in use by a running listener"):
        _echo_listener(address="unix:" + path)
    listener.close()
    assert not os.path.exists(path)
    other = tmp_path / "file"
    other.write_text("not a socket")
    with pytest.raises(OSError, match="exists and is not a socket"):
        _echo_listener(address=f"unix:{other}")
    assert other.read_text() == "not a socket"


@pytest.mark.parametrize("text,want", [("30", 30.0), ("inf", float("inf")),
                                       ("0", 120.0), ("-1", 120.0),
                                       ("abc", 120.0), ("nan", 120.0)])
def test_frame_timeout_setting(monkeypatch, text, want):
    monkeypatch.setenv("JAXCOLO_FRAME_TIMEOUT", text)
    assert ch._seconds_from_env("JAXCOLO_FRAME_TIMEOUT", 120.0,
                                zero=False) == want


@pytest.mark.parametrize("text,want", [("0.001", 0.001), ("0", 0.0),
                                       ("1", 1.0), ("2", 0.0002),
                                       ("inf", 0.0002), ("-1", 0.0002),
                                       ("abc", 0.0002), ("nan", 0.0002)])
def test_spin_setting(monkeypatch, text, want):
    monkeypatch.setenv("JAXCOLO_SPIN", text)
    assert ch._seconds_from_env("JAXCOLO_SPIN", 0.0002, zero=True,
                                most=1.0) == want


@pytest.mark.parametrize("lo,hi", [(0, None), (None, 99), (3, 2)])
def test_version_ranges_may_only_narrow(lo, hi):
    with pytest.raises(ValueError, match="not within this jaxcolo's"):
        hs.local_hello("controller", min_version=lo, max_version=hi)
    with pytest.raises(ValueError, match="not within"):
        jaxcolo.ProcessExecutor(num_hosts=1, min_version=lo, max_version=hi)


@pytest.mark.parametrize("kw", [dict(max_version=5.0), dict(max_version="5"),
                                dict(min_version=True)])
def test_version_bounds_must_be_ints(kw):
    """5.0 started workers and blamed them ("the peer does not speak the
    jaxcolo handshake"), "5" gave a self-contradicting range, True was 1
    (found by review): a TypeError naming the argument, before any worker
    starts."""
    name = next(iter(kw))
    with pytest.raises(TypeError, match=f"{name} must be an int"):
        hs.local_hello("controller", **kw)
    with pytest.raises(TypeError, match=f"{name} must be an int"):
        jaxcolo.ProcessExecutor(num_hosts=1, **kw)
    assert hs.local_hello("controller", max_version=np.int64(5)).max_version \
        == 5


def test_a_closed_channel_never_reads_another_connections_frames():
    """After close(), the channel's fd number goes to the next connection:
    a read on the closed channel fails instead of taking its frames."""
    import queue
    accepted = queue.Queue()
    lis = Listener("127.0.0.1:0", KEY, lambda: hs.local_hello("worker"),
                   accepted.put)
    try:
        first = ch.connect(lis.address_text, KEY, hs.local_hello("controller"))
        accepted.get(timeout=10)
        first.close()
        second = ch.connect(lis.address_text, KEY,
                            hs.local_hello("controller"))
        peer = accepted.get(timeout=10)
        peer.send(b"for the second")
        with pytest.raises(ExecutorError, match="connection lost"):
            first.recv()
        assert second.recv(timeout=5) == b"for the second"
        second.close()
    finally:
        lis.close()


def _socketpair_channel():
    a, b = socket.socketpair()
    chan = ch.Channel(a, mpc.Connection(os.dup(a.fileno())), None, 1)
    return chan, b


def test_a_send_nothing_of_which_went_out_by_its_deadline_is_not_sent():
    """The peer stopped reading and earlier whole frames fill the
    connection: a send that could write nothing by its deadline is
    SendDeadline(started=False) and never arrives (it was handed to a
    thread that sent it later, as if partly sent)."""
    chan, peer = _socketpair_channel()
    sent = 0
    try:
        while True:
            try:
                chan.send(b"x", deadline=time.monotonic() + 0.05)
            except ch.SendDeadline as e:
                assert e.started is False
                break
            sent += 1
        reader = mpc.Connection(os.dup(peer.fileno()))
        got = 0
        while reader.poll(1.0):
            assert reader.recv_bytes() == b"x"
            got += 1
        assert got == sent > 0
        chan.send(b"after")  # the connection is in step
        assert reader.recv_bytes() == b"after"
        reader.close()
    finally:
        chan.close()
        peer.close()


def test_a_send_partly_written_by_its_deadline_is_finished_in_order():
    """A frame partly written at its deadline is SendDeadline(started=True)
    and a thread writes the rest; a send after it waits, and the peer gets
    both whole, in order."""
    chan, peer = _socketpair_channel()
    big = os.urandom(8 << 20)
    try:
        with pytest.raises(ch.SendDeadline) as info:
            chan.send(big, deadline=time.monotonic() + 0.2)
        assert info.value.started is True
        done = threading.Event()
        threading.Thread(target=lambda: (chan.send(b"next"), done.set()),
                         daemon=True).start()
        reader = mpc.Connection(os.dup(peer.fileno()))
        assert reader.recv_bytes() == big
        assert reader.recv_bytes() == b"next"
        assert done.wait(5)
        reader.close()
    finally:
        chan.close()
        peer.close()


def test_segment_pool_frees_idle_pages_past_retain():
    """Idle segments keep at most ``retain`` bytes of pages, least recently
    used freed first (a segment alone past the budget frees its own, not
    the others' warm pages); a freed segment stays valid for the peer's
    open file (a later lease's bytes are read there)."""
    from jaxcolo.transport import blobs, peer_segments
    if not blobs.available():
        pytest.skip("no /dev/shm")
    mib = 1 << 20
    pool = blobs.SegmentPool("t", retain=3 * mib)
    maps = peer_segments.SegmentMaps()
    try:
        small, mid, big = (pool.lease(2 * mib), pool.lease(2 * mib),
                           pool.lease(8 * mib))
        for lease in (small, mid, big):
            maps.add(*lease.announce)
            lease.view[:] = 7
        segs = [pool._segments[x.segment] for x in (small, mid, big)]
        assert segs[2].resident_bytes() >= 8 * mib
        pool.release([small.id])
        assert segs[0].resident_bytes() >= 2 * mib  # within retain
        pool.release([big.id])  # alone past the budget: its own pages go
        assert segs[0].resident_bytes() >= 2 * mib
        assert segs[2].resident_bytes() == 0
        pool.release([mid.id])  # 4 MiB idle: the oldest (small) goes
        assert segs[0].resident_bytes() == 0
        assert segs[1].resident_bytes() >= 2 * mib
        assert pool.stats()["resident_bytes"] == segs[1].resident_bytes()
        again = pool.lease(8 * mib)
        assert again.segment == big.segment and again.announce is None
        again.view[:] = np.arange(8 * mib, dtype=np.uint64).astype(np.uint8)
        seen = maps.view(again.segment, 0, 8 * mib)
        np.testing.assert_array_equal(seen[:1000],
                                      np.arange(1000).astype(np.uint8))
        assert seen[-1] == (8 * mib - 1) % 256
        del seen
        pool.release([again.id])  # 8 MiB > retain: freed again
        assert segs[2].resident_bytes() == 0
        assert segs[1].resident_bytes() >= 2 * mib
    finally:
        maps.clear()
        pool.close()
    with pytest.raises(ValueError, match="retain"):
        blobs.SegmentPool("t", retain=-5)


def test_a_view_past_a_shrunk_segment_file_is_refused():
    """A peer's segment is mapped once, whole: a buffer announced past the
    end of a file the peer shrank since was read through that mapping and
    killed the process with SIGBUS (a ValueError -- PayloadError for a
    message -- before the mapping was kept)."""
    import subprocess
    import sys
    from jaxcolo.transport import blobs
    if not blobs.available():
        pytest.skip("no /dev/shm")
    code = """
import gc, os, sys
name = sys.argv[1]
sys.path[:0] = sys.argv[2:]
from jaxcolo.transport import blobs, peer_segments
size = 1 << 20
fd = os.open(os.path.join(blobs.SHM_DIR, name),
             os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
try:
    os.ftruncate(fd, size)
    maps = peer_segments.SegmentMaps()
    maps.add(1, name, size)
    assert int(maps.view(1, 0, 4096)[0]) == 0  # (mapped now)
    gc.collect()
    os.ftruncate(fd, size // 2)
    try:
        view = maps.view(1, size - 8192, 4096)
        print("read", int(view.sum()))
    except ValueError as e:
        print("refused:", e)
finally:
    os.unlink(os.path.join(blobs.SHM_DIR, name))
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    name = f"jaxcolo-test-shrunk-{os.getpid()}"
    try:
        out = subprocess.run([sys.executable, "-c", code, name, root,
                              os.path.join(root, "generated")],
                             capture_output=True, text=True, timeout=120)
    finally:  # (killed by SIGBUS, it removed nothing)
        blobs.unlink(name)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.startswith("refused:"), out.stdout
    assert "now holds 524288 bytes" in out.stdout


def test_removing_a_process_segments_skips_what_is_not_its_file():
    """/dev/shm is writable by every local user: a directory planted under
    a worker's segment prefix made the removal raise IsADirectoryError,
    killing the thread that makes an orphaned worker exit and making
    ProcessExecutor.close() raise."""
    from jaxcolo.transport import blobs
    if not blobs.available():
        pytest.skip("no /dev/shm")
    pid = 4000000 + os.getpid() % 100000  # no such process
    planted = os.path.join(blobs.SHM_DIR, f"jaxcolo-{pid}-planted")
    segment = os.path.join(blobs.SHM_DIR, f"jaxcolo-{pid}-abc-c0-1")
    os.mkdir(planted)
    try:
        with open(segment, "wb") as f:
            f.write(b"x")
        blobs.unlink_process_segments(pid)
        assert not os.path.exists(segment)
        assert os.path.isdir(planted)
        blobs.unlink(os.path.basename(planted))  # no error either
    finally:
        os.rmdir(planted)
        if os.path.exists(segment):
            os.unlink(segment)


def test_a_peer_still_exiting_at_its_eof_has_its_segments_removed():
    """A killed controller's connection may close before its process is a
    zombie: the worker found it alive at the EOF and left the segments it
    had made and not announced in tmpfs for good (a CI run under load).
    Seen alive, it is watched for a while; one that lives on keeps them."""
    import subprocess
    import sys
    from jaxcolo.transport import blobs
    if not blobs.available():
        pytest.skip("no /dev/shm")
    child = subprocess.Popen([sys.executable, "-c", "import time; "
                              "time.sleep(60)"])
    try:
        names = [f"jaxcolo-{child.pid}-t0k3n-c0-{i}" for i in (1, 2)]
        for name in names:
            with open(os.path.join(blobs.SHM_DIR, name), "wb") as f:
                f.truncate(4096)
        maps = peer_segments.SegmentMaps()
        maps.add(1, names[0], 4096)  # seen; names[1] was never announced
        maps.unlink_dead_owners()
        time.sleep(0.3)  # alive: kept
        assert all(os.path.exists(os.path.join(blobs.SHM_DIR, n))
                   for n in names)
        maps.clear()
        child.kill()
        child.wait(10)
        deadline = time.monotonic() + peer_segments.OWNER_EXIT_WAIT
        while any(os.path.exists(os.path.join(blobs.SHM_DIR, n))
                  for n in names):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        child.kill()
        child.wait(10)
        for name in names:
            blobs.unlink(name)


def test_frames_come_out_whole_and_in_order():
    """Framing as a reader sees it (a guard for changes to the read path):
    frames that arrive together, frames split at any byte, 64-bit lengths
    and out-of-band buffers all come out whole, in order; a frame waiting
    makes the channel readable; an oversized frame is refused, EOF inside
    a frame is an error, not a clean end, and a closed channel takes no
    frame."""
    import struct
    import random
    rng = random.Random(7)
    chan, peer = _socketpair_channel()
    try:
        frames = [os.urandom(rng.choice([0, 1, 4, 300, 5000, 70000,
                                         (1 << 20) + 7])) for _ in range(60)]
        wire = b"".join(struct.pack("!i", len(f)) + f for f in frames)
        long_one = os.urandom(50)
        wire += struct.pack("!i", -1) + struct.pack("!Q", 50) + long_one
        frames.append(long_one)
        oob = os.urandom(20000)
        wire += b"".join(struct.pack("!i", len(p)) + p
                         for p in (b"head", oob[:7000], oob[7000:14000],
                                   oob[14000:], b"tail"))

        def write():
            pos = 0
            while pos < len(wire):  # cut at arbitrary bytes
                n = rng.choice([1, 3, 4, 5, 100, 4096, 1 << 17])
                peer.sendall(wire[pos:pos + n])
                pos += n
        t = threading.Thread(target=write, daemon=True)
        t.start()
        for f in frames:
            assert chan.readable(10.0)
            assert chan.recv(timeout=10) == f
        assert chan.recv(timeout=10) == b"head"
        assert bytes(chan.recv_buffer(20000, 7000)) == oob
        assert chan.recv(timeout=10) == b"tail"
        t.join(10)
        # two frames in one write
        peer.sendall(struct.pack("!i", 2) + b"ab" + struct.pack("!i", 1) +
                     b"c")
        assert chan.recv(timeout=10) == b"ab"
        assert chan.readable(0.0)
        assert chan.recv(timeout=0.01) == b"c"
        assert not chan.readable(0.01)
        peer.sendall(struct.pack("!i", 100) + b"x" * 100)
        with pytest.raises(OSError, match="bad message length"):
            chan._recv_frame(50)
    finally:
        chan.close()
        peer.close()
    chan, peer = _socketpair_channel()
    peer.sendall(struct.pack("!i", 10) + b"abc")
    peer.shutdown(socket.SHUT_WR)
    with pytest.raises(ExecutorError, match="end of file during message"):
        chan.recv(timeout=10)
    peer.close()
    chan, peer = _socketpair_channel()
    peer.sendall(struct.pack("!i", 1) + b"z")
    chan.close()  # a closed channel takes no frame
    with pytest.raises(ExecutorError, match="connection lost"):
        chan.recv()
    peer.close()


def test_a_bad_timing_variable_does_not_stop_the_import():
    """JAXCOLO_SPIN=abc made every import of the executor fail with
    'could not convert string to float' (JAXCOLO_FRAME_TIMEOUT warned and
    used its default); it now warns and uses its default too."""
    import subprocess
    import sys
    out = subprocess.run(
        [sys.executable, "-c", "from jaxcolo.transport import channel; "
         "print(channel.SPIN)"],
        env=dict(os.environ, JAXCOLO_SPIN="abc"), capture_output=True,
        text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == 0.0002
    assert "JAXCOLO_SPIN='abc' is not a non-negative number" in out.stderr
