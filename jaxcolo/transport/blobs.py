"""Shared-memory segments for array bytes between processes on one machine.

Each side of a connection sends large buffers in segments it owns
(:class:`SegmentPool`): files under ``/dev/shm`` that it creates, maps and
reuses, at most MAX_SEGMENTS of them.  A segment is *leased* for one buffer;
the receiver maps the segment (``peer_segments.SegmentMaps``: once, at its
first announcement in a message), reads the buffer in place -- JAX on CPU may alias
the mapping, with no copy -- and sends the lease id back when the buffer's
own owner object is collected (JAX keeps it alive, through the numpy array
it aliases, while it uses the bytes), so the sender reuses the segment (warm
pages on both sides: no page faults on the next call).  A receiver keeps at
most ``peer_segments.MAX_HELD`` buffers in place; more still in use are copied out and their
leases given back, so kept arrays do not pin segments (and open files).
Idle segments keep their pages only up to a budget (``retain`` bytes per
pool, least recently used dropped first): past it a segment's pages are
freed (the file is cut to nothing and grown back, sparse), and its next
lease allocates them again.  The segment itself, its name and the peer's
open file and mapping stay as they are, so this needs nothing from the
peer: a released lease has no user left on the receiving side (see
``peer_segments.SegmentMaps``), and cutting the file drops the peer's page tables
for it too.

Files are unlinked as soon as the receiver has mapped them (at the first
release of a segment), and in any case when the pool closes; a controller
also unlinks the announced segments of a worker it lost.  Plain files and
``mmap`` are used rather than ``multiprocessing.shared_memory``: no
resource_tracker process, and numpy/JAX own the mapping's lifetime (the
mapping lives while any array over it does, even after the file is gone).

Nothing here is specific to JAX; buffers are numpy uint8 views.
"""

from __future__ import annotations

import itertools
import mmap
import os
import queue
import secrets
import stat
import threading

import numpy as np


SHM_DIR = "/dev/shm"
MIN_SEGMENT = 1 << 20
DEFAULT_RETAIN = 256 << 20  # bytes of pages idle segments keep, per pool
# Each segment costs open files on both sides (the owner's file and
# mapping, the peer's mapping): a pool has at most this many segments (more
# buffers leased at once go in frames); a receiver bounds the buffers it
# keeps in place (``peer_segments.MAX_HELD``), so open files stay bounded
# however many arrays are kept or calls queued.
MAX_SEGMENTS = 32


class PoolFull(Exception):
    """Every segment a pool may have is leased (the buffer goes in
    frames)."""


def _size_class(n: int) -> int:
    return max(MIN_SEGMENT, 1 << (max(n, 1) - 1).bit_length())


