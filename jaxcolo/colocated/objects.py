"""``colocated_python_class(cls)``: objects that live on the hosts.

Constructing the wrapper records the constructor arguments and nothing else.
Each method is a colocated function whose programs are *method* programs:
their body is the pickled ``(cls, init args, init kwargs)`` and they name the
instance id and the method.  An executor creates the host instance from that
body at the first method call that reaches a host, keeps it across calls, and
drops it once the wrapper, its copies and every method taken from them are
gone (``destroy_instance``, given to every executor that ran one of its
methods, in the lane of the thread dropping the last reference; executors
destroy it after the calls of it still in flight, in any lane; a call that
timed out is no longer in flight: it may still run after the destroy, and
fails there).  An
instance kept in a reference cycle goes when the cycle is collected.
``copy.copy`` gives another handle on the same host instance; deep copies
and pickling are refused (TypeError): the host state cannot follow.  A
wrapper deleted before any method call never creates a host instance.
"""

from __future__ import annotations

import inspect
import secrets
import threading
import weakref

from jaxcolo.colocated.body import dumps_body
from jaxcolo.colocated.executor import current_lane
from jaxcolo.colocated.function import ColocatedFunction, Specialization, \
    _source_info

# not made colocated methods: the wrapper's own protocol methods
_SKIPPED = ("__init__", "__del__", "__reduce__", "__reduce_ex__", "__copy__",
            "__deepcopy__", "__getstate__", "__setstate__")
_NOT_COPYABLE = ("a colocated_python_class {0!r} instance lives on its hosts "
                 "and cannot be {1} (its host state cannot follow); make a "
                 "new instance from the constructor arguments, or use "
                 "copy.copy for another handle on the same instance")


class HostInstances:
    """Where one instance may live: the executors that ran its methods,
    held weakly (an executor dropped without close() is still collected,
    and stops its workers, while instances that ran there live on).
    ``destroy`` drops it there (run once the instance state is collected)."""

    def __init__(self, instance_id: int):
        self.id = instance_id
        self._executors: list = []  # weak references
        self._last = None           # the last one's weak reference
        self._lock = threading.Lock()

    def track(self, executor) -> None:
        """Remember an executor that may hold a host instance."""
        last = self._last
        if last is not None and last() is executor:
            return
        with self._lock:
            ref = next((r for r in self._executors if r() is executor), None)
            if ref is None:
                self._executors = [r for r in self._executors
                                   if r() is not None]
                ref = weakref.ref(executor)
                self._executors.append(ref)
            self._last = ref

    def destroy(self) -> None:
        with self._lock:
            executors, self._executors, self._last = self._executors, [], None
        lane = current_lane()
        for ref in executors:
            ex = ref()
            if ex is None:  # collected: it stopped its hosts
                continue
            try:
                ex.destroy_instance(self.id, lane=lane)
            except Exception:  # a closed executor has no instances left
                pass


class InstanceState:
    """Controller-side state of one instance, shared by its wrapper (and
    shallow copies of it) and by every method taken from them.  The host
    instances are destroyed when the last of those is gone (a finalizer on
    this state, not on the wrapper: ``m = Obj().m; m(x)`` keeps the host
    instance until ``m`` is dropped)."""

    def __init__(self, cls, init_args, init_kwargs):
        self.cls = cls
        self.init_args = init_args
        self.init_kwargs = init_kwargs
        self.id = secrets.randbits(63) or 1
        self.source_info = _source_info(cls)
        self._bodies: dict[tuple, bytes] = {}  # by (version, carry)
        self._lock = threading.Lock()
        self.hosts = HostInstances(self.id)
        self.track = self.hosts.track
        weakref.finalize(self, self.hosts.destroy)

    def body(self, version: int, carry: tuple = (),
             script: tuple = ()) -> bytes:
        with self._lock:
            data = self._bodies.get((version, carry, script))
            if data is None:
                data = self._bodies[version, carry, script] = dumps_body(
                    (self.cls, self.init_args, self.init_kwargs),
                    version=version, carry=carry, script=script,
                    what=f"colocated class {self.cls.__name__!r} and its "
                         "constructor arguments")
            return data


class MethodTarget:
    """What a method program runs: ``method_name`` of the host instance."""

    kind = "method"

    def __init__(self, state: InstanceState, method_name: str, original):
        self.fn = original
        self.state = state
        self.name = f"{state.cls.__name__}.{method_name}"
        self.method_name = method_name
        self.instance_id = state.id
        self.source_info = state.source_info
        self.track = state.track

    def body(self, version: int, carry: tuple = (),
             copy: bytes | None = None, script: tuple = ()) -> bytes:
        """The instance's body (its state is the instance's, by id: the
        methods' programs need no copy token)."""
        return self.state.body(version, carry, script)


def colocated_python_class(cls: type) -> type:
    """A wrapper class whose instances run ``cls``'s methods on the hosts
    of their arguments' devices (drop-in for JAX's
    ``colocated_python_class``).  Methods may be specialised:
    ``obj.m = obj.m.specialize(devices=..., out_specs_fn=...)``."""

    class Wrapped:
        def __init__(self, /, *init_args, **init_kwargs) -> None:
            state = InstanceState(cls, init_args, init_kwargs)
            self._colocated_instance = state
            for attr in dir(cls):
                member = getattr(cls, attr)
                if not inspect.isfunction(member) or attr in _SKIPPED:
                    continue
                setattr(self, attr, ColocatedFunction(
                    MethodTarget(state, attr, member), Specialization()))

        def __copy__(self):
            """Another handle on the same host instance."""
            twin = object.__new__(type(self))
            twin.__dict__.update(self.__dict__)
            return twin

        def __deepcopy__(self, memo):
            raise TypeError(_NOT_COPYABLE.format(cls.__name__, "deep-copied"))

        def __reduce_ex__(self, protocol):
            raise TypeError(_NOT_COPYABLE.format(cls.__name__, "pickled"))

    Wrapped.__name__ = cls.__name__
    Wrapped.__qualname__ = getattr(cls, "__qualname__", cls.__name__)
    Wrapped.__module__ = cls.__module__
    Wrapped.__doc__ = cls.__doc__
    Wrapped.__wrapped__ = cls
    return Wrapped
