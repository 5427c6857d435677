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
the user's); otherwise nothing is deferred.
"""

from __future__ import annotations

import _thread
import signal
import threading

_MAIN = threading.main_thread().ident


class _State:
    depth = 0          # nesting of the main thread's critical sections
    pending = False    # a SIGINT arrived inside one
    previous = None    # the handler ours replaced
    installs = 0       # open executors that asked for it


_state = _State()
_lock = threading.Lock()


def _deliver(signum: int, frame) -> None:
    previous = _state.previous
    if callable(previous):
        previous(signum, frame)


def _handler(signum: int, frame) -> None:
    if _state.depth:
        _state.pending = True
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
            if not _state.depth and _state.pending:
                _state.pending = False
                _deliver(signal.SIGINT, None)
        return False


CRITICAL = _Critical()


def install() -> bool:
    """Route SIGINT through the deferring handler (counted; True when it
    is in place).  Does nothing outside the main thread or when SIGINT has
    no Python-level handler (ignored, or the OS default)."""
    if _thread.get_ident() != _MAIN:
        return False
    with _lock:
        current = signal.getsignal(signal.SIGINT)
        if current is not _handler:
            if not callable(current):
                return False
            _state.previous = current
            signal.signal(signal.SIGINT, _handler)
        _state.installs += 1
        return True


def uninstall() -> None:
    """Undo one ``install``; the last one puts the previous handler back
    (if ours is still the installed one, and from the main thread: else
    ours stays, delegating every signal at once while no section runs)."""
    with _lock:
        if _state.installs == 0:
            return
        _state.installs -= 1
        if _state.installs or _thread.get_ident() != _MAIN:
            return
        if signal.getsignal(signal.SIGINT) is _handler:
            signal.signal(signal.SIGINT, _state.previous)
