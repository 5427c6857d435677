"""Top-level encode/decode: dispatch on the envelope's root kind."""

from __future__ import annotations

from typing import Any, Callable

from jaxcolo_fb import RootKind
from jaxcolo import envelope
from jaxcolo.codec import spec_tree
from jaxcolo.errors import PayloadError, reports_malformed

# root kind -> decode(data, device_resolver) -> object
DECODERS: dict[int, Callable] = {
    RootKind.spec_tree: spec_tree.decode_spec_tree,
}
# Root kinds provided by higher layers (colocated programs, JAX export
# bundles, transport messages): the module is imported on first use and
# registers its decoder and inspector, so arrows point one way (those layers
# import this one, never the reverse).
LAZY_ROOTS: dict[int, str] = {
    RootKind.program: "jaxcolo.colocated.program",
    RootKind.export_bundle: "jaxcolo.export.bundle",
    RootKind.hello: "jaxcolo.transport.handshake",
    RootKind.message: "jaxcolo.process.messages",
}
ROOT_KIND_NAMES = {v: k for k, v in vars(RootKind).items()
                   if not k.startswith("_") and isinstance(v, int)}

_decode_spec_tree = spec_tree.decode_spec_tree


def register_root(kind: int, decode: Callable) -> None:
    DECODERS[kind] = decode


def load_root(kind: int) -> None:
    """Import the module providing root kind ``kind``, if it is lazy."""
    module = LAZY_ROOTS.get(kind)
    if module is not None and kind not in DECODERS:
        import importlib
        importlib.import_module(module)


def serialize(obj: Any, version: int | None = None, *,
              compress: bool = True) -> bytes:
    """Encode ``obj`` (containers over spec objects) as a spec payload.

    ``version``: the schema version to write (default: the newest); a reader
    of that version reads the result.  ``compress``: deflate the flatbuffer
    body when that makes it smaller (header flag; any reader inflates it).
    """
    return spec_tree.encode_spec_tree(obj, version, compress)


@reports_malformed
@envelope.shares_inflation
def deserialize(data, device_resolver=None) -> Any:
    """Decode any jaxcolo payload.  Raises PayloadError for bad bytes."""
    header = envelope.read_header(data)
    envelope.check_readable(header)
    load_root(header.root_kind)
    decode = DECODERS.get(header.root_kind)
    if decode is None:
        raise PayloadError(f"unknown root kind {header.root_kind}",
                           "$.header.root_kind")
    if decode is _decode_spec_tree:  # the header is read and checked
        return decode(data, device_resolver, header)
    return decode(data, device_resolver)
