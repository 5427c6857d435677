"""Whether a worker process may run multi-host calls, across the
controllers it serves one after another.

A multi-host call's parts meet in collectives.  When a controller's session
ends (it closed, or was lost) while this host still runs such a call, or
holds after one failed here (its resume never came), the other hosts may
wait in a collective this host never joins, or this host in one they never
join: a later controller's collectives would pair with those (wrong results,
or a hang).  So this process refuses multi-host calls with
:class:`jaxcolo.errors.HostWedgedError`:

* for good, after a session ended holding a failed multi-host call, or after
  a multi-host call of an ended session failed;
* while a multi-host call of an ended session still runs (it may wait in a
  collective for hosts that gave up); once all of them returned, the hosts
  met in their collectives and it serves again.

Single-host calls run, except those on more than one device while a
multi-host call of an ended session still runs here: XLA runs no other
multi-device program on this host while one waits in a collective, so they
would wait with it (for ever, if it never returns); they are refused too,
until it returns.  Local workers end with their executor; this matters for
workers started with ``jaxcolo worker``.
"""

from __future__ import annotations

import threading


class Wedge:
    """The process's state (one per worker process: :data:`WEDGE`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._orphans: set = set()   # (session, call_id) still running
        self._reason: str | None = None  # for good

    def reason(self) -> str | None:
        """Why multi-host calls are refused now, or None."""
        with self._lock:
            if self._reason is not None:
                return self._reason
            if self._orphans:
                return ("a multi-host call of a controller served before "
                        "still runs here (it may wait in a collective for "
                        "hosts that gave up)")
            return None

    def orphans_running(self) -> bool:
        """Whether a multi-host call of an ended session still runs."""
        return bool(self._orphans)

    def session_ended(self, session, running, holding: bool) -> None:
        """``session`` ended with multi-host calls ``running`` (ids) and,
        if ``holding``, a failed one whose resume never came."""
        with self._lock:
            self._orphans.update((session, cid) for cid in running)
            if holding and self._reason is None:
                self._reason = ("a multi-host call failed here and its "
                                "controller ended before every host was "
                                "done with it")

    def finished(self, session, call_id, failed: bool) -> None:
        """A multi-host call of ``session`` returned (an orphan if its
        session had ended)."""
        with self._lock:
            if (session, call_id) not in self._orphans:
                return
            self._orphans.discard((session, call_id))
            if failed and self._reason is None:
                self._reason = ("a multi-host call of a controller served "
                                "before failed here after it ended")


WEDGE = Wedge()
