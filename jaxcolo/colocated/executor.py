"""The Executor interface, and which executor colocated calls use.

An executor runs colocated *programs* on the hosts owning their devices.  The
controller side (``jaxcolo.colocated.function``) never hands it live Python
spec objects: a program is a :class:`~jaxcolo.colocated.program.ProgramRef`
(payload bytes + content id) and the specs inside are jaxcolo spec payloads.

Interface (every method is thread-safe)::

    payload_version: int
        Schema version the controller writes programs and spec payloads at
        for this executor (a remote executor sets it to the version agreed in
        its handshake; programs need version >= 2).

    call(program, args, *, lane) -> list[jax.Array]
        Run ``program`` (which has out_specs) on its devices.  ``args`` are
        the leaves of the call's ``(args, kwargs)`` tree, in the order of the
        program's in_specs; the result is the output leaves in the order of
        its out_specs, each a jax.Array with the out spec's sharding.
    submit(program, args, *, lane) -> concurrent.futures.Future
        Like call, without waiting; the future's result is call's result.
    discover(program, args, *, lane) -> (list[jax.Array], bytes)
        Run ``program`` (which has no out_specs) once: its outputs, and a
        spec payload (written at the program's version) of the output tree of
        ShapeDtypeStructs, from which the controller builds the full program.
    destroy_instance(instance_id, *, lane) -> None
        Destroy the host instances of a colocated class instance, on every
        host that created one (a no-op where none was).  Does not wait.
    close() -> None
        Release the executor.  Queued calls fail with ExecutorError; later
        calls raise ExecutorError.  Executors are context managers.

Programs are *registered by content id*: an executor caches whatever it
derives from a payload (decoded specs, the loaded body) under
``program.id``, so a warm call decodes nothing; a remote executor sends a
payload to a host once and refers to it by id afterwards.  A method program
carries the class body and instance id; the host creates the instance at the
first call that needs it there.

Ordering: a *lane* is an opaque hashable naming one caller thread (the
controller passes ``current_lane()``, unique per thread and never reused).  Work submitted on one lane
(call, submit, discover, destroy_instance) runs in submission order; work on
different lanes may run concurrently (three lanes meeting at a barrier inside
their functions must not deadlock).  A lane is used by one thread at a time.

Errors: an exception raised by the user's function reaches the caller with
its own type; executor failures (worker lost, timeout, closed) raise
:class:`jaxcolo.ExecutorError`; malformed payloads raise PayloadError.

How a process executor fits: ``call``/``submit`` send (program id, lane,
input shards as raw bytes + the in spec payload) to the worker(s) owning the
devices, sending the program payload first if that worker has not seen its id;
workers keep one FIFO per lane; results come back as shard bytes assembled on
the controller by the out specs; ``discover`` returns the worker's spec
payload verbatim; ``destroy_instance`` is broadcast to the workers that
created the instance.
"""

from __future__ import annotations

import abc
import contextlib
import itertools
import threading
from concurrent.futures import Future
from typing import Hashable, Sequence

from jaxcolo import versions


_thread_lane = threading.local()
_new_lane = itertools.count(1).__next__


class FirstRaised:
    """Runs steps that must all run although one may raise a
    BaseException (a done-callback's ``sys.exit``; an Exception is logged
    by the callback runner; Ctrl-C is raised at once), then ``reraise()``-s
    the first: one callback
    used to cut short the callbacks after it, the bookkeeping hooks
    waiting for them (interpreter exit then waited forever), or close()."""

    __slots__ = ("error", "defer_interrupts")

    def __init__(self, defer_interrupts: bool = False):
        self.error = None
        # Ctrl-C too (steps that complete futures: a future left pending
        # would hang its waiters; the caller raises it when they are done)
        self.defer_interrupts = defer_interrupts

    def run(self, fn, *args) -> None:
        try:
            fn(*args)
        except KeyboardInterrupt as e:  # Ctrl-C stops what runs now, as
            if not self.defer_interrupts:  # asked (not after a close's
                raise                      # slow shutdown)
            if self.error is None:
                self.error = e
        except BaseException as e:  # noqa: BLE001 - raised by reraise()
            if self.error is None:
                self.error = e

    def reraise_interrupt(self) -> None:
        """Raise now the first error if it is a Ctrl-C."""
        if isinstance(self.error, KeyboardInterrupt):
            self.reraise()

    def reraise(self) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise error


