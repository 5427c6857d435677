"""Program bodies: the one place jaxcolo uses (cloud)pickle.

A body is the user's function (or ``(class, init args, init kwargs)``)
pickled with cloudpickle, except that objects naming concrete devices --
meshes, shardings, device lists, devices -- are not pickled: each becomes a
jaxcolo spec payload (device ids), decoded on load through the *loading*
executor's device resolver.  So a body that captures a mesh runs on a host
whose devices have other ids, and a captured mesh naming a device the executor
lacks fails at load with a PayloadError naming the device id.

Modules are pickled by reference (cloudpickle's rule for importable modules),
so a module holding unpicklable state is never pickled along with a function,
and module state written by one call is visible to the next on the same host.

A body may *carry* types: the pytree node types of its program's arguments
that live in importable modules, pickled by reference beside the function
(``operator.getitem((fn, *types), 0)``: loading it, by any jaxcolo, gives the
function and imports the modules, which register the types there -- as JAX's
pickled treedefs do), and the plain namedtuples of the user's script,
pickled by value with their methods, in a pickle of their own (marked
:data:`SCRIPT_TYPES`; a body loads, and runs, also where they do not).  A
worker whose payload names a node type it has not registered, or a class
of the controller's script, loads the body for that (keeping what it
carries, :func:`loads_body_carried`) and decodes again.

A function's body may carry a *copy token* the same way (random bytes, one
per specialisation): equal functions then make distinct programs, so each
specialisation runs its own copy of the function and of what it captured,
as in JAX.
"""

from __future__ import annotations

import contextlib
import functools
import io
import operator
import pickle
import sys
import threading
import types

import cloudpickle
import jax
from jax._src.lib import xla_client as xc

from jaxcolo.codec import spec_tree
from jaxcolo.codec.mesh import make_resolver
from jaxcolo.codec.names import plain_namedtuple
from jaxcolo.errors import PayloadError

_DEVICE_SPEC_TYPES = (jax.sharding.Mesh, jax.sharding.NamedSharding,
                      jax.sharding.SingleDeviceSharding, xc.DeviceList,
                      xc.Device)
try:
    from jax._src.sharding_impls import GSPMDSharding
    _DEVICE_SPEC_TYPES += (GSPMDSharding,)
except ImportError:  # pragma: no cover - older/newer JAX
    pass

_loading = threading.local()  # .resolver while loads_body runs


def _load_spec(payload: bytes):
    """Unpickling hook: a spec payload, resolved by the loading executor."""
    resolver = getattr(_loading, "resolver", None) or make_resolver(None)
    try:
        return spec_tree.decode_spec_tree(payload, resolver)
    except PayloadError as e:
        raise PayloadError(
            f"the body captures a mesh, sharding or device that this executor "
            f"cannot resolve: {e.reason}", "$.body" + e.path[1:]) from None


class _BodyPickler(cloudpickle.Pickler):
    version: int | None = None

    def reducer_override(self, obj):
        if isinstance(obj, _DEVICE_SPEC_TYPES):
            return _load_spec, (spec_tree.encode_spec_tree(obj, self.version),)
        if type(obj) is types.CodeType:
            return self._code_with_its_filename(obj)
        return super().reducer_override(obj)

    def _code_with_its_filename(self, code):
        """Code pickled by value keeps its file name (cloudpickle from 3.1.3
        writes ``<dynamic-code>``): a host's traceback of the function then
        names the file and, where the host has it, shows the source lines.
        Loads with the standard library alone (``CodeType.replace``), so
        any jaxcolo and cloudpickle read it."""
        reduce = self.dispatch_table.get(types.CodeType)
        if reduce is None:  # pragma: no cover - a cloudpickle without one
            return NotImplemented
        constructor, args = reduce(code)
        return (functools.partial(types.CodeType.replace,
                                  co_filename=code.co_filename),
                (PicklesAs((constructor, args)),))


class PicklesAs:
    """Pickles as the reduction ``reduced`` (``(constructor, args, ...)``,
    as ``__reduce__`` returns): lets a reducer wrap an object's own
    reduction in another without pickling the object twice."""

    __slots__ = ("reduced",)

    def __init__(self, reduced: tuple):
        self.reduced = reduced

    def __reduce__(self):
        return self.reduced


class _Carrying:
    """``value`` pickled with ``types`` (by reference), ``copy`` (bytes or
    None) and ``script`` (a pickle of the script's classes, or None);
    loads as ``value``."""

    __slots__ = ("value", "types", "copy", "script")

    def __init__(self, value, types, copy=None, script=None):
        self.value, self.types, self.copy = value, types, copy
        self.script = script

    def __reduce__(self):
        extra = (self.copy,) if self.copy is not None else ()
        if self.script is not None:  # (b"": they did not pickle)
            extra += ((SCRIPT_TYPES, self.script),)
        return operator.getitem, ((self.value, *self.types, *extra), 0)


