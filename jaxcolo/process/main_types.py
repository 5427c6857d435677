"""The controller's ``__main__`` namedtuples, in a worker.

A namedtuple class defined in the user's script travels in payloads as
``__main__:Name`` (with its fields).  In a worker that name means nothing:
its ``__main__`` is jaxcolo's command.  So a worker resolves these names in
a namespace of its own (:data:`NAMESPACE`, installed as
``jaxcolo.codec.names.foreign_main`` by :func:`install`):

* classes carried by the programs' bodies: cloudpickle carries a script's
  classes by value (those the function names, and those of its arguments,
  beside it in a pickle of their own: jaxcolo.colocated.body), and loading
  the same body again gives the same class object, so the function sees
  the very type its inputs were built with;
* else (a class that could not be carried, or a body from an older
  controller, which carries only what the function names) a namedtuple
  made from the payload's name and fields, once per name and fields (made
  only while :meth:`MainTypes.making` is active: the worker looks at the
  program's body first, whenever a program's decode named such a class,
  :meth:`MainTypes.watching`).

A body that carries the script's classes (or says it could not) is the
judge of them for its program (:meth:`MainTypes.only`): a script that
redefines a class gets the new one for its new programs, or a made one,
never an earlier program's.  :func:`decode_importing` is how a worker
decodes a program it is sent, and :func:`decode_judged` how it decodes it
again to run it.

Writing, a worker names a ``__main__`` namedtuple by its name: the
controller reads it as its own script's class of that name.  The namespace
is per session (``clear`` at its end); it holds at most ``MAX_TYPES``.
"""

from __future__ import annotations

import collections
import contextlib
import keyword
import threading
import types

from jaxcolo import envelope
from jaxcolo.codec.names import is_namedtuple
from jaxcolo.colocated.body import loads_body_carried
from jaxcolo.colocated.program import decode_program, read_program
from jaxcolo.errors import PayloadError, UnregisteredError

MAX_TYPES = 1024
_WALK_LIMIT = 4096  # objects looked at per body


class MainTypes:
    def __init__(self):
        self._collected: dict = {}  # (name, fields) -> a body's class
        self._made: dict = {}       # (name, fields) -> a namedtuple made here
        self._lock = threading.Lock()
        self._local = threading.local()

    def collect(self, obj) -> dict:
        """Remember the ``__main__`` namedtuples ``obj`` (a loaded body:
        a function, a class, a tuple of them) refers to: through globals
        (of nested code too), closures, defaults, bases and attributes, a
        bounded walk.  Returns them, by (name, fields)."""
        seen, stack, found = set(), [obj], []
        while stack and len(seen) < _WALK_LIMIT:
            x = stack.pop()
            if id(x) in seen:
                continue
            seen.add(id(x))
            if isinstance(x, type):
                if x.__module__ == "__main__":
                    if is_namedtuple(x):
                        found.append(x)
                    stack.extend(vars(x).values())
            elif isinstance(x, types.FunctionType):
                if x.__module__ == "__main__" or "<locals>" in x.__qualname__ \
                        or x.__name__ == "<lambda>":
                    g = x.__globals__
                    stack.extend(g[n] for n in _names(x.__code__) if n in g)
                    stack.extend(c.cell_contents for c in x.__closure__ or ()
                                 if _cell_set(c))
                    stack.extend(x.__defaults__ or ())
            elif isinstance(x, (tuple, list)):
                stack.extend(x)
            elif isinstance(x, (types.MethodType, classmethod, staticmethod)):
                stack.append(x.__func__)
        mine = {(f"__main__:{t.__qualname__}", tuple(t._fields)): t
                for t in found}
        with self._lock:
            for key, t in mine.items():  # (a redefined class replaces the
                if key in self._collected or \
                        len(self._collected) < MAX_TYPES:  # earlier one)
                    self._collected[key] = t
        return mine

    @contextlib.contextmanager
    def only(self, classes: dict):
        """While active (this thread), names resolve to ``classes`` (one
        body's) or to namedtuples made here, never to classes other bodies
        carried (the script may have redefined them since)."""
        previous = getattr(self._local, "only", None)
        self._local.only = classes
        try:
            yield
        finally:
            self._local.only = previous

    @contextlib.contextmanager
    def making(self):
        """While active (this thread), unknown names get a namedtuple made
        from the payload's fields."""
        self._local.making = True
        try:
            yield
        finally:
            self._local.making = False

    @contextlib.contextmanager
    def watching(self):
        """Yields a list that gets an entry each time a lookup in the
        block (this thread) answers (with a body's class, or a namedtuple
        made here)."""
        used: list = []
        previous = getattr(self._local, "used", None)
        self._local.used = used
        try:
            yield used
        finally:
            self._local.used = previous

    def resolve(self, name: str, fields=None):
        """The class ``name`` ("__main__:Qualname") with ``fields`` stands
        for: a body's class, else one made here, or None."""
        if fields is None:
            return None
        key = (name, tuple(fields))
        only = getattr(self._local, "only", None)
        with self._lock:
            t = (self._collected if only is None else only).get(key)
            if t is None:
                t = self._made.get(key)
            if t is None and getattr(self._local, "making", False):
                t = _make_namedtuple(name, key[1])
                if len(self._made) < MAX_TYPES:
                    self._made[key] = t
        used = getattr(self._local, "used", None)
        if t is not None and used is not None:
            used.append(name)
        return t

    def clear(self) -> None:
        with self._lock:
            self._collected.clear()
            self._made.clear()


