"""The colocated_python API: calls, specialisation, devices, errors.

Behaviour as users know it from jax.experimental.colocated_python (JAX
0.10.2), on real CPU devices, under every executor (colocated_support).
"""

import concurrent.futures
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, \
    SingleDeviceSharding

import jaxcolo
from tests import colocated_state
from tests.colocated_support import (cpu_devices, executor, pop_state,  # noqa: F401
                                     put, set_state, signatures)

NO_DEVICES = ("No devices found. colocated_python function without input "
              "arguments must be first specialized with devices.")


def add_one_tree(x):
    return jax.tree.map(lambda v: v + 1, x)


def test_simple_function(executor):
    f = jaxcolo.colocated_python(add_one_tree)
    x = put(1, cpu_devices()[0])
    out = f(x)
    assert isinstance(out, jax.Array) and int(out) == 2
    assert out.sharding == x.sharding
    assert int(f(x)) == 2
    assert signatures(f) == 1


def test_tree_in_and_out(executor):
    f = jaxcolo.colocated_python(add_one_tree)
    x = jax.device_put([np.array(1), (np.array(2), {"v": np.array(3)})],
                       jax.sharding.SingleDeviceSharding(cpu_devices()[0]))
    out = jax.device_get(f(x))
    assert out == [2, (3, {"v": 4})]
    assert jax.device_get(f(x)) == [2, (3, {"v": 4})]


def test_kwargs_and_args_keep_their_places(executor):
    f = jaxcolo.colocated_python(lambda a, *, b: {"diff": a - b})
    d = cpu_devices()[0]
    out = f(put(10, d), b=put(3, d))
    assert int(out["diff"]) == 7


def test_a_parameter_named_self_is_a_keyword_like_any(executor):
    """f(x, self=y) raised TypeError (multiple values for 'self'): the
    wrapper's own first parameter took the name; JAX's takes *args,
    **kwargs only."""
    f = jaxcolo.colocated_python(lambda x, self: x + self)
    d = cpu_devices()[0]
    assert int(f(put(1, d), self=put(2, d))) == 3
    assert int(f.submit(put(1, d), self=put(5, d)).result(30)) == 6


def test_submit_delivers_call_errors_in_the_future_every_time(executor):
    """The same failure (a body that cannot be pickled; a closed executor)
    came in the Future on a first call, which discovers output specs, but
    was raised by submit() itself once specs were known."""
    import threading
    lock = threading.Lock()
    d = cpu_devices()[0]
    plain = jaxcolo.colocated_python(lambda x: (lock, x)[1])
    known = jaxcolo.colocated_python(lambda x: (lock, x)[1]).specialize(
        out_specs_fn=lambda s: s)
    kinds = {type(f.submit(put(1, d)).exception(10)) for f in (plain, known)}
    assert len(kinds) == 1 and issubclass(kinds.pop(), TypeError)
    ok = jaxcolo.colocated_python(lambda x: x).specialize(
        out_specs_fn=lambda s: s)
    assert int(ok(put(1, d))) == 1
    with jaxcolo.InlineExecutor() as closed:
        pass
    with jaxcolo.use_executor(closed):
        for f in (ok, jaxcolo.colocated_python(lambda x: x)):
            assert isinstance(f.submit(put(1, d)).exception(10),
                              jaxcolo.ExecutorError)


def test_no_input_needs_devices(executor):
    @jaxcolo.colocated_python
    def make_zero():
        return jnp.array(0)

    with pytest.raises(ValueError, match="^" + NO_DEVICES.replace(".", r"\.")):
        make_zero()
    make_zero = make_zero.specialize(devices=cpu_devices()[:1])
    assert int(make_zero()) == 0 and int(make_zero()) == 0
    assert signatures(make_zero) == 1


def test_input_polymorphism_one_program_per_signature(executor):
    f = jaxcolo.colocated_python(add_one_tree)
    d = cpu_devices()[0]
    x = put(1, d)
    assert int(f(x)) == 2 and int(f(x)) == 2
    assert signatures(f) == 1
    tree = jax.device_put([np.array(1), (np.array(2), {"v": np.array(3)})], d)
    assert jax.device_get(f(tree)) == [2, (3, {"v": 4})]
    assert jax.device_get(f(tree)) == [2, (3, {"v": 4})]
    assert signatures(f) == 2
    # Other shape, dtype, sharding: each a new signature.
    f(put(np.ones(3), d))
    f(put(np.int8(1), d))
    f(put(1, cpu_devices()[1]))
    assert signatures(f) == 5
    # Equal sharding, new object (slow cache hit): no new program.
    f(jax.device_put(np.array(5), jax.sharding.SingleDeviceSharding(d)))
    assert signatures(f) == 5


