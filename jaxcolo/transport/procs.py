"""Facts about other processes of this machine: whether one runs and the
CPU time it used, read from ``/proc/<pid>/stat`` where there is one."""

from __future__ import annotations

import os

try:
    _CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
except (AttributeError, ValueError, OSError):  # pragma: no cover - no sysconf
    _CLOCK_TICKS = 100


def _stat_fields(pid: int) -> list | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (the
    first is the state), or None where they cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped by
    its parent, does not; another user's process does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's
        return True
    fields = _stat_fields(pid)
    return not fields or fields[0] != b"Z"


def cpu_seconds(pid: int) -> float | None:
    """CPU time process ``pid`` has used (all its threads), or None where
    that cannot be read (no /proc, process gone)."""
    fields = _stat_fields(pid)
    try:
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    except (TypeError, ValueError, IndexError):
        return None