def _names(code) -> set:
    """The global names ``code`` and the code nested in it use."""
    out, stack = set(), [code]
    while stack:
        c = stack.pop()
        out.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return out


def _cell_set(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _make_namedtuple(name: str, fields: tuple):
    qualname = name.partition(":")[2]
    short = qualname.rpartition(".")[2]
    for ident in (short, *fields):
        if not ident.isidentifier() or keyword.iskeyword(ident) or \
                ident.startswith("_"):
            raise PayloadError(f"namedtuple {name[:200]!r}: {ident[:100]!r} "
                               "is not a valid name")
    if len(set(fields)) != len(fields):
        raise PayloadError(f"namedtuple {name[:200]!r}: repeated fields")
    t = collections.namedtuple(short, fields, module="__main__")
    t.__qualname__ = qualname
    return t


NAMESPACE = MainTypes()


def install() -> None:
    """Resolve ``__main__:`` names in :data:`NAMESPACE` (a worker)."""
    from jaxcolo.codec import names
    names.foreign_main = NAMESPACE


def decode_importing(payload: bytes, inflation=None):
    """``(program, judge)``: decode_program; when its specs name a
    namedtuple or registered pytree node this process has not seen yet,
    or a class of the controller's script (which may have been redefined
    since an earlier program carried it), once more after unpickling the
    body, which imports the modules it refers to (where the type is
    defined, or registered) and carries the classes of the controller's
    script (see above); then, for those it does not carry, with
    namedtuples made from the payload.  The body is the program's own
    code, which this worker runs anyway; loaded here only to import, then
    dropped.  ``judge``: the script's classes this body carries, by (name,
    fields), when it is the judge of them (it carries them, or says it
    could not), else None; :func:`decode_judged` decodes the program
    again the same way.  ``inflation``: the budget of the message that
    carried the program (each attempt starts from what was left of it)."""
    start = inflation.copy() if inflation is not None else None
    names = NAMESPACE
    try:
        with envelope.inflation_scope(inflation), names.watching() as named:
            prog = decode_program(payload)
        if not named:
            return prog, None
        first = None  # the script's classes: those this body carries win
    except UnregisteredError as e:
        first = e
    try:
        with envelope.inflation_scope(start and start.copy()):
            body = read_program(payload).body
        value, carried, marked = loads_body_carried(body)
        mine = names.collect((value, carried))
    except Exception:  # noqa: BLE001 - the first error says more
        if first is None:
            return prog, None
        raise first from None
    # A body that carries the script's classes (or says it could not) is
    # the judge of them: names it lacks are made, not an earlier body's.
    judge = mine if marked else None
    return decode_judged(payload, judge, inflation=start), judge


def decode_judged(payload: bytes, judge, resolver=None, inflation=None):
    """decode_program of a program whose script classes are ``judge`` (see
    :func:`decode_importing`), the names it lacks made from the payload."""
    names = NAMESPACE

    def only():
        return contextlib.nullcontext() if judge is None else \
            names.only(judge)
    try:
        with envelope.inflation_scope(inflation and inflation.copy()), \
                only():
            return decode_program(payload, resolver)
    except UnregisteredError:  # a script's namedtuple the body does not
        with envelope.inflation_scope(inflation), names.making(), only():
            return decode_program(payload, resolver)  # carry