_SCALE = 2


def test_each_specialisation_pickles_the_function_anew(executor):
    """As in JAX, a new signature or specialize() copy pickles the function
    again: a global it captures by value is the one of that moment (the
    first pickle was reused, so the change was never seen)."""
    global _SCALE
    _SCALE = 2

    def scaled(x):  # nested: pickled by value, with the globals it reads
        return x * _SCALE
    f = jaxcolo.colocated_python(scaled)
    d = cpu_devices()[0]
    try:
        assert int(f(put(np.int32(1), d))) == 2
        _SCALE = 10
        assert float(f(put(np.float32(1), d))) == 10.0
        assert int(f(put(np.int32(1), d))) == 2  # its own copy: as of then
        g = f.specialize(out_specs_fn=lambda x: x)
        assert int(g(put(np.int16(1), d))) == 10
    finally:
        _SCALE = 2


def test_each_specialisation_runs_its_own_copy(executor):
    """Two specialisations of one function (or the function and one), with
    the same signature, made one program and shared one host copy of the
    function and what it captured: a counter in each counted on from the
    other's ([1, 2, 3, 4] where JAX gives [1, 1, 2, 2])."""
    def run(with_specs):
        calls = [0]

        def count(x):
            calls[0] += 1
            return x * calls[0]
        f = jaxcolo.colocated_python(count)
        a = f.specialize(out_specs_fn=lambda x: x)
        b = f.specialize(out_specs_fn=lambda x: x) if with_specs else \
            f.specialize(devices=cpu_devices()[:1])
        x = put(np.float32(1), cpu_devices()[0])
        return [float(g(x)) for g in (a, b, a, b)]
    assert run(True) == [1, 1, 2, 2]
    # (b discovers its outputs in a copy of its own, then runs another)
    assert run(False) == [1, 1, 2, 1]  # JAX 0.10.2 gives these too


def test_the_function_s_attributes_are_the_wrapper_s(executor):
    """As JAX's wrapper does, a colocated function and its specialisations
    have the attributes of the function they wrap."""
    def tagged(x):
        return x
    tagged.tag = "registered"
    f = jaxcolo.colocated_python(tagged)
    assert f.tag == "registered"
    assert f.specialize(devices=cpu_devices()[:1]).tag == "registered"
    assert f.__wrapped__ is tagged and f.__name__ == "tagged"


def test_out_specs_fn_skips_discovery(executor):
    calls = []

    def out_specs(x):
        calls.append(x)
        return x

    f = jaxcolo.colocated_python(add_one_tree).specialize(out_specs_fn=out_specs)
    x = put(1, cpu_devices()[0])
    assert int(f(x)) == 2 and int(f(x)) == 2
    assert len(calls) == 1
    assert calls[0] == jax.ShapeDtypeStruct((), jnp.int32, sharding=x.sharding)
    progs = f.programs()
    assert len(progs) == 1  # no discovery program
    assert jaxcolo.inspect(progs[0].payload)["out_specs"]["num_leaves"] == 1
    tree = jax.device_put([np.array(1), np.array(2.0)], cpu_devices()[0])
    assert jax.device_get(f(tree)) == [2, 3.0]
    assert len(calls) == 2


def _returns_none(x):
    return None


def test_out_specs_fn_returning_none_is_known_specs(executor):
    """None is the output spec of a function returning nothing (as in JAX:
    a known, empty output): it was taken for no out_specs_fn, so the first
    call ran a discovery and an output not matching None was accepted."""
    x = put(1, cpu_devices()[0])
    f = jaxcolo.colocated_python(_returns_none).specialize(
        out_specs_fn=lambda x: None)
    assert f(x) is None and f.submit(x).result(timeout=60) is None
    assert len(f.programs()) == 1  # no discovery program
    assert jaxcolo.inspect(f.programs()[0].payload)["out_specs"][
        "num_leaves"] == 0
    g = jaxcolo.colocated_python(lambda x: x).specialize(
        out_specs_fn=lambda x: None)
    with pytest.raises(ValueError, match=r"output structure PyTreeDef\(\*\) "
                                         r"does not match.*PyTreeDef\(None\)"):
        g(x)


