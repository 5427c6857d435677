"""The per-function cache of specialisations, one per input signature.

Two dicts reach the same entries (as in ``jax.experimental.colocated_python``):

* the *fast* cache is keyed on the pytree structure, the array types and
  the ``id()`` of each argument's aval (shape, dtype, weak type: JAX interns
  avals, so equal arrays share one) and sharding: cheap to hash, and hit by
  every call that reuses the same sharding objects;
* the *slow* cache is keyed on the full specs (sharding equality), consulted
  on a fast miss.  A slow hit re-points the entry's single fast key at the
  new sharding objects (LRU(1) per entry); the entry holds those objects, so
  an id in a fast key can never be reused by another object while the key is
  live.

Creation is single-flight (like the cache entries of JAX's old C++ pmap
dispatch): when several threads miss on the same signature at once, one
creates the entry and the others wait and share its value or its error.  A
failed creation is forgotten once its waiters have the error, so a later call
retries.

Every cache is registered (weakly) with JAX's cache management, so
``jax.clear_caches()`` empties it, as it does the caches of JAX's own
colocated functions; the next call of a signature specialises it again.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Sequence

from jax._src.array import ArrayImpl as _ArrayImpl
from jax.extend.backend import register_backend_cache


def fast_key(treedef, leaves: Sequence[Any]):
    """The fast cache key of a call, or None if a leaf is no jax.Array.

    A plain jax.Array (ArrayImpl) stores its aval and sharding, so the key
    holds their ids (the entry keeps both objects alive).  Other arrays
    (PRNG key arrays) may make a new sharding object at every access: their
    part of the key is the values themselves (hashed; compared by
    equality)."""
    key = [treedef]
    append = key.append
    try:
        for x in leaves:
            t = type(x)
            append(t)
            if t is _ArrayImpl:
                append(id(x.aval))
                append(id(x.sharding))
            else:
                append(x.aval)
                append(x.sharding)
    except AttributeError:
        return None
    return tuple(key)


class _Flight:
    __slots__ = ("done", "value", "error", "fast", "keepalive")

    def __init__(self):
        self.done = threading.Event()
        self.value = self.error = None
        self.fast = None        # the entry's current fast key
        self.keepalive = None   # the avals and shardings whose ids it holds


class SignatureCache:
    """Entries by input signature; see the module docstring."""

    def __init__(self):
        self._fast: dict = {}
        self._slow: dict = {}
        self._lock = threading.Lock()
        self.misses = 0  # entries created (for tests and stats)
        _ALL.add(self)

    def get_fast(self, key):
        flight = self._fast.get(key)
        return None if flight is None else flight.value

    def get(self, key, leaves: Sequence[Any], slow_key: Callable[[], Any],
            create: Callable[[Any], Any]):
        """The entry for a call whose fast key missed (``key`` may be None).

        ``slow_key()`` computes the equality key (and raises for bad
        arguments); ``create(slow_key)`` makes the entry, once.
        """
        skey = slow_key()
        with self._lock:
            flight = self._slow.get(skey)
            owner = flight is None
            if owner:
                flight = self._slow[skey] = _Flight()
        if owner:
            try:
                value = create(skey)
            except BaseException as e:
                flight.error = e
                with self._lock:  # (a cache_clear may have dropped it, and
                    if self._slow.get(skey) is flight:  # another flight
                        del self._slow[skey]            # taken its place)
                flight.done.set()
                raise
            flight.value = value
            with self._lock:
                self.misses += 1
                if self._slow.get(skey) is flight:  # not cleared meanwhile
                    self._point(flight, key, leaves)
            flight.done.set()
            return value
        flight.done.wait()
        if flight.error is not None:
            raise flight.error
        if key is not None and flight.fast != key:
            with self._lock:
                if self._slow.get(skey) is flight:
                    self._point(flight, key, leaves)
        return flight.value

    def _point(self, flight: _Flight, key, leaves) -> None:
        if key is None or flight.value is None:
            return
        if flight.fast is not None and self._fast.get(flight.fast) is flight:
            del self._fast[flight.fast]
        flight.fast = key
        flight.keepalive = tuple((x.aval, x.sharding) for x in leaves)
        self._fast[key] = flight

    def values(self) -> list:
        with self._lock:
            return [f.value for f in self._slow.values()
                    if f.value is not None]

    on_clear = None  # also emptied by clear() (e.g. pinned specialisations)

    def clear(self) -> None:
        with self._lock:
            self._fast.clear()
            self._slow.clear()
        if self.on_clear is not None:
            self.on_clear()

    def cache_keys(self) -> list:
        with self._lock:
            return list(self._slow)


class _AllCaches:
    """Every SignatureCache, registered with JAX as one cache: JAX's own
    registry is a WeakKeyDictionary that ``jax.clear_caches()`` iterates
    without a lock, so one registration per function made it raise
    "dictionary changed size during iteration" whenever another thread
    made a colocated function meanwhile."""

    def __init__(self):
        self._lock = threading.Lock()
        self._caches: "weakref.WeakSet[SignatureCache]" = weakref.WeakSet()

    def add(self, cache: SignatureCache) -> None:
        with self._lock:
            self._caches.add(cache)

    def cache_clear(self) -> None:
        with self._lock:
            caches = list(self._caches)
        for cache in caches:
            cache.clear()

    def cache_keys(self) -> list:
        with self._lock:
            caches = list(self._caches)
        return [k for c in caches for k in c.cache_keys()]


_ALL = _AllCaches()
register_backend_cache(_ALL, "jaxcolo colocated specialisations")
