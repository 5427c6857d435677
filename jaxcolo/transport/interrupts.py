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


def install():
    """Route SIGINT through the deferring handler; returns a token for
    ``uninstall`` (None when nothing was done: outside the main thread,
    when SIGINT has no Python-level handler (ignored, or the OS default),
    or when ours is installed already)."""
    if _thread.get_ident() != _MAIN:
        return None
    with _lock:
        current = signal.getsignal(signal.SIGINT)
        if current is _handler or not callable(current):
            return None
        token = (current, _state.previous)
        _state.previous = current
        signal.signal(signal.SIGINT, _handler)
        return token


def uninstall(token) -> None:
    """Undo the ``install`` that returned ``token``: put back the handler
    it replaced, if ours is still the installed one (else the user's
    replacement stays), from the main thread (else ours stays, delegating
    every signal at once while no section runs)."""
    if token is None or _thread.get_ident() != _MAIN:
        return
    replaced, outer = token
    with _lock:
        if signal.getsignal(signal.SIGINT) is _handler:
            signal.signal(signal.SIGINT, replaced)
        _state.previous = outer