def test_discovery_runs_once_per_signature(executor):
    # The body is pickled by value: host-side state lives in a module.

    @jaxcolo.colocated_python
    def g(x):
        colocated_state.runs += 1
        return x * 2

    @jaxcolo.colocated_python
    def runs(x):
        return jax.device_put(np.int32(colocated_state.runs), x.sharding)

    x = put(3, cpu_devices()[0])
    set_state(runs=0)
    try:
        assert g.programs() == []
        assert int(g(x)) == 6
        assert int(runs(x)) == 1  # the discovery call is the call
        outs = [jaxcolo.inspect(p.payload)["out_specs"] for p in g.programs()]
        assert isinstance(outs[0], str) and outs[1]["num_leaves"] == 1
        assert int(g(x)) == 6 and int(runs(x)) == 2
    finally:
        pop_state("runs")


def test_specialize_twice_is_an_error():
    f = jaxcolo.colocated_python(add_one_tree)
    devs = cpu_devices()[:1]
    spec = jax.ShapeDtypeStruct((), jnp.int32)
    g = f.specialize(in_specs=((spec,), {}), out_specs_fn=lambda x: x,
                     devices=devs)
    with pytest.raises(ValueError, match="^in_specs already specified$"):
        g.specialize(in_specs=((spec,), {}))
    with pytest.raises(ValueError, match="^out_specs_fn already specified$"):
        g.specialize(out_specs_fn=lambda x: x)
    with pytest.raises(ValueError, match="^devices already specified$"):
        g.specialize(devices=devs)
    # Specialising other fields of a partial specialisation is fine.
    f.specialize(devices=devs).specialize(out_specs_fn=lambda x: x)


def test_in_specs_pin_the_signature(executor):
    d = cpu_devices()[0]
    spec = jax.ShapeDtypeStruct((2,), jnp.float32,
                                sharding=jax.sharding.SingleDeviceSharding(d))
    f = jaxcolo.colocated_python(lambda x: x + 1).specialize(
        in_specs=((spec,), {}))
    x = put(np.array([1.0, 2.0], np.float32), d)
    np.testing.assert_array_equal(f(x), [2.0, 3.0])
    np.testing.assert_array_equal(f(put(np.array([0.0, 0.0], np.float32), d)),
                                  [1.0, 1.0])
    with pytest.raises(ValueError, match=r"argument 0 does not match the "
                                         r"specialized in_specs.*shape=\(3,\)"):
        f(put(np.zeros(3, np.float32), d))
    with pytest.raises(ValueError, match="do not match the specialized"):
        f(x, x)
    assert signatures(f) == 1


def test_in_specs_without_sharding_take_each_call_s_sharding(executor):
    """A sharding-less in_spec pins shape and dtype only: each argument
    sharding gets its own specialisation (a later call with another
    sharding or device was packed under the first call's: wrong data)."""
    devs = cpu_devices()
    mesh = Mesh(np.array(devs[:4]), ("x",))
    f = jaxcolo.colocated_python(lambda x: x).specialize(
        in_specs=((jax.ShapeDtypeStruct((4, 4), jnp.float32),), {}))
    data = np.arange(16, dtype=np.float32).reshape(4, 4)
    for spec in (P("x", None), P(None, "x"), P("x", None)):
        x = put(data, NamedSharding(mesh, spec))
        out = f(x)
        assert out.sharding == x.sharding
        np.testing.assert_array_equal(out, data)
    g = jaxcolo.colocated_python(lambda x: x * 2).specialize(
        in_specs=((jax.ShapeDtypeStruct((1,), jnp.float32),), {}))
    for d in (devs[0], devs[5], devs[0]):
        out = g(put(np.array([3.0], np.float32), d))
        assert out.sharding == jax.sharding.SingleDeviceSharding(d)
        np.testing.assert_array_equal(out, [6.0])
    assert signatures(f) == 2 and signatures(g) == 2


