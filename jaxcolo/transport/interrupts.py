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
    open = 0           # installs not yet uninstalled
    replaced: list = []  # tokens of the installs that replaced a handler


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
    ``uninstall`` (None when nothing was done: outside the main thread, or
    when SIGINT has no Python-level handler (ignored, or the OS default)).
    Installs nest: the handler stays ours until every token is uninstalled,
    whatever the order executors close in."""
    if _thread.get_ident() != _MAIN:
        return None
    with _lock:
        current = signal.getsignal(signal.SIGINT)
        if current is _handler:
            _state.open += 1
            return _NESTED
        if not callable(current):
            return None
        token = (current, _state.previous)
        _state.previous = current
        _state.replaced.append(token)
        _state.open += 1
        signal.signal(signal.SIGINT, _handler)
        return token


_NESTED = ("nested",)  # the token of an install that found ours in place


def uninstall(token) -> None:
    """Undo the ``install`` that returned ``token``.  The last one to go
    puts back the handler the first one replaced, if ours is still the
    installed one (else the user's replacement stays), from the main thread
    (else ours stays, delegating every signal at once while no section
    runs).  Earlier ones leave ours in place: another executor is open."""
    if token is None or _thread.get_ident() != _MAIN:
        return
    with _lock:
        _state.open -= 1
        if _state.open > 0:
            return
        first = _state.replaced[0] if _state.replaced else None
        _state.replaced.clear()
        if first is None:
            return
        replaced, outer = first
        if signal.getsignal(signal.SIGINT) is _handler:
            signal.signal(signal.SIGINT, replaced)
        _state.previous = outer
