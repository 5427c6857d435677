"""What colocated calls carry: string and PRNG key arrays, module state,
captured meshes and shardings."""

import tempfile

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxcolo
from jaxcolo.colocated.inline import InlineExecutor
from tests import colocated_state as state
from tests.colocated_support import cpu_devices, executor, pop_state, put  # noqa: F401

STR = np.dtypes.StringDType()


def _upper(x):
    out = []
    for shard in x.addressable_shards:
        host = jax.device_get(shard.data)
        out.append(jax.device_put(np.vectorize(str.upper, otypes=[STR])(host),
                                  shard.device))
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, out)


def test_string_arrays_in_and_out(executor):
    devs = cpu_devices()
    s = NamedSharding(Mesh(np.array(devs[:2]).reshape(2, 1), ("x", "y")),
                      P("x"))
    x = jax.device_put(np.array([["abcd", "efgh"], ["ijkl", "mnop"]], STR), s)
    f = jaxcolo.colocated_python(_upper)
    for _ in range(2):
        out = f(x)
        assert out.dtype == STR and out.sharding == s
        np.testing.assert_array_equal(
            jax.device_get(out), np.array([["ABCD", "EFGH"], ["IJKL", "MNOP"]],
                                          STR))


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_prng_keys_in_and_out(executor, impl):
    d = cpu_devices()[0]
    key = jax.device_put(jax.random.key(42, impl=impl), d)

    @jaxcolo.colocated_python
    def split(k):
        return jax.random.split(k, 3)

    for _ in range(2):
        out = split(key)
        assert jax.dtypes.issubdtype(out.dtype, jax.dtypes.prng_key)
        assert str(jax.random.key_impl(out)) == impl
        np.testing.assert_array_equal(
            jax.random.key_data(out),
            jax.random.key_data(jax.random.split(jax.random.key(42, impl=impl),
                                                 3)))


def test_keys_strings_and_numbers_in_one_tree(executor):
    devs = cpu_devices()
    s = NamedSharding(Mesh(np.array(devs[:2]), ("x",)), P("x"))
    tree = {"keys": jax.device_put(jax.random.split(jax.random.key(1), 2), s),
            "rbg": jax.device_put(jax.random.split(
                jax.random.key(2, impl="rbg"), 2), s),
            "words": jax.device_put(np.array(["a", "bc"], STR), s),
            "n": jax.device_put(np.arange(2.0), s)}

    @jaxcolo.colocated_python
    def mix(t):
        return {"keys": jax.random.fold_in(t["keys"][0], 1),
                "words": _upper(t["words"]), "n": t["n"] * 3,
                "rbg_data": jax.random.key_data(t["rbg"]), "rbg": t["rbg"]}

    mix = mix.specialize(devices=devs[:2])
    for _ in range(2):
        out = mix(tree)
        np.testing.assert_array_equal(jax.device_get(out["words"]),
                                      np.array(["A", "BC"], STR))
        np.testing.assert_array_equal(jax.device_get(out["n"]), [0.0, 3.0])
        np.testing.assert_array_equal(
            jax.random.key_data(out["keys"]),
            jax.random.key_data(jax.random.fold_in(
                jax.random.split(jax.random.key(1), 2)[0], 1)))
        assert str(jax.random.key_impl(out["rbg"])) == "rbg"
        np.testing.assert_array_equal(jax.random.key_data(out["rbg"]),
                                      out["rbg_data"])


def test_keys_and_strings_a_host_holds_no_shard_of(executor):
    """A function over every device given a key or string array on one
    device: under ProcessExecutor(num_hosts=2) the host owning none of its
    shards failed the call ("If the Array has no addressable shards, `dtype`
    must be provided"), where numbers, JAX and InlineExecutor run it."""
    devs = cpu_devices()
    data = jax.device_put(np.arange(8.0, dtype=np.float32),
                          NamedSharding(Mesh(np.array(devs), ("x",)),
                                        P("x")))
    key = jax.device_put(jax.random.key(7), devs[0])
    words = jax.device_put(np.array(["a", "bc"], STR), devs[0])

    @jaxcolo.colocated_python
    def step(data, extra):
        return data

    step = step.specialize(devices=devs)
    for _ in range(2):
        for extra in (key, words):
            out = step(data, extra)
            assert out.sharding == data.sharding
            np.testing.assert_array_equal(jax.device_get(out),
                                          np.arange(8.0))


