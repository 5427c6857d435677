"""colocated_python_class: host instances, their lifetime and methods."""

import gc

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxcolo
from tests import colocated_state as state
from tests.colocated_support import (cpu_devices, executor, get_state,  # noqa: F401
                                     pop_state, put)

NO_DEVICES = ("No devices found. colocated_python function without input "
              "arguments must be first specialized with devices.")


@pytest.fixture
def flags():
    """check(name) -> the host's value of state.<name> (False if unset)."""
    d = cpu_devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(d)

    @jaxcolo.colocated_python
    def read():
        return {k: jax.device_put(np.array(state.__dict__.get(k, False)),
                                  sharding)
                for k in ("initialized", "destroyed")}

    read = read.specialize(devices=[d])

    def check():
        return {k: bool(v) for k, v in jax.device_get(read()).items()}

    yield check
    pop_state("initialized", "destroyed", "inits")


def _object_class():
    @jaxcolo.colocated_python_class
    class Object:
        def __init__(self):
            state.initialized = True
            state.inits = state.__dict__.get("inits", 0) + 1

        def __del__(self):
            state.destroyed = True

        def echo(self, x):
            return x

    return Object


def _counter_class():
    """A colocated class counting its calls (``bump``), with a slow method;
    its host instance sets state.destroyed when it goes."""
    import time

    @jaxcolo.colocated_python_class
    class Counter:
        def __init__(self):
            self.n = 0

        def __del__(self):
            state.destroyed = True

        def bump(self, x):
            self.n += 1
            return jax.device_put(np.int32(self.n), x.sharding)

        def slow(self, x):
            time.sleep(0.5)
            return x

    return Counter


def test_instance_created_at_first_call_destroyed_with_wrapper(executor,
                                                               flags):
    Object = _object_class()
    obj = Object()
    assert flags() == {"initialized": False, "destroyed": False}
    del obj  # never called: never created
    gc.collect()
    assert flags() == {"initialized": False, "destroyed": False}

    obj = Object()
    assert flags() == {"initialized": False, "destroyed": False}
    x = put(1, cpu_devices()[0])
    assert int(obj.echo(x)) == 1
    assert flags() == {"initialized": True, "destroyed": False}
    assert int(obj.echo(x)) == 1 and get_state("inits") == 1  # created once
    del obj
    assert flags() == {"initialized": True, "destroyed": True}


def test_method_keeps_its_instance_after_the_wrapper_is_gone(executor,
                                                             flags):
    """A method taken from a wrapper keeps the host instance alive (the
    instance is created by the method's call, after the wrapper is gone)
    and drops it with the last reference."""
    Object = _object_class()
    echo = Object().echo  # the wrapper itself is collected here
    gc.collect()
    x = put(3, cpu_devices()[0])
    assert int(echo(x)) == 3 and int(echo(x)) == 3
    assert flags() == {"initialized": True, "destroyed": False}
    assert get_state("inits") == 1
    del echo
    gc.collect()
    assert flags() == {"initialized": True, "destroyed": True}


def test_copies_share_the_instance_deep_copies_are_refused(executor, flags):
    import copy
    import pickle

    x = put(0, cpu_devices()[0])
    a = _counter_class()()
    assert int(a.bump(x)) == 1
    b = copy.copy(a)
    assert type(b) is type(a) and int(b.bump(x)) == 2  # the same instance
    for how, fn in (("deep-copied", copy.deepcopy), ("pickled", pickle.dumps)):
        with pytest.raises(TypeError, match=rf"^a colocated_python_class "
                           rf"'Counter' instance lives on its hosts and "
                           rf"cannot be {how} "):
            fn(a)
    # A method copies as a function does: itself (a structure holding
    # obj.bump can be deep-copied; it raised TypeError).
    bump = a.bump
    assert copy.copy(bump) is bump and copy.deepcopy([bump])[0] is bump
    del a, bump
    gc.collect()
    assert int(b.bump(x)) == 3  # the copy keeps it alive
    assert not flags()["destroyed"]
    del b
    gc.collect()
    assert flags()["destroyed"]


