"""ShapeDtypeStruct layouts (``sharding=Format(Layout(...), s)``), schema v4."""

import jax
import numpy as np
import pytest
from jax.experimental.layout import Format, Layout
from jax.sharding import SingleDeviceSharding

import jaxcolo
from jaxcolo.checking import check_readable
from jaxcolo.codec import aval, memo
from tests import corpus


@pytest.fixture(autouse=True)
def no_memos(monkeypatch):
    monkeypatch.setattr(memo, "_enabled", False)


def _sds(layout, shape=(8, 16)):
    return jax.ShapeDtypeStruct(shape, np.float32, sharding=Format(
        layout, SingleDeviceSharding(jax.devices()[2])))


@pytest.mark.parametrize("sds", corpus.layouts(corpus.avals()[2].sharding),
                         ids=repr)
def test_layout_round_trips(sds):
    out = jaxcolo.deserialize(jaxcolo.serialize(sds))
    assert out == sds
    assert out.format.layout == sds.format.layout
    assert out.sharding == sds.sharding


def test_layout_needs_version_4_and_says_so():
    sds = _sds(Layout((1, 0)))
    with pytest.raises(jaxcolo.EncodeError,
                       match=r"layout needs schema version 4.*version 3.*"
                             r"at \$\[1\]\.layout"):
        jaxcolo.serialize([jax.ShapeDtypeStruct((2,), np.int8), sds],
                          version=3)
    data = jaxcolo.serialize(sds)
    assert jaxcolo.inspect(data)["min_reader_version"] == 4
    ok, reason = check_readable(data, 3)
    assert not ok and "4" in reason
    assert check_readable(data, 4)[0]
    # Without a layout, a v4 payload stays readable by every reader.
    plain = jaxcolo.serialize(jax.ShapeDtypeStruct((8, 16), np.float32))
    assert jaxcolo.inspect(plain)["min_reader_version"] == 1


def test_format_without_layout_is_a_plain_sds():
    sds = _sds(None)
    assert sds._dll is None
    assert jaxcolo.deserialize(jaxcolo.serialize(sds, version=1)) == sds


def test_unexpressible_layout_is_refused_with_path():
    bad = _sds(Layout((0, 1)))
    object.__setattr__(bad, "_dll", Layout((0, 0)))  # not a permutation
    with pytest.raises(jaxcolo.EncodeError, match=r"not a permutation.*"
                                                  r"at \$\['x'\]\.layout"):
        jaxcolo.serialize({"x": bad})


@pytest.mark.parametrize("tiling,path,reason", [
    (((1,),) * 17, r"\.layout\.tiling", r"17 tiles \(at most 16\)"),
    (((1,) * 17,), r"\.layout\.tiling\[0\]",
     r"tile of rank 17 \(at most 16\)"),
])
def test_tilings_readers_refuse_are_encode_errors(tiling, path, reason):
    """The writer wrote tilings its own reader refuses (over MAX_TILES tiles,
    or a tile over MAX_TILE_RANK dims)."""
    with pytest.raises(jaxcolo.EncodeError, match=rf"{reason} - at "
                       rf"\$\['x'\]{path}$"):
        jaxcolo.serialize({"x": _sds(Layout((1, 0), tiling=tiling))})
    ok = ((1,),) * 16 if len(tiling) > 1 else ((1,) * 16,)
    sds = _sds(Layout((1, 0), tiling=ok))
    assert jaxcolo.deserialize(jaxcolo.serialize(sds)).format == sds.format


def _forced_layout(item):
    """A stand-in for aval.layout_item writing ``item`` for any layout (and
    declaring the layout feature, as the real one does)."""
    def layout_item(w, dll, rank, p):
        if dll is None:
            return None
        w.require("layout", p)
        return item
    return layout_item


@pytest.mark.parametrize("item,path,reason", [
    (((0, 0), None, 0), r"\.layout\.major_to_minor", "not a permutation"),
    (((0,), None, 0), r"\.layout\.major_to_minor", "not a permutation"),
    (((1, 0), ((1,),) * 17, 0), r"\.layout\.tiling", "17 tiles"),
    (((1, 0), ((1,) * 17,), 0), r"\.layout\.tiling\[0\]\.dims", "rank 17"),
])
def test_malformed_layouts_are_payload_errors(monkeypatch, item, path, reason):
    """Payloads a correct writer never makes are refused, naming the field."""
    monkeypatch.setattr(aval, "layout_item", _forced_layout(item))
    data = jaxcolo.serialize([_sds(Layout((1, 0)))])
    monkeypatch.undo()
    with pytest.raises(jaxcolo.PayloadError,
                       match=rf"{reason}.*at \$\.arrays\.extras\[0\]{path}"):
        jaxcolo.deserialize(data)


def test_layout_on_a_shaped_array_is_refused(monkeypatch):
    from jax._src import core
    monkeypatch.setattr(aval, "layout_item",
                        lambda w, dll, rank, p: _forced_layout(
                            ((0, 1), None, 0))(w, True, rank, p))
    data = jaxcolo.serialize(core.ShapedArray((2, 3), np.float32))
    monkeypatch.undo()
    with pytest.raises(jaxcolo.PayloadError,
                       match=r"ShapedArray has no layout.*extras\[0\]\.layout"):
        jaxcolo.deserialize(data)


def test_layout_under_a_header_declaring_an_older_reader_is_refused():
    """A header claiming a v1 reader can read a payload with a layout (a v1
    reader would drop it silently) is corrupt or forged: refused."""
    data = bytearray(jaxcolo.serialize(_sds(Layout((1, 0))), compress=False))
    assert data[6:8] == b"\x04\x00"  # min_reader_version 4
    data[6:8] = b"\x01\x00"
    with pytest.raises(jaxcolo.PayloadError, match=r"layout needs reader "
                       r"version >= 4, but the header declares "
                       r"min_reader_version 1 - at \$\.arrays\.extras\[0\]"
                       r"\.layout"):
        jaxcolo.deserialize(bytes(data))
    ok, why = check_readable(bytes(data), 1)
    assert not ok and "layout needs reader version >= 4" in why