# Marks the pickle of the script's classes among what a body carries.
SCRIPT_TYPES = "jaxcolo:script-types"


_PLAIN_NODES = (tuple, list, dict, type(None))


def types_to_carry(treedef) -> tuple[tuple, tuple]:
    """The node types of ``treedef`` a body carries, in first-seen order:
    (those (custom nodes, namedtuples) defined in an importable module other
    than ``__main__``, pickled by reference: a worker imports them; the
    plain namedtuples of the user's script, ``__main__``, pickled by value
    with their methods, on their own: a worker finds them by name among
    what a body carries, and one it cannot load costs only itself).  A
    script's custom nodes are not carried: pickled by value, they would
    lack their registration."""
    by_reference: dict = {}
    by_value: dict = {}
    stack = [treedef]
    while stack:
        t = stack.pop()
        data = t.node_data()
        if data is not None and data[0] not in _PLAIN_NODES and \
                data[0] not in by_reference and data[0] not in by_value:
            if _importable(data[0]):
                by_reference[data[0]] = None
            elif _script_namedtuple(data[0]):
                by_value[data[0]] = None
        stack.extend(reversed(t.children()))
    return tuple(by_reference), tuple(by_value)


def _script_namedtuple(cls) -> bool:
    """A plain namedtuple class of the user's script (not registered for
    serialization: such a one travels under its registered name)."""
    from jax._src.export import _export as jexport
    return getattr(cls, "__module__", None) == "__main__" and \
        plain_namedtuple(cls) and cls not in jexport.serialization_registry


def _importable(cls) -> bool:
    module = getattr(cls, "__module__", None)
    if module in (None, "__main__", "builtins", "collections"):
        return False
    obj = sys.modules.get(module)
    for part in getattr(cls, "__qualname__", "<").split("."):
        obj = getattr(obj, part, None)
    return obj is cls


def dumps_body(obj, *, version: int | None = None, what: str = "body",
               carry: tuple = (), copy: bytes | None = None,
               script: tuple = ()) -> bytes:
    """Pickle ``obj`` as a program body (spec objects as spec payloads),
    carrying the types ``carry``, the token ``copy`` and the script's
    classes ``script`` (see the module docstring; left out if they do not
    pickle: a worker then makes namedtuples of their names and fields).

    Pickling errors propagate with their own type and a note naming ``what``.
    """
    script_pickle = None
    if script:
        try:
            script_pickle = _pickled(script, version)
        except Exception:  # noqa: BLE001 - not carried: a worker
            script_pickle = b""  # makes namedtuples of their names
    try:
        return _pickled(_Carrying(obj, carry, copy, script_pickle)
                        if carry or copy or script_pickle is not None
                        else obj, version)
    except Exception as e:
        e.add_note(f"jaxcolo: while pickling {what}")
        raise


def _pickled(obj, version: int | None) -> bytes:
    """``obj`` pickled as bodies are (spec objects as spec payloads)."""
    with io.BytesIO() as f:
        p = _BodyPickler(f)
        p.version = version
        p.dump(obj)
        return f.getvalue()


@contextlib.contextmanager
def _resolving(device_resolver):
    """Unpickled spec objects resolve through ``device_resolver`` here."""
    previous = getattr(_loading, "resolver", None)
    _loading.resolver = make_resolver(device_resolver)
    try:
        yield
    finally:
        _loading.resolver = previous


def loads_body(data: bytes, device_resolver=None):
    """Unpickle a body; captured spec objects resolve through
    ``device_resolver`` (same forms as ``jaxcolo.deserialize``'s)."""
    with _resolving(device_resolver):
        return cloudpickle.loads(data)


class _CarriedUnpickler(pickle.Unpickler):
    """Unpickles a body, keeping what ``operator.getitem`` was given (the
    tuples a body carries beside its value)."""

    def __init__(self, file):
        super().__init__(file)
        self.carried: list = []

    def find_class(self, module, name):
        if name == "getitem" and module in ("_operator", "operator"):
            return self._getitem
        return super().find_class(module, name)

    def _getitem(self, obj, key):
        self.carried.append(obj)
        return operator.getitem(obj, key)


def loads_body_carried(data: bytes) -> tuple:
    """``(value, carried, marked)``: a body unpickled (as ``loads_body``
    with no resolver); what it carries (see the module docstring): the
    tuples it carries, and the script's classes, those that load here; and
    whether it carries (or meant to carry) the script's classes."""
    with _resolving(None):
        with io.BytesIO(data) as f:
            u = _CarriedUnpickler(f)
            value = u.load()
        carried, marked = list(u.carried), False
        for t in u.carried:
            for x in t:
                if type(x) is tuple and len(x) == 2 and \
                        x[0] == SCRIPT_TYPES and type(x[1]) is bytes:
                    marked = True
                    try:
                        carried.append(cloudpickle.loads(x[1]))
                    except Exception:  # noqa: BLE001 - not loadable here:
                        pass  # namedtuples of its names are made instead
        return value, tuple(carried), marked