def test_in_specs_with_devices_check_the_arguments_devices(executor):
    devs = cpu_devices()
    f = jaxcolo.colocated_python(lambda x: x).specialize(
        in_specs=((jax.ShapeDtypeStruct((1,), jnp.float32),), {}),
        devices=devs[:2])
    np.testing.assert_array_equal(f(put(np.array([1.0], np.float32),
                                        devs[1])), [1.0])
    with pytest.raises(ValueError, match=r"input 0 lives on devices \[5\] "
                                         r"outside the function's devices"):
        f(put(np.array([1.0], np.float32), devs[5]))


def test_weak_types_travel(executor):
    """A weakly typed argument stays weak where the function runs (so it
    promotes as it does in-process) and a weak result comes back weak."""
    d = cpu_devices()[0]
    w = jax.device_put(2.0, d)
    assert w.weak_type
    f = jaxcolo.colocated_python(lambda a, b: (a + b, a * 2))
    total, doubled = f(w, put(np.ones(3, jnp.bfloat16), d))
    assert total.dtype == jnp.bfloat16 and not total.weak_type
    assert doubled.weak_type and float(doubled) == 4.0
    strong = put(np.float32(2.0), d)
    total, doubled = f(strong, put(np.ones(3, jnp.bfloat16), d))
    assert total.dtype == jnp.float32 and not doubled.weak_type
    assert signatures(f) == 2


def test_calls_sharing_one_sharding_object_keep_their_signatures(executor):
    """The fast signature key is the ids of each argument's aval (JAX
    interns them) and sharding: arrays on one sharding object that differ
    in weak type, shape or dtype are distinct signatures, called in any
    order."""
    s = jax.sharding.SingleDeviceSharding(cpu_devices()[0])
    weak = jax.device_put(jnp.asarray(2.0), s)
    strong = jax.device_put(np.float32(2.0), s)
    vec = jax.device_put(np.ones(3, np.float32), s)
    ints = jax.device_put(np.int32(2), s)
    assert weak.weak_type and not strong.weak_type
    assert weak.sharding is strong.sharding is vec.sharding is s
    f = jaxcolo.colocated_python(lambda a: a * 2)
    for _ in range(2):
        for x in (weak, strong, vec, ints, strong, weak):
            out = f(x)
            assert out.weak_type == x.weak_type
            assert out.shape == x.shape and out.dtype == x.dtype
            np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 2)
    assert signatures(f) == 4


def test_weak_types_under_specialize(executor):
    """out_specs_fn gets strong specs, as in JAX (a weak spec made a strong
    result weak on a process executor), and an argument matching pinned
    in_specs keeps its own weak type (a weak one arrived strong, or its
    specialisation's discovered specs refused the strong one)."""
    d = cpu_devices()[0]
    w, s = jax.device_put(3, d), put(np.int32(3), d)
    assert w.weak_type and not s.weak_type
    seen = []

    def out_specs(x):
        seen.append(x.weak_type)
        return x
    f = jaxcolo.colocated_python(lambda x: x * jnp.int32(2)).specialize(
        out_specs_fn=out_specs)
    y = f(w)
    assert seen == [False] and not y.weak_type
    assert (y + jnp.int8(1)).dtype == jnp.int32
    spec = jax.ShapeDtypeStruct((), jnp.int32,
                                sharding=SingleDeviceSharding(d))
    g = jaxcolo.colocated_python(lambda x: x + jnp.int8(1)).specialize(
        in_specs=((spec,), {}))
    assert g(w).dtype == jnp.int8  # promotes as a weak int32 does
    assert g(s).dtype == jnp.int32
    assert g(w).dtype == jnp.int8


def test_pinned_in_specs_keep_their_format(executor):
    """An in_spec with a concrete layout (Format) still pins calls (giving
    it the argument's weak type rebuilt it with a bare sharding, which JAX
    refuses)."""
    from jax.experimental.layout import Format, Layout
    d = cpu_devices()[0]
    spec = jax.ShapeDtypeStruct(
        (4, 4), jnp.float32,
        sharding=Format(Layout((0, 1)), SingleDeviceSharding(d)))
    f = jaxcolo.colocated_python(lambda x: x * 2).specialize(
        in_specs=((spec,), {}))
    out = f(put(np.ones((4, 4), np.float32), d))
    assert out.shape == (4, 4) and float(out[0, 0]) == 2.0


