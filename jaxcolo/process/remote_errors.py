"""A function's exception, from the worker that raised it to the caller.

The controller never unpickles what a worker names freely: the worker
pickles an exception with every exception class *by reference*, and the
controller's unpickler resolves nothing but such references, only to
exception classes this process already has:

* by module and qualified name, in a module already imported here (also a
  class of the caller's ``__main__``);
* a class the function's body carried by value (defined in a function, say)
  by the id cloudpickle tracks it under: the class this process pickled.

Nothing is imported and no other global is reachable.  So the caller gets
the same exception type with its args and attributes; anything else (args
or attributes holding other objects, a class unknown here) gives None, and
the caller an ExecutorError naming the type and the message.

An exception whose class keeps BaseException's pickling is rebuilt by
:func:`rebuild_exception`: its class called with its args, or, when its
``__init__`` takes other arguments than the args it stores, made without
``__init__``; then its attributes are set.  One whose pickle is over the
size limit travels as its class and clipped text only.
"""

from __future__ import annotations

import io
import pickle
import threading
import traceback

from jaxcolo.codec.names import resolve_imported
from jaxcolo.colocated.body import PicklesAs
from jaxcolo.errors import ExecutorError
from jaxcolo.process.messages import Message, MessageKind as K
from jaxcolo.versions import FEATURE_SINCE

_THIS = __name__
_CAUSES_SINCE = FEATURE_SINCE["remote_exception_cause"]
_ANY_CLASS_CHAINS_SINCE = FEATURE_SINCE["remote_exception_chain_any_class"]


def _is_exception_class(obj) -> bool:
    # Exception, not BaseException: a worker never makes its caller raise
    # SystemExit, KeyboardInterrupt or GeneratorExit.
    return isinstance(obj, type) and issubclass(obj, Exception)


def exception_class(module: str, qualname: str) -> type:
    """The exception class ``module.qualname`` of an imported module."""
    obj = resolve_imported(f"{module}:{qualname}")
    if not _is_exception_class(obj):
        raise pickle.UnpicklingError(
            f"{module}.{qualname} is not an exception class here")
    return obj


def _tracked_classes():
    """cloudpickle's (class -> id, id -> class) tables of classes pickled by
    value, or None if this cloudpickle has none."""
    try:
        from cloudpickle import cloudpickle as cp
        return (cp._DYNAMIC_CLASS_TRACKER_BY_CLASS,
                cp._DYNAMIC_CLASS_TRACKER_BY_ID)
    except (ImportError, AttributeError):  # pragma: no cover - other versions
        return None


def tracked_exception_class(tracker_id: str) -> type:
    """The exception class cloudpickle tracks under ``tracker_id``."""
    tables = _tracked_classes()
    cls = None if tables is None else tables[1].get(tracker_id)
    if not _is_exception_class(cls):
        raise pickle.UnpicklingError(f"no exception class tracked as "
                                     f"{tracker_id!r} here")
    return cls


def _reference(cls: type):
    """How ``cls`` is named in a pickled exception."""
    try:
        if exception_class(cls.__module__, cls.__qualname__) is cls:
            return exception_class, (cls.__module__, cls.__qualname__)
    except pickle.UnpicklingError:
        pass
    tables = _tracked_classes()
    tracker_id = None if tables is None else tables[0].get(cls)
    if tracker_id is None:
        raise pickle.PicklingError(f"{cls.__qualname__} cannot be named")
    return tracked_exception_class, (tracker_id,)


# The key in ``state`` under which an exception's ``__context__`` (the one
# being handled when it was raised, unless suppressed) travels, pickled on
# its own: a context this process cannot rebuild (its class's module not
# imported here, say) costs only itself.  Controllers that do not know the
# key put it in the exception's __dict__, where it hides nothing.
_CONTEXT = "__context__"


