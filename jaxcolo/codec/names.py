"""Python types and callables named by ``module:qualname`` in pytree nodes.

A reader finds namedtuples and defaultdict factories by name among modules
already imported, never importing one.
"""

from __future__ import annotations

import collections
import sys

from jaxcolo.errors import EncodeError


def qualified(obj) -> str:
    return f"{obj.__module__}:{obj.__qualname__}"


def resolve_imported(name: str):
    """The object named "module:qualname" if its module is already imported
    (looked up in namespaces only: nothing is imported, no module
    __getattr__ runs)."""
    module_name, _, qualname = name.partition(":")
    obj = sys.modules.get(module_name)
    if obj is None or not qualname:
        return None
    for part in qualname.split("."):
        obj = vars(obj).get(part) if hasattr(obj, "__dict__") else None
        if obj is None:
            return None
    return obj


def is_namedtuple(t) -> bool:
    return (isinstance(t, type) and issubclass(t, tuple)
            and isinstance(getattr(t, "_fields", None), tuple))


# defaultdict default_factory name -> callable.  Only these are written and
# read: a payload naming any other callable is refused, because the decoded
# defaultdict would call it on every missing key.
DEFAULT_FACTORIES: dict = {}


def register_default_factory(factory) -> None:
    """Allow defaultdicts with ``default_factory=factory`` (a named,
    module-level callable) in payloads, written and read by its
    ``module:qualname``.  Built-in containers and scalars are allowed
    already; register other factories in writer and reader alike."""
    name = qualified(factory) if hasattr(factory, "__qualname__") else None
    if name is None or resolve_imported(name) is not factory:
        raise ValueError(f"default_factory {factory!r} must be a named "
                         "module-level callable")
    DEFAULT_FACTORIES[name] = factory


for _factory in (list, dict, set, frozenset, tuple, int, float, complex, str,
                 bytes, bool, collections.OrderedDict, collections.Counter,
                 collections.deque, collections.defaultdict):
    register_default_factory(_factory)


def registered_factory(name: str):
    """The default_factory registered as ``name``, or None."""
    return DEFAULT_FACTORIES.get(name)


def factory_name(factory, path) -> str:
    if factory is None:
        return ""
    name = qualified(factory) if hasattr(factory, "__qualname__") else None
    if name is None or DEFAULT_FACTORIES.get(name) is not factory:
        raise EncodeError(
            f"defaultdict default_factory {factory!r} is not registered "
            "(jaxcolo.register_default_factory)", path)
    return name
