"""Pytree node types for the executor tests, in a module of their own: a
worker imports it only when it unpickles a body that refers to it."""

import collections
import os
import dataclasses

import jax
import jax.export

Pair = collections.namedtuple("Pair", ["left", "right"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Box:
    a: object
    b: object


jax.export.register_pytree_node_serialization(
    Box, serialized_name="tests.colocated_types.Box",
    serialize_auxdata=lambda aux: b"", deserialize_auxdata=lambda data: ())


def swap(p):
    return Pair(p.right, p.left)


def boxed(x):
    return Box(x, x * 2)


def constructed_here():
    return RuntimeError(f"constructed in pid {os.getpid()}")


class Sneaky(Exception):
    """An exception whose pickle calls a function of its choosing."""

    def __reduce__(self):
        return constructed_here, ()


def raise_sneaky(x):
    raise Sneaky("from the host")


def raise_with_odd_notes(x):
    e = ValueError("boom")
    e.__notes__ = ("not", "a list")
    raise e


def raise_system_exit(x):
    raise SystemExit(3)


class BadStr(Exception):
    """An exception whose __str__ raises."""

    def __str__(self):
        raise RuntimeError("no str")


def raise_bad_str(x):
    raise BadStr("x")


class Coded(Exception):
    """An exception whose __init__ takes other arguments than its args."""

    def __init__(self, code, *, where):
        super().__init__(f"error {code} at {where}")
        self.code = code
        self.where = where


def raise_coded(x):
    raise Coded(7, where="the host")


def raise_with_cause(x):
    try:
        {}["missing"]
    except KeyError as e:
        raise Coded(3, where="the lookup") from e


def raise_while_handling(x):
    try:
        {}["missing"]
    except KeyError:
        raise Coded(4, where="the handler")  # its __context__: the KeyError


class MissingKey(Exception):
    """An exception whose __init__ formats its one argument."""

    def __init__(self, key):
        super().__init__(f"missing config key {key!r}")
        self.key = key


class NeedsLr:
    """A class whose __init__ raises MissingKey."""

    def __init__(self):
        raise MissingKey("lr")

    def step(self, x):
        return x


class Late:
    """A pytree node type registered only when register_late() runs."""

    def __init__(self, v):
        self.v = v


def register_late():
    from jax._src.export import _export
    if Late in _export.serialization_registry:
        return
    jax.tree_util.register_pytree_node(Late, lambda n: ((n.v,), None),
                                       lambda _, ch: Late(ch[0]))
    jax.export.register_pytree_node_serialization(
        Late, serialized_name="tests.colocated_types.Late",
        serialize_auxdata=lambda aux: b"",
        deserialize_auxdata=lambda data: None)


def register_late_here(x):
    register_late()
    return x


class SelfReducing(Exception):
    """An exception with its own ``__reduce__`` (the usual way to make one
    with extra ``__init__`` arguments picklable)."""

    def __init__(self, message, code):
        super().__init__(message)
        self.code = code

    def __reduce__(self):
        return type(self), (self.args[0], self.code), self.__dict__