def rebuild_exception(cls, args, state, cause=None):
    """An exception of class ``cls`` with ``args``, attributes ``state`` (a
    dict or None; its ``__context__`` entry, if any, is the pickle of the
    exception's ``__context__``) and ``__cause__`` (``raise ... from
    cause``)."""
    if not _is_exception_class(cls) or not isinstance(args, tuple):
        raise pickle.UnpicklingError("not an exception")
    try:
        exc = cls(*args)
    except BaseException:  # noqa: BLE001 - __init__ wants other arguments
        exc = cls.__new__(cls, *args)  # (or raises what it should not)
    exc.args = args
    context = None
    if state:
        if isinstance(state, dict) and _CONTEXT in state:
            state = dict(state)
            context = state.pop(_CONTEXT)
        exc.__dict__.update(state)
    return chain_exception(exc, cause, context)


def chain_exception(exc, cause, context):
    """``exc`` (an exception its class's own pickling rebuilt: an OSError,
    an ImportError, one with its own ``__reduce__``) with ``__cause__``
    ``cause`` and ``__context__`` unpickled from ``context`` (bytes or
    None; refused: left out)."""
    if not isinstance(exc, Exception):
        raise pickle.UnpicklingError("not an exception")
    if isinstance(context, bytes):
        context = loads_exception(context)  # (None if refused)
    if isinstance(context, BaseException):
        exc.__context__ = context
    if isinstance(cause, BaseException):
        exc.__cause__ = cause
    return exc


def _default_pickling(cls) -> bool:
    return (cls.__reduce_ex__ is BaseException.__reduce_ex__ and
            cls.__reduce__ is BaseException.__reduce__ and
            getattr(cls, "__setstate__", None) is BaseException.__setstate__)


_PROTOCOL = pickle.HIGHEST_PROTOCOL


class _ExceptionPickler(pickle.Pickler):
    """Pickles exception classes by reference; exceptions keep their
    ``__cause__`` (if ``causes``) and their ``__context__`` (if
    ``contexts``): those rebuilt by rebuild_exception, and (if
    ``any_class``) those their class's own pickling rebuilds, through
    chain_exception."""

    def __init__(self, out, causes: bool, contexts: bool = False,
                 any_class: bool = False, context_pickles=None):
        super().__init__(out, protocol=_PROTOCOL)
        self.causes = causes
        self.contexts = contexts and causes
        self.any_class = any_class and causes
        # id(context) -> (context, its pickle; None while being made: a
        # cycle), shared by the nested picklers of one dump: each context
        # is pickled once, however often the objects refer back to it
        self.context_pickles = {} if context_pickles is None \
            else context_pickles

    def _context_pickle(self, context) -> bytes | None:
        made = self.context_pickles.get(id(context))
        if made is not None:
            return made[1]
        self.context_pickles[id(context)] = (context, None)
        pickled = _dumps(context, True, True, self.any_class,
                         self.context_pickles)
        self.context_pickles[id(context)] = (context, pickled)
        return pickled

    def reducer_override(self, obj):
        if isinstance(obj, type) and issubclass(obj, BaseException):
            return _reference(obj)
        if not isinstance(obj, Exception):
            return NotImplemented
        default = _default_pickling(type(obj))
        if not default and not self.any_class:
            return NotImplemented
        cause = obj.__cause__ if self.causes else None
        context = None
        if self.contexts and obj.__context__ is not None and \
                not obj.__suppress_context__:
            context = self._context_pickle(obj.__context__)
        if not default:
            if cause is None and context is None:
                return NotImplemented
            reduced = obj.__reduce_ex__(_PROTOCOL)
            if not isinstance(reduced, tuple) or len(reduced) < 2:
                return NotImplemented  # (a global's name)
            # its state, list and dict items follow (BUILD ...): by then
            # the exception is memoized, so they may refer back to it
            return (chain_exception,
                    (PicklesAs(reduced[:2]), cause, context), *reduced[2:])
        state = getattr(obj, "__dict__", None) or None
        if self.any_class and state:
            # its attributes follow (BUILD: setattr), once it is memoized,
            # so they may refer back to it (sessions from 12)
            return (rebuild_exception, (type(obj), obj.args, None if context
                                        is None else {_CONTEXT: context},
                                        cause), dict(state))
        if context is not None:
            state = dict(state or (), **{_CONTEXT: context})
        if cause is None:  # (what controllers before version 7 take)
            return rebuild_exception, (type(obj), obj.args, state)
        return rebuild_exception, (type(obj), obj.args, state, cause)


