"""Replies and calls near the transport's limits: a reply that cannot be
framed fails its call (the worker's session, instances and pid survive),
many small buffers never add up to an oversized message, and a message that
is never sent gives its shared memory back."""

import gc
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcolo
from jaxcolo.errors import ExecutorError
from jaxcolo.transport.channel import MAX_FRAME, FrameTooLarge
from tests.colocated_support import cpu_devices, ok_call, put

SMALL = 16384                      # float32s: one 64 KiB buffer each
MANY = MAX_FRAME // (4 * SMALL) + 16  # together past one frame


@pytest.fixture(scope="module")
def host():
    with jaxcolo.ProcessExecutor(num_hosts=1) as ex:
        yield ex


def _bump_all(xs):
    return [x + 1 for x in xs]


def test_many_small_buffers_cross_both_ways(host):
    """1,040 arguments and outputs of 64 KiB (65 MiB each way) once made a
    reply over the 64 MiB frame limit: the worker's session ended and it
    was restarted.  Past 8 MiB of inline data buffers now go in frames."""
    pid = host.worker_pids()[0]
    d = cpu_devices()[0]
    xs = [put(np.full(SMALL, i, np.float32), d) for i in range(MANY)]
    f = jaxcolo.colocated_python(_bump_all).specialize(
        out_specs_fn=lambda xs: xs)
    with jaxcolo.use_executor(host):
        out = f(xs)
    assert len(out) == MANY
    for i in (0, 1, MANY // 2, MANY - 1):
        np.testing.assert_array_equal(np.asarray(out[i]),
                                      np.full(SMALL, i + 1, np.float32))
        assert out[i].sharding == xs[i].sharding
    assert host.worker_pids()[0] == pid


class _Huge(Exception):
    pass


def _raise_huge(x):
    raise _Huge("x" * (40 << 20))


def _raise_huge_pickle(x):
    raise _Huge(np.zeros(80 << 20, np.uint8))  # pickles to > 64 MiB


def test_a_huge_exception_fails_only_its_call(host):
    """A 40 MB exception message made an error reply over the frame limit
    and ended the session; now its text is clipped (and a too-large
    pickled exception is left out), the type is kept."""
    pid = host.worker_pids()[0]
    x = put(np.float32(1), cpu_devices()[0])
    with jaxcolo.use_executor(host):
        f = jaxcolo.colocated_python(_raise_huge).specialize(
            out_specs_fn=lambda x: x)
        with pytest.raises(_Huge) as info:
            f(x)
        text = str(info.value)
        assert len(text) < 2 << 20 and "characters left out" in text
        g = jaxcolo.colocated_python(_raise_huge_pickle).specialize(
            out_specs_fn=lambda x: x)
        with pytest.raises(_Huge):
            g(x)
    assert ok_call(host) == 42
    assert host.worker_pids()[0] == pid


def test_an_oversized_frame_is_refused_whole_and_the_channel_goes_on():
    """A frame over the limit raises FrameTooLarge before a byte is sent
    (the worker turns that into a failed call), and the connection stays
    usable."""
    from tests.test_process_adversarial import _channel_pair
    ch, peer, keep = _channel_pair()
    try:
        with pytest.raises(FrameTooLarge, match="64 MiB frame limit"):
            ch.send_frames([b"head", memoryview(bytes(MAX_FRAME + 1))])
        with pytest.raises(FrameTooLarge):
            ch.send(bytes(MAX_FRAME + 1))
        ch.send(b"after")
        assert peer.poll(10) and peer.recv_bytes() == b"after"
    finally:
        ch.close()
        peer.close()
        keep.close()


def _big_then_deleted(x):
    big = jnp.zeros((1 << 20,), jnp.float32) + x
    gone = x + 1
    gone.delete()
    return big, gone


def _leased(ex):
    """Shared-memory leases outstanding (controller's, worker's)."""
    deadline = time.monotonic() + 20
    while True:
        gc.collect()
        mine = ex._links[0].pool.stats()["leased"]
        theirs = ex.stats()["hosts"][0].get("leased")
        if (mine, theirs) == (0, 0) or time.monotonic() > deadline:
            return mine, theirs
        time.sleep(0.1)


def test_packing_failures_give_leases_back(host):
    """A call whose later argument cannot be packed, and a reply whose
    later output cannot, kept the shared memory of the earlier (large)
    ones leased until close."""
    if host._links[0].pool is None:
        pytest.skip("no shared memory here")
    d = cpu_devices()[0]
    big = put(np.ones(1 << 20, np.float32), d)
    with jaxcolo.use_executor(host):
        f = jaxcolo.colocated_python(lambda a, b: a).specialize(
            out_specs_fn=lambda a, b: a)
        for _ in range(3):
            gone = put(np.float32(2), d)
            gone.delete()
            with pytest.raises(RuntimeError, match="deleted"):
                f(big, gone)
        g = jaxcolo.colocated_python(_big_then_deleted).specialize(
            out_specs_fn=lambda x: (
                jax.ShapeDtypeStruct((1 << 20,), np.float32,
                                     sharding=x.sharding), x))
        for _ in range(3):
            with pytest.raises(RuntimeError, match="deleted"):
                g(put(np.float32(1), d))
        assert float(f(big, big)[0]) == 1.0
    assert _leased(host) == (0, 0)
    stats = host.stats()["hosts"][0]
    assert stats["segments"] <= 3, stats


def test_a_passed_through_input_gives_its_shared_memory_back(host):
    """An output that is the function's own (shared-memory) input held the
    controller's lease until the worker happened to run a full garbage
    collection (reading it back made a reference cycle, and the reader kept
    the last call's inputs): a loop of such calls pinned a segment each."""
    if host._links[0].pool is None:
        pytest.skip("no shared memory here")
    pool = host._links[0].pool
    d = cpu_devices()[0]
    f = jaxcolo.colocated_python(lambda a, b: a).specialize(
        out_specs_fn=lambda a, b: a)
    with jaxcolo.use_executor(host):
        for i in range(4):
            big = put(np.full(1 << 20, i, np.float32), d)
            assert float(f(big, big)[-1]) == i
            deadline = time.monotonic() + 10
            while pool.stats()["leased"] and time.monotonic() < deadline:
                time.sleep(0.02)  # no message to the worker meanwhile
            assert pool.stats()["leased"] == 0
    assert pool.stats()["segments"] <= 3


def _resident(ex) -> tuple[int, int]:
    """Bytes of shared-memory pages held now: (controller's, worker's)."""
    st = ex.stats()
    return (st["controller_segments"][0].get("resident_bytes", 0),
            st["hosts"][0].get("resident_bytes", 0))


def _wait_resident(ex, most: int) -> tuple[int, int]:
    """_resident once both sides hold at most ``most`` bytes (or after
    20 s): releases travel after the arrays are collected."""
    deadline = time.monotonic() + 20
    while True:
        gc.collect()
        got = _resident(ex)
        if max(got) <= most or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_idle_shared_memory_is_given_back_past_retain():
    """A session kept every segment's pages until close: one 48 MiB call
    pinned 48 MiB of /dev/shm on each side for the rest of the session.
    Past ``shm_retain`` the idle segments' pages are freed (measured: the
    files' allocated blocks), and later calls still work."""
    n = 12 << 20  # float32s: 48 MiB
    d = cpu_devices()[0]
    f = jaxcolo.colocated_python(lambda x: x + 1).specialize(
        out_specs_fn=lambda x: x)
    with jaxcolo.ProcessExecutor(num_hosts=1, shm_retain=1 << 20) as ex, \
            jaxcolo.use_executor(ex):
        if ex._links[0].pool is None:
            pytest.skip("no shared memory here")
        for i in range(2):
            out = f(put(np.full(n, i, np.float32), d))
            held = _resident(ex)  # the output still aliases the worker's
            assert held[1] >= 4 * n, held
            assert float(out[0]) == i + 1 and float(out[-1]) == i + 1
            del out
            assert _wait_resident(ex, 1 << 20) <= (1 << 20, 1 << 20)
    with pytest.raises(ValueError, match="shm_retain"):
        jaxcolo.ProcessExecutor(num_hosts=1, shm_retain=-1)


def test_idle_shared_memory_stays_warm_within_retain(host):
    """Under the default budget an idle segment keeps its pages (the next
    call of that size writes into warm memory)."""
    if host._links[0].pool is None:
        pytest.skip("no shared memory here")
    n = 1 << 20  # float32s: 4 MiB
    d = cpu_devices()[0]
    f = jaxcolo.colocated_python(lambda x: x).specialize(
        out_specs_fn=lambda x: x)
    with jaxcolo.use_executor(host):
        out = f(put(np.ones(n, np.float32), d))
        del out
    assert _leased(host) == (0, 0)
    mine, theirs = _resident(host)
    assert mine >= 4 * n and theirs >= 4 * n, (mine, theirs)


def test_reused_segments_are_read_without_page_faults(host):
    """Every shared-memory buffer once got a fresh mapping, whose page
    tables were filled again on each read: a 16 MiB result cost its 4,096
    pages' worth of page faults on every call (as much time as copying
    it).  A peer's segment is now mapped once, so reading a result from a
    reused segment faults (measured: this process's minor faults) only on
    pages seen the first time.  Some call may still get a fresh segment
    (a lease not back yet on a loaded machine): the best call counts."""
    if host._links[0].pool is None:
        pytest.skip("no shared memory here")
    n = 4 << 20  # float32s: 16 MiB, 4,096 pages
    d = cpu_devices()[0]
    x = put(np.zeros(n, np.float32), d)
    f = jaxcolo.colocated_python(lambda x: x + 1).specialize(
        out_specs_fn=lambda x: x)

    def faults_of_call_and_read() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        out = f(x)
        assert float(np.asarray(out).sum()) == n
        del out
        gc.collect()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    with jaxcolo.use_executor(host):
        for _ in range(3):  # map the segments the results use
            faults_of_call_and_read()
        per_call = [faults_of_call_and_read() for _ in range(6)]
    # (the code before: 257 on every call -- 16 pages per read fault)
    assert min(per_call) < 64, per_call


def _worker_leases_back(ex, seconds: float) -> tuple:
    """(controller's, worker's) leases outstanding once both are 0 or after
    ``seconds`` -- without collecting garbage here."""
    deadline = time.monotonic() + seconds
    while True:
        mine = ex._links[0].pool.stats()["leased"]
        theirs = ex.stats()["hosts"][0].get("leased")
        if (mine, theirs) == (0, 0) or time.monotonic() > deadline:
            return mine, theirs
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["at_once", "later", "submitted"])
def test_a_dropped_result_gives_its_lease_back_without_a_collection(
        host, how):
    """A result read zero-copy from the worker's shared memory: dropping it
    queued XLA's reference to the view until this process next collected
    garbage, so the worker's segment stayed leased (5 runs in 5, 5 s each)
    in a caller that allocates little -- also a result dropped a while
    after its call, or one of a submitted call (the link's reader then
    waits for messages, not for its idle tick)."""
    if host._links[0].pool is None:
        pytest.skip("no shared memory here")
    x = put(np.zeros(4 << 20, np.float32), cpu_devices()[0])
    f = jaxcolo.colocated_python(lambda x: x + 1).specialize(
        out_specs_fn=lambda x: x)
    with jaxcolo.use_executor(host):
        assert _leased(host) == (0, 0)
        gc.disable()
        try:
            out = f.submit(x).result() if how == "submitted" else f(x)
            assert float(np.asarray(out).sum()) == 4 << 20
            if how == "later":
                time.sleep(1.0)
            del out
            assert _worker_leases_back(host, 5.0) == (0, 0)
        finally:
            gc.enable()