def test_non_array_inputs_are_rejected(executor):
    f = jaxcolo.colocated_python(lambda x: x)
    for bad in (np.array(1), 1, "s", jax.ShapeDtypeStruct((), jnp.int32)):
        with pytest.raises(ValueError, match="only supports jax.Array as "
                                             "input and output, but got"):
            f(bad)
    with pytest.raises(ValueError, match="only supports jax.Array"):
        f([put(1, cpu_devices()[0]), 2.0])


def test_non_array_outputs_are_rejected(executor):
    f = jaxcolo.colocated_python(lambda x: (x, np.zeros(2)))
    with pytest.raises(ValueError, match="only supports jax.Array as input "
                                         "and output, but got <class "
                                         "'numpy.ndarray'>"):
        f(put(1, cpu_devices()[0]))


def test_arrays_made_by_the_body_land_on_its_first_device(executor):
    """A body making a fresh array (``jnp.zeros``) and returning it: in a
    worker it landed on the host's first device, inline on the process's
    default device 0, so one program worked under one executor and failed
    the output check under the other.  It lands on the program's first
    device of the process running it, under every executor; an instance's
    __init__ too."""
    devs = cpu_devices()
    fresh = jaxcolo.colocated_python(lambda x: jnp.zeros(3) + 1)
    for d in (devs[0], devs[4], devs[5]):
        out = fresh(put(1, d))
        assert out.sharding == SingleDeviceSharding(d)
        np.testing.assert_array_equal(np.asarray(out), np.ones(3))

    class Keeper:
        def __init__(self):
            self.table = jnp.arange(3)

        def get(self, x):
            return self.table

    keeper = jaxcolo.colocated_python_class(Keeper)()
    assert keeper.get(put(1, devs[5])).sharding == SingleDeviceSharding(devs[5])
    with jax.default_device(devs[3]):  # the caller's default: not the body's
        assert fresh(put(1, devs[0])).sharding == SingleDeviceSharding(devs[0])


def test_an_executor_subclass_with_a_timeout_of_its_own():
    """A user's Executor whose timeout(seconds) predates timeout_left: its
    first (discovery) call with a timeout set still runs (it was a
    TypeError for an unexpected keyword)."""
    import contextlib

    class Timed(jaxcolo.InlineExecutor):
        def call_timeout(self):
            return 30.0

        def timeout(self, seconds):
            return contextlib.nullcontext(self)

    f = jaxcolo.colocated_python(lambda x: x + 1)
    with Timed() as ex, jaxcolo.use_executor(ex):
        assert int(f(put(1, cpu_devices()[0]))) == 2


def test_a_script_class_as_output_says_where_it_is_not_registered(executor):
    """A class of the user's script as an output leaf: under a worker, a
    pytree registration made in the script does not exist."""
    class Holder:
        def __init__(self, x):
            self.x = x

    Holder.__module__ = "__main__"
    f = jaxcolo.colocated_python(lambda x: Holder(x))
    hint = (r" \(a pytree node type registered in the script is not "
            r"registered in ProcessExecutor workers: register it in a "
            r"module\)")
    in_worker = isinstance(executor, jaxcolo.ProcessExecutor)
    with pytest.raises(ValueError, match=(
            r"but got <class '__main__\..*Holder'>"
            + (hint if in_worker else "") + r"\.$")):
        f(put(1, cpu_devices()[0]))
    # where no worker is involved, no registration is missing: no hint
    # (it was given for an unregistered script class as an argument too)
    with pytest.raises(ValueError,
                       match=r"but got <class '__main__\..*Holder'>\.$"):
        jaxcolo.colocated_python(lambda x, h: x)(put(1, cpu_devices()[0]),
                                                 Holder(1))


def test_tracers_are_rejected(executor):
    f = jaxcolo.colocated_python(lambda x: x)
    with pytest.raises(ValueError, match="traced values"):
        jax.jit(f)(put(1, cpu_devices()[0]))


def test_arguments_must_share_a_device_list(executor):
    f = jaxcolo.colocated_python(lambda x, y: x)
    devs = cpu_devices()
    with pytest.raises(ValueError, match="All arguments must use the same "
                                         "device list, but got multiple"):
        f(put(1, devs[0]), put(2, devs[1]))


