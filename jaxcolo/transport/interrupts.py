"""Ctrl-C (SIGINT) is deferred while the main thread is inside a message.

A KeyboardInterrupt is raised in the main thread between any two bytecodes.
Raised between a frame's length and its body, between the frames of one
message, or after a reply was read but before it reached its call, it leaves
the connection out of step (the peer is then declared lost and restarted,
with its state) or a call without its reply.

While a ProcessExecutor is open (``install``), SIGINT goes through a handler
of ours.  Inside ``CRITICAL`` sections of the main thread it only records
the signal, and the section's end delivers it (calls the handler that was
installed before, which raises KeyboardInterrupt as usual).  Outside them it
calls that handler at once, so waiting for a long call stays interruptible.

Sections cost two counter updates; other threads never get a
KeyboardInterrupt and skip them.  ``install`` only works from the main
thread while a Python-level SIGINT handler is installed (the default one or
the user's); otherwise nothing is deferred.  The handler ours replaced
gets the frame the signal arrived in, also when delivered late.
"""

from __future__ import annotations

import _thread
import signal
import threading

_MAIN = threading.main_thread().ident


class _State:
    depth = 0          # nesting of the main thread's critical sections
    pending = None     # (frame,) of a SIGINT that arrived inside a section
    previous = None    # the handler ours delegates to
    installs: list = []  # open installs that replaced a handler, oldest first


_state = _State()
_lock = threading.Lock()


def _deliver(signum: int, frame) -> None:
    previous = _state.previous
    if callable(previous):
        previous(signum, frame)


def _handler(signum: int, frame) -> None:
    if _state.depth:
        _state.pending = (frame,)
        return
    _deliver(signum, frame)


class _Critical:
    """``with CRITICAL:`` -- SIGINT waits for the end of the block."""

    __slots__ = ()

    def __enter__(self):
        if _thread.get_ident() == _MAIN:
            _state.depth += 1

    def __exit__(self, *exc):
        if _thread.get_ident() == _MAIN:
            _state.depth -= 1
            if not _state.depth and _state.pending is not None:
                (frame,), _state.pending = _state.pending, None
                _deliver(signal.SIGINT, frame)
        return False


CRITICAL = _Critical()


class _Install:
    """An install that replaced a handler: what to put back, and how many
    installs made while it was the newest are still open (they rely on
    ours staying in place)."""
    __slots__ = ("replaced", "outer", "nested", "closed")

    def __init__(self, replaced, outer):
        self.replaced = replaced
        self.outer = outer
        self.nested = 0
        self.closed = False


def install():
    """Route SIGINT through the deferring handler; returns a token for
    ``uninstall`` (None when nothing was done: outside the main thread, or
    when SIGINT has no Python-level handler (ignored, or the OS default)).
    An install that finds ours in place counts on the newest one that put
    it there: that one's handler is put back once both are uninstalled."""
    if _thread.get_ident() != _MAIN:
        return None
    with _lock:
        current = signal.getsignal(signal.SIGINT)
        if current is _handler:
            if not _state.installs:
                return None  # put back by hand: nothing of ours to undo
            top = _state.installs[-1]
            top.nested += 1
            return ("nested", top)
        if not callable(current):
            return None
        entry = _Install(current, _state.previous)
        _state.previous = current
        _state.installs.append(entry)
        signal.signal(signal.SIGINT, _handler)
        return entry


def uninstall(token) -> None:
    """Undo the ``install`` that returned ``token``: once it and the
    installs counting on it are all uninstalled, put back the handler it
    replaced if ours is still the installed one (else the user's
    replacement stays), from the main thread (else ours stays, delegating
    every signal at once while no section runs)."""
    if token is None or _thread.get_ident() != _MAIN:
        return
    with _lock:
        if isinstance(token, tuple):
            entry = token[1]
            entry.nested -= 1
        else:
            entry = token
            entry.closed = True
        if not entry.closed or entry.nested:
            return
        installs = _state.installs
        if entry not in installs:
            return
        i = installs.index(entry)
        del installs[i]
        if i < len(installs):  # a newer install is open: it puts back
            installs[i].outer = entry.outer  # what this one would have
            return
        if signal.getsignal(signal.SIGINT) is _handler:
            signal.signal(signal.SIGINT, entry.replaced)
        _state.previous = entry.outer