def _calling(fn):
    """A new function calling ``fn``: what a pickle may set attributes of
    (BUILD) is thrown away with it, never this module's own function."""
    return lambda *args: fn(*args)


# The pure-Python unpickler: its memo is a dict, where the C one makes a
# table as long as the largest memo index a pickle names (9 bytes asking
# for 2**30 entries: 16 GB zeroed).
_Unpickler = getattr(pickle, "_Unpickler", pickle.Unpickler)


class _ExceptionUnpickler(_Unpickler):
    _ALLOWED = frozenset({"exception_class", "tracked_exception_class",
                          "rebuild_exception", "chain_exception"})

    def find_class(self, module, name):
        if module != _THIS or name not in self._ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed "
                                         "in a remote exception")
        return _calling(globals()[name])


def _dumps(obj, causes: bool = False, contexts: bool = False,
           any_class: bool = False, context_pickles=None) -> bytes | None:
    """``obj`` pickled (with its exceptions' causes and contexts, if told:
    also those of exceptions of any class, if ``any_class``), or None if
    it does not pickle."""
    out = io.BytesIO()
    try:
        _ExceptionPickler(out, causes, contexts, any_class,
                          context_pickles).dump(obj)
    except BaseException:  # noqa: BLE001 - args that do not pickle, a
        return None        # cycle of causes (RecursionError), a user's
                           # __reduce__ raising SystemExit, ...
    return out.getvalue()


class _Clipped:
    """Pickles as ``cls(text)`` made by rebuild_exception."""

    def __init__(self, cls, text):
        self.cls, self.text = cls, text

    def __reduce__(self):
        return rebuild_exception, (self.cls, (self.text,), None)


def dumps_exception(e: BaseException, limit: int | None = None,
                    text: str | None = None,
                    causes: bool = True,
                    any_class: bool = True) -> bytes | None:
    """``e`` pickled for ``loads_exception`` with its causes and contexts
    (unless told not: controllers before version 7 cannot rebuild them;
    those of exceptions their own class pickles -- OSErrors, say -- unless
    told not by ``any_class``: controllers before version 12 cannot),
    else without its contexts, else without both -- the first that pickles,
    fits in ``limit`` bytes and that ``loads_exception`` takes back (a
    context or cause holding what it refuses, numpy values say, costs only
    itself); None if none does (what the exception itself holds does not
    pickle or load: type name and text).  Over ``limit`` bytes at every
    level: its class with ``text`` as its only arg instead (None if that is
    over the limit too, or no text is given)."""
    # (causes, contexts, any class's; the last: attributes set by BUILD)
    levels = ((True, True, True), (True, True, False), (True, False, True),
              (True, False, False), (False, False, False)) if causes and any_class \
        else ((True, True, False), (True, False, False),
              (False, False, False)) if causes else ((False, False, False),)
    too_large = False
    for with_causes, with_contexts, with_any_class in levels:
        data = _dumps(e, with_causes, with_contexts, with_any_class)
        if data is None:
            continue
        if limit is not None and len(data) > limit:
            too_large = True
            continue
        if loads_exception(data) is not None:
            return data
    if not too_large or text is None or not isinstance(e, Exception):
        return None
    data = _dumps(_Clipped(type(e), text))
    return data if data is not None and len(data) <= limit else None


# Bytes of contexts one load may unpickle besides its own (contexts nest:
# an honest chain of n contexts unpickles about n/2 times its size), and
# how many context pickles.
_CONTEXT_BUDGET_FACTOR = 32
_CONTEXT_BUDGET_BASE = 16 << 20
_CONTEXT_LOADS = 1 << 16

_loading = threading.local()  # .state: the outermost load's _LoadState


class _LoadState:
    def __init__(self, budget: int):
        self.budget = budget
        self.loads = _CONTEXT_LOADS
        self.loaded: dict = {}  # id(context pickle) -> (it, its exception)