def test_outputs_must_stay_on_the_programs_devices(executor):
    devs = cpu_devices()
    # Device 1 is on the host of device 0 under every executor (a function
    # can only place outputs on devices of the hosts it runs on).
    f = jaxcolo.colocated_python(lambda x: jax.device_put(x, devs[1]))
    with pytest.raises(ValueError, match=r"output 0 lives on devices \[1\] "
                                         r"outside the function's devices \[0\]"):
        f(put(1, devs[0]))
    g = jaxcolo.colocated_python(lambda x: x).specialize(
        out_specs_fn=lambda x: jax.ShapeDtypeStruct((), jnp.int32,
                                                    sharding=jax.sharding.SingleDeviceSharding(devs[3])))
    with pytest.raises(ValueError, match=r"outside the function's devices"):
        g(put(1, devs[0]))


def test_outputs_must_match_out_specs_fn(executor):
    d = cpu_devices()[0]
    f = jaxcolo.colocated_python(lambda x: x.astype(jnp.float32)).specialize(
        out_specs_fn=lambda x: x)
    with pytest.raises(ValueError, match=r"output 0 does not match its out "
                                         r"spec.*dtype=float32"):
        f(put(1, d))


def test_mixed_device_orders_with_devices_specialised(executor):
    devs = cpu_devices()[:2]

    @jaxcolo.colocated_python
    def add(x, y):
        arrays = [x.addressable_shards[1].data + y.addressable_shards[0].data,
                  x.addressable_shards[0].data + y.addressable_shards[1].data]
        return jax.make_array_from_single_device_arrays(y.shape, y.sharding,
                                                        arrays)

    add = add.specialize(devices=devs)
    s1 = NamedSharding(Mesh([devs[0], devs[1]], "x"), P("x"))
    s2 = NamedSharding(Mesh([devs[1], devs[0]], "x"), P("x"))
    x = jax.device_put(np.array([0, 2]), s1)
    y = jax.device_put(np.array([4, 8]), s2)
    out = add(x, y)
    assert out.sharding == s2
    assert [s.device for s in out.addressable_shards] == [devs[1], devs[0]]
    np.testing.assert_array_equal(jax.device_get(out), [2 + 4, 0 + 8])
    np.testing.assert_array_equal(jax.device_get(add(x, y)), [6, 8])


def test_specialised_devices_must_cover_the_inputs(executor):
    devs = cpu_devices()
    f = jaxcolo.colocated_python(lambda x: x).specialize(devices=devs[:2])
    with pytest.raises(ValueError, match=r"input 0 lives on devices \[4\] "
                                         r"outside the function's devices"):
        f(put(1, devs[4]))


def test_sharded_inputs_on_a_mesh(executor):
    devs = cpu_devices()
    mesh = Mesh(np.array(devs).reshape(2, 4), ("a", "b"))
    s = NamedSharding(mesh, P("a", "b"))
    x = jax.device_put(np.arange(32.0).reshape(4, 8), s)

    @jaxcolo.colocated_python
    def double(x):
        return jax.jit(lambda v: v * 2, out_shardings=x.sharding)(x)

    out = double(x)
    assert out.sharding == s
    np.testing.assert_array_equal(jax.device_get(out),
                                  np.arange(32.0).reshape(4, 8) * 2)
    assert jaxcolo.inspect(double.programs()[0].payload)["device_ids"] == \
        [d.id for d in mesh.devices.flat]


def test_exceptions_keep_their_type(executor):
    class Boom(RuntimeError):
        pass

    @jaxcolo.colocated_python
    def fail(x):
        raise Boom("from the host")

    x = put(1, cpu_devices()[0])
    with pytest.raises(Boom, match="from the host"):
        fail(x)
    with pytest.raises(Boom):  # a failed discovery is retried, not cached
        fail(x)
    fut = fail.specialize(out_specs_fn=lambda x: x).submit(x)
    with pytest.raises(Boom):
        fut.result(timeout=10)


