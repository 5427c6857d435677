"""Python types and callables named by ``module:qualname`` in pytree nodes.

How a node type is written depends on how JAX flattens it (a namedtuple may
be a plain namedtuple node or a custom node with its own flatten), and a
reader finds namedtuples and defaultdict factories by name among modules
already imported, never importing one.
"""

from __future__ import annotations

import collections
import sys
import threading

from jax._src import tree_util as jtu
from jax._src.export import _export as jexport

from jaxcolo.errors import EncodeError


def qualified(obj) -> str:
    return f"{obj.__module__}:{obj.__qualname__}"


def qualified_or_none(obj) -> str | None:
    """``qualified(obj)``, or None if ``obj`` lacks a str __module__ or
    __qualname__ (a method descriptor such as ``str.lower`` has no
    __module__)."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None
    return f"{module}:{qualname}"


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


# What resolves "__main__:" names where __main__ is not the script that
# wrote them (a worker process: its controller's script's classes, see
# jaxcolo.process.main_types); None: this process's own __main__.
foreign_main = None
# Lookups foreign_main answered: a decode that made any is not memoized
# (which class a name stands for may change as programs arrive).
_foreign = [0]
_foreign_lock = threading.Lock()  # (+= is not atomic across threads)


def foreign_lookups() -> int:
    return _foreign[0]


def resolve_namedtuple(name: str, fields=None):
    """The class a reader finds for namedtuple ``name`` (with the
    payload's ``fields``), or None."""
    if foreign_main is not None and name.startswith("__main__:"):
        with _foreign_lock:
            _foreign[0] += 1
        return foreign_main.resolve(name, fields)
    return resolve_imported(name)


def found_by_name(t, name: str) -> bool:
    """Whether a reader finds class ``t`` by ``name`` (its qualified name):
    not inside a function, not shadowed.  A worker names its controller's
    script's classes by their names there."""
    if "<locals>" in name:
        return False
    if foreign_main is not None and name.startswith("__main__:"):
        return True
    return resolve_imported(name) is t


def still_found(found) -> bool:
    """Whether every ``(type, name)`` of ``found`` (namedtuples a writer or
    reader found by name) is still what its name refers to: a cached
    encode or decode holding them is stale once a module rebinds a name
    (a notebook cell re-run, ``importlib.reload``)."""
    return all(found_by_name(t, name) for t, name in found)


# Bumped when register_default_factory changes what a name stands for.
_factory_changes = [0]


def registry_generation() -> tuple:
    """A value that changes whenever a registration that decides how a pytree
    node is written or read changes: jax.export's serialization registries
    and JAX's pytree registry (which only grow) and the default factories.
    Caches of flattened or decoded trees hold it and compare it."""
    return (len(jexport.serialization_registry),
            len(jexport.deserialization_registry), len(jtu._registry),
            _factory_changes[0])


def is_namedtuple(t) -> bool:
    return (isinstance(t, type) and issubclass(t, tuple)
            and isinstance(getattr(t, "_fields", None), tuple))


def is_custom_node(t) -> bool:
    """Whether JAX flattens ``t`` with a flatten registered for it
    (register_pytree_node, register_dataclass and the like) rather than
    natively.  A namedtuple class so registered is a custom node (its own
    children and auxdata), not a namedtuple node; the registry consulted is
    the one jax.export consults for the same question."""
    return t in jtu._registry


def dataclass_fields(t):
    """(data_fields, meta_fields) of a type registered with
    jax.tree_util.register_dataclass (jaxlib's dataclass node, which indexes
    its auxdata and children by those counts unchecked), else None."""
    entry = jtu._registry.get(t)
    flatten = getattr(entry, "to_iter", None)
    if getattr(flatten, "__qualname__", "") != \
            "register_dataclass.<locals>.flatten_func":
        return None
    cells = dict(zip(flatten.__code__.co_freevars, flatten.__closure__ or ()))
    try:
        return (tuple(cells["data_fields"].cell_contents),
                tuple(cells["meta_fields"].cell_contents))
    except (KeyError, ValueError):  # JAX changed: treat it as opaque
        return None


def plain_namedtuple(t) -> bool:
    """Whether JAX flattens ``t`` as a namedtuple node (all fields, no
    auxdata)."""
    return is_namedtuple(t) and not is_custom_node(t)


def custom_namedtuple_error(t, path):
    """None if custom-node namedtuple ``t`` can be written as a custom node,
    else the EncodeError saying why not."""
    if dataclass_fields(t) is not None:
        return EncodeError(
            f"namedtuple {t.__qualname__} is registered with "
            "jax.tree_util.register_dataclass: not supported in payloads "
            "(register it with register_pytree_node)", path)
    reg = jexport.serialization_registry.get(t)
    if reg is None:
        return EncodeError(
            f"namedtuple {t.__qualname__} is registered as a custom pytree "
            "node (its own flatten and auxdata), so it is serialized as one: "
            "register it with jax.export.register_pytree_node_serialization "
            "(register_namedtuple_serialization drops the auxdata)", path)
    # Registered with a from_children of its own: that is how
    # register_namedtuple_serialization rebuilds a plain namedtuple from its
    # fields, dropping the auxdata.  The reader rebuilds custom nodes with
    # the registered unflatten from the auxdata, which would misread them.
    from_children = jexport.deserialization_registry[reg[0]][2]
    if from_children is not jtu._registry[t].from_iter:
        return EncodeError(
            f"namedtuple {t.__qualname__} is registered as a custom pytree "
            f"node, but its serialization {reg[0]!r} has its own from_children "
            "(as register_namedtuple_serialization makes), which drops the "
            "node's auxdata: register it with jax.export."
            "register_pytree_node_serialization without from_children", path)
    return None


# defaultdict default_factory name -> callable.  Only these are written and
# read: a payload naming any other callable is refused, because the decoded
# defaultdict would call it on every missing key.
DEFAULT_FACTORIES: dict = {}


def register_default_factory(factory) -> None:
    """Allow defaultdicts with ``default_factory=factory`` (a named,
    module-level callable) in payloads, written and read by its
    ``module:qualname``.  Built-in containers and scalars are allowed
    already; register other factories in writer and reader alike."""
    name = qualified_or_none(factory)
    if name is None or resolve_imported(name) is not factory:
        raise ValueError(f"default_factory {factory!r} must be a named "
                         "module-level callable")
    if DEFAULT_FACTORIES.get(name) is not factory:
        DEFAULT_FACTORIES[name] = factory
        _factory_changes[0] += 1


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
    name = qualified_or_none(factory)
    if name is None or DEFAULT_FACTORIES.get(name) is not factory:
        raise EncodeError(
            f"defaultdict default_factory {factory!r} is not registered "
            "(jaxcolo.register_default_factory)", path)
    return name