@pytest.mark.parametrize("kind", ["key", "str", "f32"])
def test_keys_and_strings_keep_their_memory_kind(executor, kind):
    """A key or string array in pinned_host memory (as an argument and as a
    result) failed under ProcessExecutor: each shard was put in the
    device's default memory ("Memory kind mismatch"), where numbers,
    JAX and InlineExecutor keep the memory kind."""
    d = cpu_devices()[0]
    pinned = jax.sharding.SingleDeviceSharding(d, memory_kind="pinned_host")
    value = {"key": lambda: jax.random.key(3),
             "str": lambda: np.array(["x", "yz"], STR),
             "f32": lambda: np.float32(2.5)}[kind]
    x = jax.device_put(value(), pinned)

    @jaxcolo.colocated_python
    def made_here(seed):  # a result made on the host, in pinned memory
        return jax.device_put(value(), jax.sharding.SingleDeviceSharding(
            seed.sharding._device, memory_kind="pinned_host"))

    ident = jaxcolo.colocated_python(lambda v: v)
    seed = jax.device_put(np.float32(1), d)
    for _ in range(2):
        for out in (ident(x), made_here(seed)):
            assert out.sharding == pinned
            assert out.dtype == x.dtype
            if kind == "key":
                np.testing.assert_array_equal(jax.random.key_data(out),
                                              jax.random.key_data(x))
            else:
                np.testing.assert_array_equal(jax.device_get(out),
                                              jax.device_get(x))


def test_module_state_is_visible_and_module_not_pickled(executor):
    # An unpicklable object in the module that holds the state: pickling the
    # module along with the functions would fail.
    state.unpicklable = tempfile.TemporaryFile()
    try:
        @jaxcolo.colocated_python
        def set_state(x):
            state.value = x
            return x + 1

        @jaxcolo.colocated_python
        def get_state(x):
            del x
            return state.value

        d = cpu_devices()[0]
        jax.block_until_ready(set_state(put(1, d)))
        np.testing.assert_array_equal(jax.device_get(get_state(put(2, d))), 1)
        jax.block_until_ready(set_state(put(5, d)))
        np.testing.assert_array_equal(jax.device_get(get_state(put(2, d))), 5)
    finally:
        state.unpicklable.close()
        del state.unpicklable
        pop_state("value")


def test_captured_mesh_and_sharding_work(executor):
    devs = cpu_devices()
    mesh = Mesh(np.array(devs[:4]).reshape(2, 2), ("a", "b"))
    sharding = NamedSharding(mesh, P("a"))

    @jaxcolo.colocated_python
    def make():
        return jax.device_put(np.arange(4.0), sharding)

    make = make.specialize(devices=devs[:4])
    out = make()
    assert out.sharding == sharding
    np.testing.assert_array_equal(jax.device_get(out), np.arange(4.0))


@pytest.mark.parametrize("kind", ["inline", "process"])
def test_captured_mesh_naming_an_unknown_device_fails_clearly(kind):
    devs = jax.devices()
    # This executor's host(s) own devices 0..3 only.
    host = (InlineExecutor(devices=devs[:4]) if kind == "inline" else
            jaxcolo.ProcessExecutor(num_hosts=1, devices=devs[:4]))
    elsewhere = NamedSharding(Mesh(np.array(devs[4:6]), ("x",)), P())

    @jaxcolo.colocated_python
    def make(x):
        return jax.device_put(x, elsewhere)

    with host, jaxcolo.use_executor(host):
        with pytest.raises(jaxcolo.PayloadError,
                           match=r"cannot load the body of 'make'.*unknown "
                                 rf"device id {devs[4].id}.* - at \$\.body\."):
            make(put(1, devs[0]))
        # Program devices the executor lacks: named too.
        with pytest.raises(jaxcolo.PayloadError,
                           match=rf"unknown device id {devs[6].id}.* - at "
                                 r"\$\.in_specs"):
            jaxcolo.colocated_python(lambda x: x)(put(1, devs[6]))


def test_key_arrays_on_different_meshes_keep_their_signatures(executor):
    """A key array over several devices makes a new sharding object at each
    access: the fast signature key held the id of a freed one, and a later
    call on another mesh matched it (its output check failed, or its shards
    went to the wrong devices), in 52 of 300 calls inline."""
    import random
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    d = jax.devices()
    shardings = [NamedSharding(Mesh(np.array(d[i:i + 2]), ("x",)), P("x"))
                 for i in range(0, 8, 2)]
    keys = [jax.device_put(jax.random.split(jax.random.key(0), 8), s)
            for s in shardings]
    assert keys[0].sharding is not keys[0].sharding  # (what JAX does)
    f = jaxcolo.colocated_python(lambda k: jax.random.key_data(k))
    rng, junk = random.Random(0), []
    for _ in range(300):
        x = rng.choice(keys)
        junk.append([NamedSharding(shardings[0].mesh, P("x"))
                     for _ in range(rng.randrange(3))])  # (reuses ids)
        if len(junk) > 5:
            junk.pop(rng.randrange(len(junk)))
        out = f(x)
        assert out.sharding.device_set == x.sharding.device_set
        np.testing.assert_array_equal(np.asarray(out),
                                      np.asarray(jax.random.key_data(x)))