def test_exceptions_with_their_own_init_keep_type_and_attributes(executor):
    """An exception whose __init__ takes other arguments than the args it
    stores could not be rebuilt in the caller: it came back as an
    ExecutorError."""
    from tests import colocated_types as ct

    f = jaxcolo.colocated_python(ct.raise_coded).specialize(
        out_specs_fn=lambda x: x)
    with pytest.raises(ct.Coded, match="error 7 at the host") as info:
        f(put(1, cpu_devices()[0]))
    assert (info.value.code, info.value.where) == (7, "the host")
    assert info.value.args == ("error 7 at the host",)


def test_exceptions_keep_their_cause(executor):
    """``raise ... from e``: the caller's exception has its __cause__ (the
    remote one lost it)."""
    from tests import colocated_types as ct

    f = jaxcolo.colocated_python(ct.raise_with_cause).specialize(
        out_specs_fn=lambda x: x)
    with pytest.raises(ct.Coded, match="error 3 at the lookup") as info:
        f(put(1, cpu_devices()[0]))
    cause = info.value.__cause__
    assert type(cause) is KeyError and cause.args == ("missing",)


def test_exceptions_keep_their_context(executor):
    """An exception raised while another was handled: the caller's has
    that one as its __context__, as in JAX (ProcessExecutor dropped it)."""
    from tests import colocated_types as ct

    f = jaxcolo.colocated_python(ct.raise_while_handling).specialize(
        out_specs_fn=lambda x: x)
    with pytest.raises(ct.Coded, match="error 4 at the handler") as info:
        f(put(1, cpu_devices()[0]))
    context = info.value.__context__
    assert type(context) is KeyError and context.args == ("missing",)
    assert info.value.__cause__ is None
    assert "__context__" not in vars(info.value)


def test_submit_returns_futures(executor):
    f = jaxcolo.colocated_python(add_one_tree)
    x = put(1, cpu_devices()[0])
    fut = f.submit(x)  # first call: discovery, done before submit returns
    assert isinstance(fut, concurrent.futures.Future)
    assert int(fut.result(timeout=10)) == 2
    futs = [f.submit({"a": x}) for _ in range(5)]
    assert [int(u.result(timeout=10)["a"]) for u in futs] == [2] * 5
    with pytest.raises(ValueError, match="only supports jax.Array"):
        f.submit(1)  # argument errors raise at submit


def test_colocated_cpu_devices():
    devs = jax.local_devices()
    assert jaxcolo.colocated_cpu_devices(devs) == tuple(devs)
    assert jaxcolo.colocated_cpu_devices(devs[:1]) == (devs[0],)
    mesh = Mesh(np.array(devs[:4]).reshape(2, 2), ("x", "y"))
    assert jaxcolo.colocated_cpu_devices(mesh) == mesh
    # A CPU device is its own colocated CPU device, in any order (JAX
    # 0.10.2's fallback hands out the process's first CPU devices instead).
    assert jaxcolo.colocated_cpu_devices([devs[3], devs[1]]) == \
        (devs[3], devs[1])
    rev = Mesh(np.array(devs[::-1]).reshape(2, 4), ("x", "y"))
    assert jaxcolo.colocated_cpu_devices(rev) is rev
    from jax.experimental import colocated_python as jcp
    assert tuple(jcp.colocated_cpu_devices(devs)) == \
        jaxcolo.colocated_cpu_devices(devs)


def test_drop_in_module_surface():
    import jax.experimental.colocated_python as jcp
    for name in ("colocated_python", "colocated_python_class",
                 "colocated_cpu_devices"):
        assert hasattr(jcp, name) and callable(getattr(jaxcolo, name))
    f = jaxcolo.colocated_python(add_one_tree)
    assert f.__name__ == "add_one_tree" and f.__wrapped__ is add_one_tree


def test_a_body_may_call_another_colocated_function(executor):
    inner = jaxcolo.colocated_python(lambda x: x * 10).specialize(
        out_specs_fn=lambda x: x)

    @jaxcolo.colocated_python
    def outer(x):
        return inner(x) + 1

    x = put(2, cpu_devices()[0])
    assert int(outer(x)) == 21 and int(outer(x)) == 21


