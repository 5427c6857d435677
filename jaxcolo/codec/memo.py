"""Bounded memos for repeated spec payloads.

Colocated programs encode and decode the same specs over and over (the input
and output specs of every call of a program).  Two small LRU memos make a
repeat cheap without changing any result:

* ``DecodeMemo``: decoded payload bytes -> (PyTreeDef, leaves).  A hit returns
  ``treedef.unflatten(leaves)``, so containers are fresh on every call and only
  immutable spec objects (shardings, ShapeDtypeStructs, ...) are shared --
  and custom nodes' auxdata, as by any two unflattens of one JAX treedef
  (auxdata is meant to be immutable).  Only
  payloads decoded with the default device resolver and without symbolic
  scopes are kept (a custom resolver may map ids differently next time, and
  symbolic dims must bind to the scope that is live at decode time), and a
  hit counts only while the pytree registries and the classes the decode
  found by name are the same (a namedtuple redefined by a re-run notebook
  cell is found anew).
* ``EncodeMemo``: (version, PyTreeDef with the pytree registries'
  generation, the leaves' identities, the context mesh) -> payload.  The
  memo holds the leaves themselves, so an identity can't be reused by
  another object while its entry lives; the context mesh (``jax.set_mesh``)
  is in the key because a ShapeDtypeStruct made with a bare PartitionSpec
  resolves its sharding against it.  Payloads with symbolic dims are not
  kept: encoding one notes its scopes as the latest of their constraints,
  which readers of tokenless scopes go by.

Both are bounded -- entries, and bytes: a payload is memoized only if it
and its flatbuffer body (inflated: what an entry holds grows with the body,
and a small deflated payload can hold a large body) are at most
``MAX_PAYLOAD``, and each memo keeps at most ``MAX_BYTES`` of payload, body
and per-leaf charges -- and thread safe; ``clear()`` empties them,
``set_enabled(False)`` turns them off (benchmarks use this to measure the
codec itself).
"""

from __future__ import annotations

import collections
import threading

from jax._src import mesh as jmesh

from jaxcolo import versions

MAX_ENTRIES = 512
MAX_PAYLOAD = 64 * 1024  # larger payloads (or bodies) are not memoized
MAX_BYTES = 4 * 1024 * 1024  # per memo: payloads, bodies, LEAF_BYTES each
LEAF_BYTES = 64  # charged per leaf an entry holds (its key's id, the leaf)

_enabled = True


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = bool(on)
    if not on:
        clear()


def enabled() -> bool:
    return _enabled


class _LRU:
    """Least recently used entries, at most ``max_entries`` of them and
    ``max_bytes`` of their stated sizes."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self.entries: collections.OrderedDict = collections.OrderedDict()
        self.lock = threading.Lock()

    def get(self, key):
        with self.lock:
            hit = self.entries.get(key)
            if hit is not None:
                self.entries.move_to_end(key)
                return hit[0]
            return None

    def put(self, key, value, size: int) -> None:
        with self.lock:
            old = self.entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self.entries[key] = (value, size)
            self.bytes += size
            while len(self.entries) > self.max_entries or \
                    self.bytes > self.max_bytes:
                self.bytes -= self.entries.popitem(last=False)[1][1]

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.bytes = 0


DECODED = _LRU(MAX_ENTRIES, MAX_BYTES)
ENCODED = _LRU(MAX_ENTRIES, MAX_BYTES)


def clear() -> None:
    DECODED.clear()
    ENCODED.clear()


def _charge(data, body_size: int, leaves) -> int:
    """The bytes an entry counts against ``MAX_BYTES``."""
    return len(data) + body_size + LEAF_BYTES * len(leaves)


def lookup_decoded(data):
    """What ``remember_decoded`` kept for payload ``data``, or None (also
    while versions.noting_used: the body must be read to be noted)."""
    if not _enabled or len(data) > MAX_PAYLOAD or versions.noting():
        return None
    return DECODED.get(bytes(data))


def remember_decoded(data, body_size: int, entry) -> None:
    """Memoize the decode of ``data`` (whose flatbuffer body, inflated, is
    ``body_size`` bytes) as ``entry``: (treedef, leaves, ...) -- the caller
    decides on a hit whether the rest still holds."""
    if _enabled and len(data) <= MAX_PAYLOAD and body_size <= MAX_PAYLOAD:
        entry = (entry[0], tuple(entry[1]), *entry[2:])
        DECODED.put(bytes(data), entry, _charge(data, body_size, entry[1]))


def encode_key(version, treedef_key, leaves):
    """Key of an encode: ``treedef_key`` (pytree.treedef_key: the treedef
    and its repr, since equal treedefs may differ in key types), the
    leaves' identities and the context mesh."""
    if not _enabled:
        return None
    return (version, treedef_key, tuple(map(id, leaves)),
            jmesh.get_concrete_mesh())


def lookup_encoded(key, leaves):
    if key is None:
        return None
    hit = ENCODED.get(key)
    if hit is None:
        return None
    kept, data = hit
    for a, b in zip(kept, leaves):  # ids match; make sure objects do too
        if a is not b:
            return None
    return data


def remember_encoded(key, leaves, data, body_size: int) -> None:
    """Memoize the encode of ``leaves`` (key ``key``) as ``data``, whose
    flatbuffer body is ``body_size`` bytes before deflating."""
    if key is not None and len(data) <= MAX_PAYLOAD and \
            body_size <= MAX_PAYLOAD:
        ENCODED.put(key, (tuple(leaves), data),
                    _charge(data, body_size, leaves))
