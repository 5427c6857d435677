"""Checks of ProcessExecutor's constructor arguments.

Each function returns the value to use or raises ValueError/TypeError
naming the argument; none of them starts or connects anything.
"""

from __future__ import annotations

import math
import numbers

# A worker is lost after lost_timeout without a message: at least this many
# heartbeat periods, or a worker that is merely idle would be taken for lost.
HEARTBEATS_PER_LOST = 3


def check_seconds(value, what: str) -> float:
    """A finite number of seconds > 0 (ValueError otherwise: None or inf
    would stop a watchdog, not turn a limit off)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            not 0 < value < math.inf:
        raise ValueError(f"{what} must be a finite number of seconds > 0, "
                         f"got {value!r}")
    return float(value)


def heartbeat_period(heartbeat, lost_timeout: float) -> float:
    """The heartbeat period: ``heartbeat`` seconds (ValueError unless
    ``lost_timeout`` spans HEARTBEATS_PER_LOST of them), or by default 1 s,
    or a quarter of a shorter ``lost_timeout``."""
    if heartbeat is None:
        return min(1.0, lost_timeout / 4)
    heartbeat = check_seconds(heartbeat, "heartbeat")
    if lost_timeout < HEARTBEATS_PER_LOST * heartbeat:
        raise ValueError(
            f"lost_timeout ({lost_timeout}s) must be at least "
            f"{HEARTBEATS_PER_LOST}x heartbeat ({heartbeat}s): an idle "
            "worker is silent between heartbeats and would be taken for lost")
    return heartbeat


def check_hosts(num_hosts, addresses, authkey) -> list | None:
    """Exactly one of ``num_hosts`` (start workers) and ``addresses``
    (running workers, which need ``authkey``); ``authkey`` bytes or None.
    Returns the addresses as a list (None with ``num_hosts``)."""
    if (num_hosts is None) == (addresses is None):
        raise ValueError("give either num_hosts (start workers) or "
                         "addresses (connect to running workers)")
    if authkey is not None and not isinstance(authkey, bytes):
        raise TypeError(f"authkey must be bytes, not "
                        f"{type(authkey).__name__}")
    if addresses is None:
        return None
    if isinstance(addresses, (str, bytes)):
        raise TypeError("addresses must be a list of 'HOST:PORT' (or "
                        "'unix:PATH') strings, one per running "
                        f"worker, not a {type(addresses).__name__}")
    addresses = list(addresses)
    if not addresses:
        raise ValueError("addresses is empty: give one 'HOST:PORT' "
                         "per running worker")
    if not authkey:
        raise ValueError("connecting to running workers needs authkey")
    return addresses


def id_ranges(ids) -> str:
    """Sorted ints as "0-3, 6, 8-9"."""
    parts, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            parts.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(parts)
