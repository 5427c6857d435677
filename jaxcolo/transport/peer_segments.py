"""The receiving side of shared-memory segments: the peer's segments
(made by its ``blobs.SegmentPool``), mapped at their first announcement, and
the buffers read from them in place, each with an owner object whose
collection gives the lease back."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
import weakref

import numpy as np

from jaxcolo.transport import procs
from jaxcolo.transport.blobs import SHM_DIR, unlink, unlink_prefixed

# A receiver keeps at most MAX_HELD peer buffers in place: more still in
# use (e.g. results a caller keeps) are copied out and their leases given
# back, so the files and mappings both sides hold open stay bounded.
MAX_HELD = 24


class _PeerSegment:
    """An announced segment of the peer: one mapping of all of it, kept for
    every buffer read from it -- its page tables stay filled while the peer
    keeps the pages, so reading a reused segment costs no page faults.
    (The mapping holds the file open; no other descriptor is kept.)"""

    __slots__ = ("size", "mm", "owner_type")

    def __init__(self, mm, size: int):
        self.mm = mm
        self.size = size
        self.owner_type = ctypes.c_ubyte * size

    def file_size(self) -> int:
        """The size of the peer's file now (it may have been cut)."""
        return self.mm.size()

    def owner(self):
        """A new object exporting the whole mapping: a ctypes array, which
        (unlike a numpy view or memoryview) a weakref can follow, and which
        numpy keeps as the base of every view made from it."""
        return self.owner_type.from_buffer(self.mm)


class SegmentMaps:
    """The peer's segments, mapped at their first announcement.

    Each segment is mapped once (:class:`_PeerSegment`), and every buffer
    read from it gets an *owner* object of its own over that mapping
    (:meth:`view`).  JAX on CPU may alias a buffer's memory; it then keeps
    a numpy array over it alive, and with it the array's base -- the owner,
    which numpy never collapses past, while views and aliases all lead to
    it.  So "the buffer is no longer used" is "its owner was collected",
    and the lease goes back only then (reusing the segment earlier
    overwrote arrays still in use).  A new mapping per buffer would say the
    same but fill its page tables again on every read (as costly as
    copying the bytes once more).  At most ``max_held`` buffers are in use
    in place at once; more are copied out, their leases given back at once
    (so the peer's segments, and the files both sides hold open, stay
    bounded however many arrays are kept)."""

    def __init__(self, max_held: int = MAX_HELD):
        self._segments: dict[int, _PeerSegment] = {}
        self.names: dict[int, str] = {}
        self._lock = threading.Lock()
        self.max_held = max_held
        self._held: dict[int, bool] = {}  # ids of the owners in use

    def add(self, sid: int, name: str, size: int) -> None:
        """Map an announced segment, replacing one announced before with
        the same id (OSError if it cannot be opened or mapped)."""
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < size:
                raise OSError(f"segment {name} is smaller than announced")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        with self._lock:  # (a replaced mapping lives while buffers use it)
            self._segments[sid] = _PeerSegment(mm, size)
            self.names[sid] = name

    def view(self, sid: int, offset: int, size: int, on_unused=None):
        """``size`` bytes at ``offset`` of segment ``sid``, with an owner
        of their own (KeyError if the segment was never announced,
        ValueError if out of bounds).  ``on_unused()`` runs once nothing
        uses the bytes any more (no view, array or alias of them is left),
        at once if they were copied out (``max_held`` buffers in use)."""
        with self._lock:
            seg = self._segments[sid]
            if offset < 0 or size < 0 or offset + size > seg.size:
                raise ValueError(f"{offset}+{size} bytes outside segment "
                                 f"{sid} ({seg.size} bytes)")
            # the peer's file may have shrunk since it was announced: its
            # pages past the end would fault with SIGBUS when read
            held = seg.file_size()
            if offset + size > held:
                raise ValueError(f"{offset}+{size} bytes outside segment "
                                 f"{sid}, whose file now holds {held} bytes")
            owner = seg.owner()
            in_place = len(self._held) < self.max_held
            if in_place:  # (dict operations: atomic, in a finalizer too)
                self._held[id(owner)] = True
                weakref.finalize(owner, self._held.pop, id(owner), None)
        if not in_place:
            out = np.frombuffer(owner, np.uint8, size, offset).copy()
            del owner
            if on_unused is not None:
                on_unused()
            return out
        if on_unused is not None:
            weakref.finalize(owner, on_unused)
        return np.frombuffer(owner, np.uint8, size, offset)

    def in_use(self) -> bool:
        """Whether any of the peer's segments is open (buffers may be
        viewed)."""
        return bool(self._segments)

    def unlink_all(self) -> None:
        """Remove the files of every segment seen (the peer is lost)."""
        with self._lock:
            for name in self.names.values():
                unlink(name)

    def unlink_dead_owners(self) -> None:
        """Remove every segment file of the peer pools whose segments were
        seen, when the process that made them is dead: killed, it may have
        made segments it never announced, which nobody else would find.
        (Pool names are ``jaxcolo-<pid>-<token>-<tag>``: the random token
        keeps another process that got the same pid out of it.)"""
        with self._lock:
            names = list(self.names.values())
        pools = set()
        for name in names:
            parts = name.split("-")
            if len(parts) >= 5 and parts[0] == "jaxcolo" and \
                    parts[1].isdigit():
                pools.add((int(parts[1]), "-".join(parts[:4]) + "-"))
        living = []
        for pid, prefix in pools:
            if procs.alive(pid):
                living.append((pid, prefix))
            else:
                unlink_prefixed(prefix)
        if living:  # a killed process's connection may close before it is
            try:    # a zombie: watch it for a while, off this thread
                threading.Thread(target=_unlink_when_dead, args=(living,),
                                 daemon=True,
                                 name="jaxcolo-dead-owner-segments").start()
            except RuntimeError:  # no thread (interpreter exit)
                pass

    def clear(self) -> None:
        """Forget the segments (mappings in use live on; the others are
        closed as they are collected)."""
        with self._lock:
            self._segments.clear()
            self.names.clear()


OWNER_EXIT_WAIT = 5.0  # seconds a peer seen alive at its EOF is watched


def _unlink_when_dead(pools) -> None:
    """Remove the segment files of ``pools`` ((pid, prefix)) whose owner
    dies within OWNER_EXIT_WAIT seconds (one that lives on closed its
    connection on purpose, and removes its own)."""
    end = time.monotonic() + OWNER_EXIT_WAIT
    while pools and time.monotonic() < end:
        time.sleep(0.05)
        for pool in list(pools):
            if not procs.alive(pool[0]):
                unlink_prefixed(pool[1])
                pools.remove(pool)

