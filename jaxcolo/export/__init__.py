"""JAX's own ``Exported`` wire format, at every serialization version.

    import jaxcolo.export
    data = jaxcolo.export.serialize(exp, vjp_order=0, version=None)  # bytearray
    exp = jaxcolo.export.deserialize(data)          # jax.export.Exported
    jaxcolo.export.serialization_version(data)     # detected (2..12): the
                                                   # oldest version it fits

``serialize(version=None)`` writes what jax 0.10.2 writes (version 11, byte
for byte); ``version=N`` writes what the JAX release whose newest version is
N reads, or raises :class:`jaxcolo.EncodeError` if the Exported uses
something version N cannot express.  ``deserialize`` reads versions 2..12
through a bounds-checked reader: malformed bytes raise
:class:`jaxcolo.PayloadError` naming the field, never anything else.
:func:`bundle` / :func:`unbundle` ship an Exported with colocated spec
payloads under jaxcolo's envelope (root kind 3).  :func:`version_range` and :func:`readable_by` tell which versions wrote and
which JAX readers can read a payload.  jaxcolo/export/versions.py is the
table of what each version added.
"""

from jaxcolo.export.bundle import ExportBundle, bundle, open_bundle, \
    unbundle
from jaxcolo.export.decode import deserialize
from jaxcolo.export.detect import readable_by, serialization_version, \
    version_range
from jaxcolo.export.encode import serialize
from jaxcolo.export.versions import DEFAULT_VERSION, MAX_VERSION, MIN_VERSION

__all__ = ["serialize", "deserialize", "serialization_version",
           "version_range", "readable_by", "DEFAULT_VERSION", "MIN_VERSION",
           "MAX_VERSION", "bundle", "unbundle", "open_bundle", "ExportBundle"]