def loads_exception(data: bytes) -> BaseException | None:
    """The exception ``dumps_exception`` wrote, or None when it names
    anything but exception classes known here (or is not an exception).

    The contexts it holds (pickles of their own, loaded as they are met)
    are loaded once each, within a budget of bytes (16 MiB plus 32 times
    ``data``'s size) and of loads (65,536): past it, a context is left out.
    With the pure-Python unpickler (work and memory linear in what it
    reads), a small pickle naming one context many times over, nesting
    them, or naming huge memo indices cannot make this process work long."""
    state = getattr(_loading, "state", None)
    outermost = state is None
    if outermost:
        state = _loading.state = _LoadState(
            _CONTEXT_BUDGET_FACTOR * len(data) + _CONTEXT_BUDGET_BASE)
    else:
        seen = state.loaded.get(id(data))
        if seen is not None:
            return seen[1]
        if len(data) > state.budget or state.loads == 0:
            return None
        state.budget -= len(data)
        state.loads -= 1
    try:
        exc = _ExceptionUnpickler(io.BytesIO(data)).load()
    except BaseException:  # noqa: BLE001 - any refusal (or a user's
        exc = None         # __init__ raising KeyboardInterrupt): type
                           # name and text
    finally:
        if outermost:
            _loading.state = None
    exc = exc if isinstance(exc, Exception) else None
    if not outermost:
        state.loaded[id(data)] = (data, exc)
    return exc


def exception_from_reply(link, m) -> BaseException:
    """The exception to raise in the caller for error reply ``m`` from
    ``link``: the remote exception rebuilt when it can be, else an
    ExecutorError naming its type and text; the remote traceback as a
    note."""
    exc = None
    if m.error_pickle:  # exception classes known here, nothing else
        exc = loads_exception(m.error_pickle)
    note = (f"Remote traceback from {link.describe}:\n"
            f"{m.error_traceback}") if m.error_traceback else None
    if exc is not None and note is not None:
        try:
            exc.add_note(note)
        except Exception:  # noqa: BLE001 - e.g. __notes__ not a list
            exc = None
    if exc is None:
        exc = ExecutorError(f"{m.error_type}: {m.error_message}")
        if note is not None:
            exc.add_note(note)
    return exc


# ------------------------------------------------- the worker's error reply

MAX_ERROR_TEXT = 1 << 20      # characters of an error's text or traceback
MAX_ERROR_PICKLE = 16 << 20   # bytes; a bigger pickled exception is dropped


def error_message(call_id: int, e: BaseException, where: str,
                  version: int) -> Message:
    """An ``error`` message carrying exception ``e`` (its text and
    traceback clipped to MAX_ERROR_TEXT characters, the pickled exception
    left out past MAX_ERROR_PICKLE bytes: the reply must fit in a frame)
    for a session at ``version``."""
    t = type(e)
    tb = _safely(lambda: "".join(traceback.format_exception(e)),
                 "<the traceback could not be formatted>")
    text = _clip(_safely(lambda: str(e), f"<{t.__qualname__}: str() failed>"))
    # None: type name and text
    pickled = _safely(lambda: dumps_exception(
        e, MAX_ERROR_PICKLE, text, version >= _CAUSES_SINCE,
        version >= _ANY_CLASS_CHAINS_SINCE), None)
    return Message(
        K.error, call_id=call_id,
        error_type=f"{t.__module__}.{t.__qualname__}",
        error_message=text, error_traceback=_clip(tb), error_pickle=pickled)


def _clip(text: str) -> str:
    """``text`` as UTF-8 can carry it (lone surrogates escaped), clipped."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) <= MAX_ERROR_TEXT:
        return text
    half = MAX_ERROR_TEXT // 2
    return (f"{text[:half]}\n... [{len(text) - 2 * half} characters left "
            f"out] ...\n{text[-half:]}")


def _safely(make, fallback):
    """``make()``, or ``fallback`` if it raises (a user's exception whose
    __str__ or pickling fails, even with SystemExit or KeyboardInterrupt,
    must still get its error reply out)."""
    try:
        out = make()
    except BaseException:  # noqa: BLE001 - the user's code raised it
        return fallback
    return out if isinstance(out, (str, bytes, type(None))) else fallback
