"""The controller's ``__main__`` namedtuples, in a worker.

A namedtuple class defined in the user's script travels in payloads as
``__main__:Name`` (with its fields).  In a worker that name means nothing:
its ``__main__`` is jaxcolo's command.  So a worker resolves these names in
a namespace of its own (:data:`NAMESPACE`, installed as
``jaxcolo.codec.names.foreign_main`` by :func:`install`):

* classes carried by the programs' bodies: cloudpickle carries a script's
  classes by value, and loading the same body again gives the same class
  object, so the function sees the very type its inputs were built with;
* else (a function that takes such values without naming their type) a
  namedtuple made from the payload's name and fields, once per name and
  fields (made only while :meth:`MainTypes.making` is active: the worker
  tries the body's classes first; found later as well).

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

from jaxcolo.codec.names import is_namedtuple
from jaxcolo.errors import PayloadError

MAX_TYPES = 1024
_WALK_LIMIT = 4096  # objects looked at per body


class MainTypes:
    def __init__(self):
        self._types: dict = {}
        self._lock = threading.Lock()
        self._making = threading.local()

    def collect(self, obj) -> None:
        """Remember the ``__main__`` namedtuples ``obj`` (a loaded body:
        a function, a class, a tuple of them) refers to: through globals,
        closures, defaults, bases and attributes, a bounded walk."""
        seen, stack, found = set(), [obj], []
        while stack and len(seen) < _WALK_LIMIT:
            x = stack.pop()
            if id(x) in seen:
                continue
            seen.add(id(x))
            if isinstance(x, type):
                if is_namedtuple(x) and x.__module__ == "__main__":
                    found.append(x)
                if x.__module__ == "__main__":
                    stack.extend(vars(x).values())
            elif isinstance(x, types.FunctionType):
                if x.__module__ == "__main__" or "<locals>" in x.__qualname__ \
                        or x.__name__ == "<lambda>":
                    code = x.__code__
                    g = x.__globals__
                    stack.extend(g[n] for n in code.co_names if n in g)
                    stack.extend(c.cell_contents for c in x.__closure__ or ()
                                 if _cell_set(c))
                    stack.extend(x.__defaults__ or ())
            elif isinstance(x, (tuple, list)):
                stack.extend(x)
            elif isinstance(x, types.MethodType):
                stack.append(x.__func__)
            elif isinstance(x, (classmethod, staticmethod)):
                stack.append(x.__func__)
        with self._lock:
            for t in found:
                if len(self._types) < MAX_TYPES:
                    self._types[f"__main__:{t.__qualname__}"] = t

    @contextlib.contextmanager
    def making(self):
        """While active (this thread), unknown names get a namedtuple made
        from the payload's fields."""
        self._making.on = True
        try:
            yield
        finally:
            self._making.on = False

    def resolve(self, name: str, fields=None):
        """The class ``name`` ("__main__:Qualname") stands for, or None."""
        with self._lock:
            t = self._types.get(name)
            if t is not None or fields is None:
                return t
            key = (name, tuple(fields))
            t = self._types.get(key)  # made before
            if t is None and getattr(self._making, "on", False):
                t = _make_namedtuple(name, key[1])
                if len(self._types) < MAX_TYPES:
                    self._types[key] = t
            return t

    def clear(self) -> None:
        with self._lock:
            self._types.clear()


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