def check_retain(value, what: str) -> int:
    """``value`` if it is a byte count (an int >= 0), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an int >= 0 (bytes of shared "
                         f"memory idle segments keep), got {value!r}")
    return value


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def unlink(name: str) -> None:
    """Remove a segment file (no error if it is already gone, or if it
    cannot be removed: /dev/shm is writable by every local user, so a
    name may be a directory or another user's file)."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except OSError:
        pass


class _Segment:
    """A segment file, mapped, and its fd (kept to reserve pages: a tmpfs
    file is sparse, and writing into a mapping of it when /dev/shm is full
    is a SIGBUS, not an error; ``reserve`` makes that an OSError)."""

    __slots__ = ("id", "name", "size", "mm", "view", "linked", "announced",
                 "fd", "reserved")

    def __init__(self, sid: int, name: str, size: int):
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            os.close(fd)
            raise
        self.fd = fd
        self.reserved = 0  # bytes from the start whose pages are allocated
        self.id = sid
        self.name = name
        self.size = size
        self.view = np.frombuffer(self.mm, np.uint8)
        self.linked = True
        self.announced = False

    def reserve(self, n: int) -> None:
        """Allocate the pages of the first ``n`` bytes (OSError, e.g.
        ENOSPC, when /dev/shm has no room)."""
        if n > self.reserved:
            os.posix_fallocate(self.fd, 0, n)
            self.reserved = n

    def free_pages(self) -> None:
        """Give the segment's pages back to the system; its size, its
        mappings and the peer's open file stay valid (reading a page that
        is gone reads zeros; writes follow ``reserve``)."""
        if self.reserved and self.fd >= 0:
            os.ftruncate(self.fd, 0)
            os.ftruncate(self.fd, self.size)
        self.reserved = 0

    def resident_bytes(self) -> int:
        """Bytes of pages the segment's file holds (what /dev/shm counts)."""
        if self.fd < 0:
            return 0
        return os.fstat(self.fd).st_blocks * 512

    def discard(self) -> None:
        """Close the file (the mapping lives while arrays use it)."""
        if self.linked:
            unlink(self.name)
            self.linked = False
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Lease:
    """One buffer's space in a segment: write into ``view`` (``size``
    bytes), send ``segment``/``lease`` ids, and ``announce`` (id, name,
    size) if not None (the segment's first use)."""

    __slots__ = ("id", "segment", "view", "announce")

    def __init__(self, lid, seg, size, announce):
        self.id = lid
        self.segment = seg.id
        self.view = seg.view[:size]
        self.announce = announce


class SegmentPool:
    """The segments this side writes into (see the module docstring)."""

    def __init__(self, tag: str = "x", retain: int = DEFAULT_RETAIN,
                 max_segments: int = MAX_SEGMENTS):
        """``retain``: bytes of pages the idle segments may keep (>= 0);
        ``max_segments``: how many segments the pool may have."""
        self.prefix = f"jaxcolo-{os.getpid()}-{secrets.token_hex(6)}-{tag}"
        self.retain = check_retain(retain, "retain")
        self.max_segments = max_segments
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._segments: dict[int, _Segment] = {}
        self._idle: dict[int, list] = {}      # size class -> idle segments
        self._idle_order: dict[int, _Segment] = {}  # id -> seg, LRU first
        self._idle_reserved = 0  # bytes reserved by idle segments
        self._leases: dict[int, _Segment] = {}
        self._closed = False

    def lease(self, size: int) -> Lease:
        """Space for ``size`` bytes: an idle segment of its size class, else
        a new segment; at ``max_segments``, the least recently used idle
        segment replaced by one of this size class (the same id, a new
        file: announcing it replaces the peer's), else PoolFull."""
        cls = _size_class(size)
        with self._lock:
            if self._closed:
                raise RuntimeError("segment pool is closed")
            idle = self._idle.get(cls)
            seg = idle.pop() if idle else None
            if seg is not None:
                del self._idle_order[seg.id]
                self._idle_reserved -= seg.reserved
            elif len(self._segments) < self.max_segments:
                sid = next(self._ids)
                seg = _Segment(sid, f"{self.prefix}-{sid}", cls)
                self._segments[sid] = seg
            else:
                seg = self._replace_idle(cls)
            try:
                seg.reserve(size)  # only the pages this buffer uses
            except OSError:
                if seg.announced:  # the peer knows it: keep it for later
                    self._make_idle(seg)
                else:
                    self._segments.pop(seg.id, None)
                    seg.discard()
                raise
            lid = next(self._ids)
            self._leases[lid] = seg
            announce = None
            if not seg.announced:
                seg.announced = True
                announce = (seg.id, seg.name, seg.size)
            return Lease(lid, seg, size, announce)

    def _replace_idle(self, cls: int) -> _Segment:
        """(Under the lock.)  A new segment of size ``cls`` in place of the
        least recently used idle one (PoolFull if none is idle)."""
        old = next(iter(self._idle_order.values()), None)
        if old is None:
            raise PoolFull(f"all {len(self._segments)} shared-memory "
                           "segments are leased")
        del self._idle_order[old.id]
        self._idle[old.size].remove(old)
        self._idle_reserved -= old.reserved
        del self._segments[old.id]
        old.discard()
        seg = _Segment(old.id, f"{self.prefix}-{next(self._ids)}", cls)
        self._segments[old.id] = seg
        return seg

    def release(self, lease_ids) -> int:
        """Return leases (ids from the peer); unknown ids are ignored.
        Returns how many were known."""
        with self._lock:
            return sum(self._take_back(lid, False) for lid in lease_ids)

    def abandon(self, leases) -> None:
        """Take back leases (Lease objects) whose message was never sent:
        a segment announced by one of them is still unknown to the peer,
        so it keeps its name and is announced again at its next use."""
        with self._lock:
            for lease in leases:
                self._take_back(lease.id, lease.announce is not None)

    def _take_back(self, lid, unannounced: bool) -> bool:
        """(Under the lock.)  Lease ``lid``'s segment becomes idle; False
        if the lease is unknown."""
        seg = self._leases.pop(lid, None)
        if seg is None:
            return False
        if unannounced:
            seg.announced = False
        elif seg.linked:  # the peer has mapped it: the name can go
            unlink(seg.name)
            seg.linked = False
        self._make_idle(seg)
        return True

    def _make_idle(self, seg: _Segment) -> None:
        """(Under the lock.)  ``seg`` joins the idle segments; past the
        ``retain`` budget the least recently used ones lose their pages."""
        if seg.reserved > self.retain:  # alone past the budget: it goes,
            self._free_pages(seg)       # not the others' warm pages
        self._idle.setdefault(seg.size, []).append(seg)
        self._idle_order[seg.id] = seg
        self._idle_reserved += seg.reserved
        if self._idle_reserved <= self.retain:
            return
        for old in list(self._idle_order.values()):
            if old.reserved:
                self._idle_reserved -= old.reserved
                self._free_pages(old)
                if self._idle_reserved <= self.retain:
                    return

    @staticmethod
    def _free_pages(seg: _Segment) -> None:
        try:
            seg.free_pages()
        except OSError:  # keeps its pages; counted as free anyway
            seg.reserved = 0

    def stats(self) -> dict:
        """``segments``/``segment_bytes``: how many and how large;
        ``resident_bytes``: the pages their files hold now (measured);
        ``leased``: leases the peer has not released."""
        with self._lock:
            return {"segments": len(self._segments),
                    "segment_bytes": sum(s.size for s in
                                         self._segments.values()),
                    "resident_bytes": sum(s.resident_bytes() for s in
                                          self._segments.values()),
                    "leased": len(self._leases)}

    def close(self) -> None:
        """Unlink every file (mappings live on while arrays use them)."""
        with self._lock:
            self._closed = True
            for seg in self._segments.values():
                seg.discard()
            self._segments.clear()
            self._idle.clear()
            self._idle_order.clear()
            self._idle_reserved = 0
            self._leases.clear()


def unlink_process_segments(pid: int) -> None:
    """Remove every segment file a (lost) process ``pid`` of this machine
    created: SegmentPool names start with ``jaxcolo-<pid>-``."""
    unlink_prefixed(f"jaxcolo-{int(pid)}-")


def unlink_prefixed(prefix: str) -> None:
    """Remove this user's segment files whose names start with ``prefix``."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    uid = os.getuid()
    for name in names:
        if not name.startswith(prefix):
            continue
        try:  # only this user's regular files: never another's, by pid reuse
            st = os.lstat(os.path.join(SHM_DIR, name))
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
            unlink(name)


def probe_segment(token: bytes) -> tuple[str, object]:
    """A small segment holding ``token`` for a peer to read back (does it
    share this machine's /dev/shm?).  Returns (name, cleanup)."""
    name = f"jaxcolo-probe-{os.getpid()}-{secrets.token_hex(8)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, token)
    finally:
        os.close(fd)
    return name, lambda: unlink(name)


def read_probe(name: str, size: int) -> bytes:
    """What a probe segment holds ('' if it cannot be read here)."""
    if "/" in name or not name.startswith("jaxcolo-probe-"):
        return b""
    try:
        with open(os.path.join(SHM_DIR, name), "rb") as f:
            return f.read(size)
    except OSError:
        return b""


def drain_released(released) -> list | None:
    """Block for the next released lease id, then take every one already
    queued: the batch to announce in one release message.  None once the
    queue's ``None`` sentinel (shut down) is seen."""
    lid = released.get()
    if lid is None:
        return None
    ids = [lid]
    while True:
        try:
            more = released.get_nowait()
        except queue.Empty:
            return ids
        if more is None:
            return None
        ids.append(more)