def test_closed_executor_fails_queued_and_later_calls():
    ex = jaxcolo.InlineExecutor()
    d = cpu_devices()[0]
    x = put(1, d)

    @jaxcolo.colocated_python
    def slow(x):
        colocated_state.started.set()
        colocated_state.release.wait(10)
        return x

    slow = slow.specialize(out_specs_fn=lambda x: x)
    colocated_state.started = threading.Event()
    colocated_state.release = threading.Event()
    with jaxcolo.use_executor(ex):
        futs = [slow.submit(x) for _ in range(3)]
        assert colocated_state.started.wait(10)  # the first call is running
        ex.close()
        colocated_state.release.set()
        assert int(futs[0].result(10)) == 1  # was running: completes
        for fut in futs[1:]:
            with pytest.raises(jaxcolo.ExecutorError, match="closed before"):
                fut.result(10)
        with pytest.raises(jaxcolo.ExecutorError, match="is closed"):
            slow(x)


def test_a_function_returning_none_runs_once_per_call(executor, tmp_path):
    """None is a valid output tree: the first (discovering) call once ran
    the body a second time, taking the None for 'specs became known'."""
    log = tmp_path / "runs"

    @jaxcolo.colocated_python
    def note(x):
        with open(log, "a") as f:
            f.write("run\n")
        return None

    x = put(1, cpu_devices()[0])
    assert note(x) is None
    assert log.read_text() == "run\n"
    assert note(x) is None
    assert log.read_text() == "run\n" * 2

    @jaxcolo.colocated_python
    def note_submitted(x):
        with open(log, "a") as f:
            f.write("submit\n")

    assert note_submitted.submit(x).result() is None
    assert log.read_text().count("submit") == 1


def _make_counter():
    count = [0]

    def bump(x):
        count[0] += 1
        return jax.device_put(np.asarray(count[0], x.dtype), x.sharding)
    return bump


def test_specialisations_keep_their_own_closure_state(executor):
    """As in JAX, each specialisation runs its own copy of the function:
    closure state is not shared between input signatures."""
    f = jaxcolo.colocated_python(_make_counter()).specialize(
        out_specs_fn=lambda x: x)
    a = put(np.int32(0), cpu_devices()[0])
    b = put(np.float32(0), cpu_devices()[0])
    assert [int(f(a)) for _ in range(2)] == [1, 2]
    assert [float(f(b)) for _ in range(2)] == [1.0, 2.0]
    assert int(f(a)) == 3


def test_use_executor_blocks_overlapping_in_two_threads():
    """Thread 1 enters A, thread 2 enters B, thread 1 leaves (A closed):
    B stays in use, and once B is left too the default is back (restoring
    a saved previous one left the closed A in use for the process)."""
    import threading

    before = jaxcolo.get_executor()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with jaxcolo.InlineExecutor() as a, jaxcolo.use_executor(a):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def second():
        a_in.wait(10)
        with jaxcolo.InlineExecutor() as b, jaxcolo.use_executor(b):
            b_in.set()
            a_out.wait(10)
            seen["b"] = jaxcolo.get_executor() is b

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"b": True}
    assert jaxcolo.get_executor() is before


def test_jax_clear_caches_drops_specialisations(executor):
    """As JAX's colocated functions' caches, a function's specialisations
    are dropped by jax.clear_caches() (they were kept, one per signature,
    for the function's life); calls after it specialise again."""
    import gc
    import weakref
    f = jaxcolo.colocated_python(add_one_tree)
    d = cpu_devices()[0]
    assert int(f(put(1, d))) == 2
    assert int(f(put(np.float32(1), d))) == 2
    assert signatures(f) == 2
    jax.clear_caches()
    assert signatures(f) == 0
    assert int(f(put(5, d))) == 6
    assert signatures(f) == 1
    alive = weakref.ref(f._cache)
    del f
    gc.collect()
    assert alive() is None  # JAX holds the registration weakly


def test_an_output_on_another_hosts_device_names_the_devices(executor):
    """A function on device 5 returning an array on device 0 (another
    host's, with two hosts) got a PayloadError about a missing shard for
    device 0 under a process executor, which reads like a corrupt payload;
    the devices are now checked before shards are looked for, as inline."""
    f = jaxcolo.colocated_python(
        lambda x: jax.device_put(np.float32(1), jax.devices()[0]))
    with pytest.raises(ValueError, match=r"^<lambda>: output 0 lives on "
                       r"devices \[0\] outside the function's devices \[5\]"):
        f(put(np.float32(1), cpu_devices()[5]))
