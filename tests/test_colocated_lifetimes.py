"""Programs live as long as the functions that hold them.

Every executor kept each program it ever ran -- its decoded specs and its
loaded body, with whatever the body captured -- until the executor closed: a
loop making a new closure per step grew the process (and a worker) by the
closure's captures each step (2 MiB a step below: 1.5 GiB after 300 steps in
a worker).  Now a program is forgotten, at the executor's next call, once no
function (specialisation) and no call in flight holds it.
"""

import gc
import threading

import jax
import numpy as np
import pytest

import jaxcolo
from tests.colocated_support import (cpu_devices, executor,  # noqa: F401
                                     put)


def _loaded(ex) -> dict:
    """How many programs ``ex`` holds now: on this side (controller plans or
    InlineExecutor programs) and, for a ProcessExecutor, on each host."""
    if isinstance(ex, jaxcolo.InlineExecutor):
        return {"here": ex.stats()["programs_loaded_now"]}
    out = {"here": len(ex._plans)}
    for i, h in enumerate(ex.stats()["hosts"]):
        out[f"host{i} registered"] = h["programs_registered_now"]
        out[f"host{i} loaded"] = h.get("programs_loaded_now", 0)
    return out


def _add(a, k):
    return a + k


def test_programs_of_dropped_functions_are_forgotten(executor):
    d = cpu_devices()[0]
    x = put(np.float32(1), d)
    captured = np.ones(1 << 16, np.float32)
    for i in range(40):
        f = jaxcolo.colocated_python(
            lambda a, big=captured * i: a + big[0]).specialize(
                out_specs_fn=lambda a: a)
        assert float(f(x)) == 1 + i
        del f
        gc.collect()
    keep = jaxcolo.colocated_python(lambda a: a * 2).specialize(
        out_specs_fn=lambda a: a)
    assert float(keep(x)) == 2  # the next call forgets the dropped ones
    assert float(keep(x)) == 2
    loaded = _loaded(executor)
    assert all(n <= 2 for n in loaded.values()), loaded


def test_an_equal_function_made_again_runs(executor):
    """Equal functions share a program id: one dropped while an equal one
    lives keeps it; one made after it was forgotten registers it again."""
    d = cpu_devices()[0]
    x = put(np.float32(3), d)

    def make():
        return jaxcolo.colocated_python(_add).specialize(
            out_specs_fn=lambda a, k: a)
    f, g = make(), make()
    assert float(f(x, x)) == 6
    del f
    gc.collect()
    assert float(g(x, x)) == 6  # g holds the same program
    del g
    gc.collect()
    other = jaxcolo.colocated_python(lambda a: a).specialize(
        out_specs_fn=lambda a: a)
    assert float(other(x)) == 3  # forgets _add's program
    assert float(make()(x, x)) == 6


def test_forgetting_races_with_equal_functions_made_again():
    """Threads each make, call and drop equal functions (one program id)
    while others' drops forget it: no call may find its program forgotten
    on the worker (the forget must never overtake a registration)."""
    errors = []
    d = cpu_devices()[0]
    x = put(np.float32(2), d)

    def loop():
        try:
            for _ in range(150):
                f = jaxcolo.colocated_python(_add).specialize(
                    out_specs_fn=lambda a, k: a)
                assert float(f(x, x)) == 4
                del f
                gc.collect(0)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with jaxcolo.ProcessExecutor(num_hosts=1) as ex, \
            jaxcolo.use_executor(ex):
        threads = [threading.Thread(target=loop) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors[:3]
        gc.collect()
        assert float(jaxcolo.colocated_python(lambda a: a).specialize(
            out_specs_fn=lambda a: a)(x)) == 2
        host = ex.stats()["hosts"][0]
        assert host["programs_forgotten"] > 0, host
        assert host["unregistered"] > 0, host
        assert host["programs_registered_now"] <= 2, host


def test_sessions_before_v9_keep_their_programs():
    """A worker speaking v8 does not know ``forget``: nothing is sent; its
    programs stay (as before) and every call works."""
    x = put(np.float32(1), cpu_devices()[0])
    with jaxcolo.ProcessExecutor(num_hosts=1, max_version=8) as ex, \
            jaxcolo.use_executor(ex):
        for i in range(3):
            f = jaxcolo.colocated_python(lambda a, i=i: a + i).specialize(
                out_specs_fn=lambda a: a)
            assert float(f(x)) == 1 + i
            del f
            gc.collect()
        host = ex.stats()["hosts"][0]
        assert host["programs_registered_now"] == 3, host
        assert "programs_forgotten" not in host or \
            host["programs_forgotten"] == 0


def test_an_instance_outlives_its_forgotten_method_programs(executor):
    """jax.clear_caches() drops the method programs; the host instance and
    its state stay (the next method call registers them again)."""
    @jaxcolo.colocated_python_class
    class Counter:
        def __init__(self):
            self.n = 0

        def bump(self, x):
            self.n += 1
            return jax.device_put(np.int32(self.n), x.sharding)

    c = Counter()
    x = put(np.int32(0), cpu_devices()[0])
    assert int(c.bump(x)) == 1
    jax.clear_caches()
    gc.collect()
    other = jaxcolo.colocated_python(lambda a: a).specialize(
        out_specs_fn=lambda a: a)
    assert int(other(x)) == 0  # forgets bump's program
    assert int(c.bump(x)) == 2
    assert int(c.bump(x)) == 3


def _forget_payload(ids: bytes, min_reader: int) -> bytes:
    import jaxcolo_fb as fb
    from jaxcolo import envelope
    from jaxcolo.fastbuilder import FastBuilder
    b = FastBuilder(64)
    v = b.CreateByteVector(ids)
    fb.MessageStart(b)
    fb.MessageAddKind(b, fb.MessageKind.forget)
    fb.MessageAddForgotten(b, v)
    b.Finish(fb.MessageEnd(b))
    return envelope.seal(b.Output(), fb.RootKind.message, 9, min_reader)


def test_malformed_forget_messages_are_payload_errors():
    from jaxcolo.process import messages as msg
    good = msg.decode(_forget_payload(b"a" * 32, 9))
    assert good.forgotten == [b"a" * 16, b"a" * 16]
    with pytest.raises(jaxcolo.PayloadError,
                       match=r"17 bytes, not a whole number of 16-byte "
                             r"program ids - at \$\.forgotten"):
        msg.decode(_forget_payload(b"x" * 17, 9))
    with pytest.raises(jaxcolo.PayloadError,
                       match=r"message_forget needs reader version >= 9"):
        msg.decode(_forget_payload(b"a" * 16, 3))
    with pytest.raises(jaxcolo.EncodeError, match="16 bytes each"):
        msg.encode(msg.Message(msg.MessageKind.forget, forgotten=[b"x" * 17]))
    with pytest.raises(jaxcolo.EncodeError, match="needs schema version 9"):
        msg.encode(msg.Message(msg.MessageKind.forget,
                               forgotten=[b"x" * 16]), 8)
