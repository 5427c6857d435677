"""The inline fast path (packing.inline_shards + templates.encode_inline)
writes exactly what a Packer and the full encoder write."""

import jax
import numpy as np

from jaxcolo.process import messages as M, packing, templates
from jaxcolo_fb import MessageKind


def _full(kind, xs, devices, call_id, lane, program_id):
    p = packing.Packer(None)
    for i, x in enumerate(xs):
        p.add(i, x, devices)
    m = M.Message(kind, call_id=call_id, lane=lane, program_id=program_id,
                  shards=p.finish(), segments=p.segments)
    assert not p.frames
    return m


def test_inline_encode_is_the_full_encode():
    devs = jax.devices()
    cases = [
        [jax.device_put(np.int32(7), devs[0])],
        [jax.device_put(np.arange(3, dtype=np.int8), devs[1]),
         jax.device_put(np.float32(2.5), devs[1]),
         jax.device_put(np.zeros((0,), np.float32), devs[1]),
         jax.device_put(np.ones((5, 3), np.bool_), devs[1])],
        [],
    ]
    for xs in cases:
        devices = {x.sharding._device for x in xs}
        for lane in (0, 9):
            inline = packing.inline_shards(xs, devices)
            assert inline is not None
            key = (MessageKind.call, 7, bytes(16), False, bool(lane),
                   inline[0])
            first = _full(MessageKind.call, xs, devices, 1, lane, bytes(16))
            templates.remember_inline(key, first, 7, inline[1])
            M.encode(first, 7)  # its template exists from now on
            templates.remember_inline(key, first, 7, inline[1])
            for cid in (2, 1 << 40):
                got = templates.encode_inline(key, cid, lane, inline[1])
                want = M._encode(_full(MessageKind.call, xs, devices, cid,
                                       lane, bytes(16)), 7)
                assert got == want


def test_inline_shards_declines_what_a_packer_sends_otherwise():
    devs = jax.devices()
    x = jax.device_put(np.int32(1), devs[0])
    assert packing.inline_shards([x], {devs[1]}) is None  # not this host's
    big = jax.device_put(np.zeros(packing.INLINE_LIMIT // 4 + 1, np.float32),
                         devs[0])
    assert packing.inline_shards([x, big], {devs[0]}) is None
    key = jax.random.key(0)
    assert packing.inline_shards([key], None) is None
    sharded = jax.device_put(np.arange(8.0), jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(devs[:2]), ("x",)),
        jax.sharding.PartitionSpec("x")))
    assert packing.inline_shards([sharded], None) is None
    assert packing.inline_shards([object()], None) is None