def current_lane() -> int:
    """The calling thread's lane: unique for the life of the process.  (A
    thread id is reused once its thread ends, which would queue a new
    thread's calls behind work a finished thread left submitted.)"""
    try:
        return _thread_lane.lane
    except AttributeError:
        lane = _thread_lane.lane = _new_lane()
        return lane


class Executor(abc.ABC):
    """Runs colocated programs; see the module docstring for the contract."""

    @property
    def payload_version(self) -> int:
        return versions.SCHEMA_VERSION

    # ``checked=True``: the caller guarantees that ``args`` match the
    # program's in_specs (the colocated API does: its signature cache is
    # keyed on exactly that); otherwise every call's arguments are checked.

    @abc.abstractmethod
    def call(self, program, args: Sequence, *, lane: Hashable,
             checked: bool = False) -> list:
        ...

    @abc.abstractmethod
    def submit(self, program, args: Sequence, *, lane: Hashable,
               checked: bool = False) -> Future:
        ...

    @abc.abstractmethod
    def discover(self, program, args: Sequence, *,
                 lane: Hashable) -> tuple[list, bytes]:
        ...

    @abc.abstractmethod
    def destroy_instance(self, instance_id: int, *, lane: Hashable) -> None:
        ...

    @abc.abstractmethod
    def close(self) -> None:
        ...

    def timeout(self, seconds: float | None):
        """Context: this thread's calls inside time out after ``seconds``
        (executors without timeouts ignore it)."""
        return contextlib.nullcontext(self)

    def timeout_left(self, seconds: float, stated: float):
        """Context: ``timeout(seconds)`` where ``seconds`` is what a wait
        left of the timeout ``stated`` the caller set (executors name that
        one in their messages)."""
        return self.timeout(seconds)

    def call_timeout(self) -> float | None:
        """Seconds a call this thread makes now may take, waits included
        (None: no limit).  Callers bound their own waits for the call (for
        another thread's discovery, say) by it."""
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ------------------------------------------------------- current executor

_lock = threading.Lock()
_current: list = [None]   # the executor in use, process-wide (None: default)
_entered: list = []       # (token, executor) of the open use_executor blocks
_default: list = [None]


def default_executor() -> Executor:
    """The process's default executor: an InlineExecutor, made on first use."""
    ex = _default[0]
    if ex is None:
        with _lock:
            if _default[0] is None:
                from jaxcolo.colocated.inline import InlineExecutor
                _default[0] = InlineExecutor()
            ex = _default[0]
    return ex


def get_executor() -> Executor:
    """The executor colocated calls use now."""
    return _current[0] or default_executor()


@contextlib.contextmanager
def use_executor(executor: Executor):
    """Make colocated calls, from every thread, use ``executor`` inside the
    ``with`` block.

    Process-wide rather than per thread, because threads started inside the
    block (workers, data loaders) are meant to use it too.  The executor in
    use is the one of the most recently entered block still open: leaving a
    block removes its own entry, so blocks that overlap without nesting
    (two threads) never leave an executor behind after they are all left.
    """
    if not isinstance(executor, Executor):
        raise TypeError(f"use_executor needs an Executor, got "
                        f"{type(executor).__name__}")
    token = object()
    with _lock:
        _entered.append((token, executor))
        _current[0] = executor
    try:
        yield executor
    finally:
        with _lock:
            for i in range(len(_entered) - 1, -1, -1):
                if _entered[i][0] is token:
                    del _entered[i]
                    break
            _current[0] = _entered[-1][1] if _entered else None