_KEPT: list = []


def _keep(x):
    _KEPT.append(x)  # (in the worker's copy of this module)
    return x + 1


def _let_go(x):
    _KEPT.clear()
    return x


def test_an_input_a_later_call_drops_gives_its_lease_back(host):
    """An input kept by the worker past its call and dropped by a later
    call without shared memory: XLA queued its reference to the view until
    the worker next collected garbage (an idle worker may never), so the
    controller's segment stayed leased."""
    if host._links[0].pool is None:
        pytest.skip("no shared memory here")
    d = cpu_devices()[0]
    x = put(np.zeros(4 << 20, np.float32), d)
    keep = jaxcolo.colocated_python(_keep).specialize(
        out_specs_fn=lambda x: x)
    let_go = jaxcolo.colocated_python(_let_go).specialize(
        out_specs_fn=lambda x: x)
    with jaxcolo.use_executor(host):
        assert _leased(host) == (0, 0)
        out = keep(x)
        del out
        assert host._links[0].pool.stats()["leased"] == 1  # x, kept there
        assert int(let_go(put(np.int32(3), d))) == 3
        assert _worker_leases_back(host, 5.0) == (0, 0)


def _fds(pid: int) -> int:
    import os
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_kept_results_and_queued_calls_keep_open_files_bounded(host):
    """Each result over 64 KiB a caller kept held a shared-memory segment
    of the worker's, open in both processes (two files each side): ~500
    kept results exhausted the usual 1,024 open files (EMFILE, then the
    whole process starved), and queued submits did the same.  A pool has at
    most MAX_SEGMENTS segments (more buffers go in frames) and a receiver
    keeps at most MAX_HELD buffers in place (more are copied out), so open
    files stay bounded; kept results keep their values."""
    import os
    from jaxcolo.transport import blobs
    if host._links[0].pool is None:
        pytest.skip("no shared memory here")
    wpid = host.worker_pids()[0]
    d = cpu_devices()[0]
    f = jaxcolo.colocated_python(lambda x: x * 2).specialize(
        out_specs_fn=lambda x: x)
    n = 32 * 1024  # float32s: 128 KiB
    bound = 3 * blobs.MAX_SEGMENTS + 16
    with jaxcolo.use_executor(host):
        f(put(np.zeros(n, np.float32), d))
        mine, theirs = _fds(os.getpid()), _fds(wpid)
        kept = [f(put(np.full(n, i, np.float32), d)) for i in range(300)]
        assert _fds(os.getpid()) - mine <= bound
        assert _fds(wpid) - theirs <= bound
        futures = [f.submit(put(np.full(n, i, np.float32), d))
                   for i in range(300)]
        done = [u.result(timeout=120) for u in futures]
        assert _fds(os.getpid()) - mine <= bound
        assert _fds(wpid) - theirs <= bound
        for i, (a, b) in enumerate(zip(kept, done)):
            assert float(a[0]) == float(a[-1]) == 2 * i
            assert float(b[0]) == float(b[-1]) == 2 * i
        del kept, done, futures
        gc.collect()
        assert float(f(put(np.full(n, 7, np.float32), d))[-1]) == 14
    stats = host.stats()
    assert stats["hosts"][0]["segments"] <= blobs.MAX_SEGMENTS
    assert stats["controller_segments"][0]["segments"] <= blobs.MAX_SEGMENTS