def test_instance_dropped_by_another_thread_finishes_queued_calls(executor,
                                                                  flags):
    """Calls submitted by one thread complete although another thread drops
    the last reference while they are queued; then the instance goes."""
    import threading
    import time

    x = put(7, cpu_devices()[0])
    obj = _counter_class()()
    first, second = obj.slow.submit(x), obj.bump.submit(x)
    box = [obj]
    del obj
    dropper = threading.Thread(target=box.clear)
    dropper.start()
    dropper.join()
    gc.collect()
    assert int(first.result(30)) == 7 and int(second.result(30)) == 1
    deadline = time.monotonic() + 10
    while not flags()["destroyed"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _programs_held(ex) -> list:
    """Programs an executor holds now (each process host: registered and
    loaded; and its controller's plans)."""
    st = ex.stats()
    if "hosts" not in st:
        return [st["programs_loaded_now"]]
    return [len(ex._plans)] + [h[k] for h in st["hosts"]
                               for k in ("programs_registered_now",
                                         "programs_loaded_now")]


def _make_and_drop(Object, x, n: int) -> None:
    """``n`` instances of ``Object``, each made, called once and dropped."""
    for _ in range(n):
        obj = Object()
        assert int(obj.echo(x)) == 1
        del obj
        gc.collect()


def _collect_and_call(x):
    """Collect dropped instances, then make a call: it sends their queued
    destroys first."""
    gc.collect()
    f = jaxcolo.colocated_python(lambda v: v).specialize(
        out_specs_fn=lambda v: v)
    assert int(f(x)) == int(x)


def test_dropped_instances_leave_no_programs_behind(executor):
    """Every instance has programs of its own (its id is in them): they go
    with the instance, or a long-running executor grows without end."""
    Object = _object_class()
    x = put(1, cpu_devices()[0])
    warm = Object()
    assert int(warm.echo(x)) == 1
    del warm
    _collect_and_call(x)
    before = _programs_held(executor)
    _make_and_drop(Object, x, 20)
    _collect_and_call(x)
    assert _programs_held(executor) == before


def test_program_of_a_destroyed_instance_is_refused(executor):
    """A method's program kept past its instance's destroy (the Executor
    API allows it) fails clearly and is not held again."""
    Object = _object_class()
    x = put(1, cpu_devices()[0])
    obj = Object()
    assert int(obj.echo(x)) == 1
    (sp,) = obj.echo._cache.values()
    ref = sp.program(executor.payload_version)
    del obj, sp
    _collect_and_call(x)
    keep = jaxcolo.colocated_python(lambda v: v + 0).specialize(
        out_specs_fn=lambda v: v)
    assert int(keep(x)) == 1  # (the call above's function is forgotten)
    before = _programs_held(executor)
    for _ in range(3):
        with pytest.raises(jaxcolo.ExecutorError, match="already destroyed"):
            executor.call(ref, [x], lane=1)
    assert _programs_held(executor) == before

def test_stateful_object(executor):
    @jaxcolo.colocated_python_class
    class Value:
        def __init__(self, initial):
            self.value = initial

        def add(self, x):
            self.value += np.asarray(x)
            return jax.device_put(self.value, x.sharding)

        def fetch_like(self, x):
            return jax.device_put(self.value, x.sharding)

    value = Value(np.array(5))
    other = Value(np.array(100))  # instances do not share state
    x = put(1, cpu_devices()[0])
    assert int(value.add(x)) == 6
    assert int(value.add(x)) == 7
    assert int(other.add(x)) == 101
    assert int(value.fetch_like(x)) == 7
    assert type(value).__name__ == "Value"


def test_object_with_captured_sharding(executor):
    devs = cpu_devices()
    mesh = Mesh(devs[0:2], "x")
    sharding1 = NamedSharding(mesh, P())
    sharding2 = NamedSharding(mesh, P("x"))

    @jaxcolo.colocated_python_class
    class Value:
        def __init__(self, initial):
            self.value = initial
            self.sharding1 = sharding1
            self.sharding2 = sharding2

        def add_sharding1(self, x):
            self.value += np.asarray(x)
            return jax.device_put(self.value, self.sharding1)

        def add_sharding2(self, x):
            self.value += np.asarray(x)
            return jax.device_put(self.value, self.sharding2)

    value = Value(np.array([5, 15]))
    x = jax.device_put(np.array([1]), NamedSharding(mesh, P()))
    out = value.add_sharding1(x)
    assert out.sharding == sharding1
    np.testing.assert_array_equal(jax.device_get(out), [6, 16])
    out = value.add_sharding2(x)
    assert out.sharding == sharding2
    np.testing.assert_array_equal(jax.device_get(out), [7, 17])


def test_method_specialisation(executor):
    devs = cpu_devices()[:1]
    sharding = jax.sharding.SingleDeviceSharding(devs[0])

    @jaxcolo.colocated_python_class
    class Object:
        def __init__(self, sharding):
            self.sharding = sharding

        def fetch_with_devices(self):
            return jax.device_put(np.array(1, dtype=np.int32), self.sharding)

        def fetch_with_output_spec(self):
            return jax.device_put(np.array(2, dtype=np.int32), self.sharding)

    obj = Object(sharding)
    for method in (obj.fetch_with_devices, obj.fetch_with_output_spec):
        with pytest.raises(ValueError, match=NO_DEVICES.replace(".", r"\.")):
            method()
    obj.fetch_with_devices = obj.fetch_with_devices.specialize(devices=devs)
    assert int(obj.fetch_with_devices()) == 1
    obj.fetch_with_output_spec = obj.fetch_with_output_spec.specialize(
        devices=devs, out_specs_fn=lambda: jax.ShapeDtypeStruct(
            shape=(), dtype=np.int32, sharding=sharding))
    assert int(obj.fetch_with_output_spec()) == 2
    # out_specs_fn: no discovery program was built.
    progs = obj.fetch_with_output_spec.programs()
    assert len(progs) == 1
    info = jaxcolo.inspect(progs[0].payload)
    assert info["kind"] == "method" and info["method_name"] == \
        "fetch_with_output_spec"
    assert info["name"] == "Object.fetch_with_output_spec"


def test_methods_submit_in_order(executor):
    @jaxcolo.colocated_python_class
    class Log:
        def __init__(self):
            self.items = []

        def add(self, x):
            self.items.append(int(np.asarray(x)))
            return x

        def total(self, x):
            return jax.device_put(np.int32(sum(self.items)), x.sharding)

    log = Log()
    log.add = log.add.specialize(out_specs_fn=lambda x: x)
    d = cpu_devices()[0]
    futs = [log.add.submit(put(np.int32(i), d)) for i in range(20)]
    assert int(log.total(put(np.int32(0), d))) == sum(range(20))
    assert [int(f.result(10)) for f in futs] == list(range(20))


class _BadInit:
    def __init__(self):
        self.buf = bytearray(1 << 20)
        raise ValueError("bad config")

    def f(self, x):
        return x


def test_instances_whose_init_failed_are_destroyed(executor):
    """The executor kept __init__'s error and raised it again at each call:
    each raise added its callers' frames to it, and they led back to the
    instance's wrapper, which then never destroyed the instance (its
    programs and half-built object stayed until close)."""
    Bad = jaxcolo.colocated_python_class(_BadInit)
    x = put(1, cpu_devices()[0])
    _collect_and_call(x)
    before = _programs_held(executor)
    for _ in range(3):
        bad = Bad()
        for _ in range(2):
            with pytest.raises(ValueError, match="bad config") as info:
                bad.f(x)
        assert any(n.startswith("Traceback of __init__") and
                   "in __init__" in n for n in info.value.__notes__)
        del bad, info
        gc.collect()
    _collect_and_call(x)
    assert _programs_held(executor) == before


def test_init_errors_reach_the_caller(executor):
    @jaxcolo.colocated_python_class
    class Broken:
        def __init__(self):
            raise KeyError("no init")

        def f(self, x):
            return x

    b = Broken()
    with pytest.raises(KeyError, match="no init"):
        b.f(put(1, cpu_devices()[0]))


def test_init_errors_keep_their_message(executor):
    """An __init__ error was copied for each call by calling its class's
    __init__ with its args again: one formatting its argument made
    'missing config key "missing config key 'lr'"'."""
    from tests import colocated_types as ct
    model = jaxcolo.colocated_python_class(ct.NeedsLr)()
    for _ in range(2):
        with pytest.raises(ct.MissingKey) as info:
            model.step(put(1, cpu_devices()[0]))
        assert str(info.value) == "missing config key 'lr'"
        assert info.value.args == ("missing config key 'lr'",)
        assert info.value.key == "lr"


def test_destroyed_instance_ids_are_remembered_within_a_bound(executor):
    """Executors remembered every destroyed instance id for their life (a
    set growing by one per instance made and dropped in a loop); they keep
    the newest ones, and a refused call of the newest still fails."""
    from jaxcolo.colocated.recent import MAX_REMEMBERED, RecentSet
    assert isinstance(executor._destroyed, RecentSet)
    assert executor._destroyed.maxlen == MAX_REMEMBERED
    small = RecentSet(4)
    small.update(range(10))
    assert len(small) == 4 and 9 in small and 5 not in small
    small.add(6)  # re-added: the newest again
    small.add(10)
    assert 6 in small and 7 not in small
    Object = _object_class()
    x = put(1, cpu_devices()[0])
    before = len(executor._destroyed)
    _make_and_drop(Object, x, 3)
    _collect_and_call(x)
    assert len(executor._destroyed) >= before + 3  # (and earlier tests')
