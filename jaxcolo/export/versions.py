"""The single table of JAX export serialization versions.

Each row says what a JAX writer of that version puts on the wire (its
*layout*), which PyPI JAX releases have it as their newest version, and what
it added.  Everything version-dependent in :mod:`jaxcolo.export` — the writer,
version inference, "which releases can read this" — reads this table; no
version numbers are compared anywhere else.

Facts (from the JAX releases' own serialization modules, 0.4.30 … 0.10.2):

* JAX stores 2 in ``serialization_version`` up to version 4 (the releases'
  module constant stayed 2 while versions 3 and 4 added features) and 3 from
  version 5 on (old readers rejected anything but 2 or 3).
* Version 7 was published briefly and withdrawn; 9 and 12 have no PyPI
  release (12 is JAX main, which adds ``jax_version``).
* Version 6 releases differ: 0.9.0 still wrote ``nr_devices_short``, 0.9.1
  stopped.  jaxcolo's version-6 writer follows 0.9.1.
* Version 3 releases differ in the dtypes they know (new float8/float4
  kinds came without a version bump): the DType enum ends at 22 in 0.4.35,
  24 in 0.4.36 .. 0.5.0, 25 in 0.5.1 .. 0.5.2 and 26 in 0.5.3
  (``release_max_dtype``).  Every version-4+ release ends at 29.
* The 0.4.30 ``shape_assertions`` disabled check is read (as a no-op) by
  every release up to 0.9.2; 0.10.0 and later refuse it.
"""

from __future__ import annotations

import dataclasses

from jaxcolo.errors import EncodeError
from jaxcolo.versions import integer

MIN_VERSION = 2
DEFAULT_VERSION = 11     # what jax 0.10.2 writes
MAX_VERSION = 12         # JAX main (2026-08): adds the jax_version field


@dataclasses.dataclass(frozen=True)
class ExportVersion:
    version: int
    stored: int                 # value written in Exported.serialization_version
    releases: tuple[str, ...]   # PyPI jax releases whose newest version this is
    added: tuple[str, ...]      # features first written by this version
    # ---- the writer's layout
    max_dtype: int              # largest DType enum value it reads and writes
    custom_pytree: bool         # PyTreeDefKind.custom nodes
    nr_devices_short: bool      # writes Exported.nr_devices_short (int16)
    short_optional: bool        # some releases of it write the short, some not
    nr_devices_long: bool       # writes Exported.nr_devices (uint32)
    memory_space: bool          # writes AbstractValue.memory_space
    hlo_shardings: bool         # writes Sharding.kind + hlo_sharding_proto
    named_shardings: bool       # writes Sharding.named_sharding
    abstract_device: bool       # writes AbstractMesh.abstract_device
    device_platform: bool       # writes AbstractDevice.platform
    unique_tables: bool         # writes unique_* tables and *_idxs vectors
    jax_version: bool           # writes Exported.jax_version
    # ---- its readers
    shape_assertions: bool      # reads the shape_assertions disabled check
    # releases of this version whose DType enum ends below max_dtype
    release_max_dtype: tuple[tuple[str, int], ...] = ()

    def max_dtype_of(self, release: str | None) -> int:
        """The largest DType value ``release`` (None: the version's newest
        release) reads."""
        return dict(self.release_max_dtype).get(release, self.max_dtype)


def _v(version, stored, releases, added, **layout):
    base = dict(max_dtype=22, custom_pytree=False, nr_devices_short=True,
                short_optional=False,
                nr_devices_long=False, memory_space=False, hlo_shardings=True,
                named_shardings=False, abstract_device=False,
                device_platform=False, unique_tables=False, jax_version=False,
                shape_assertions=True)
    base.update(layout)
    return ExportVersion(version, stored, releases, added, **base)


_V3 = dict(max_dtype=26, custom_pytree=True, release_max_dtype=(
    ("0.4.35", 22), ("0.4.36", 24), ("0.4.37", 24), ("0.4.38", 24),
    ("0.5.0", 24), ("0.5.1", 25), ("0.5.2", 25)))
_V4 = dict(_V3, max_dtype=29, release_max_dtype=())
_V5 = dict(_V4, nr_devices_long=True, memory_space=True)
_V6 = dict(_V5, nr_devices_short=False, short_optional=True,
           named_shardings=True)
_V7 = dict(_V6, hlo_shardings=False, short_optional=False)
_V8 = dict(_V6, abstract_device=True, short_optional=False)
_V9 = dict(_V8, hlo_shardings=False)
_V10 = dict(_V9, unique_tables=True, shape_assertions=False)
_V11 = dict(_V10, device_platform=True)
_V12 = dict(_V11, jax_version=True)

HISTORY: tuple[ExportVersion, ...] = (
    _v(2, 2, ("0.4.30", "0.4.31", "0.4.33", "0.4.34"),
       ("base layout", "f0 dtype")),
    _v(3, 2, ("0.4.35", "0.4.36", "0.4.37", "0.4.38", "0.5.0", "0.5.1",
              "0.5.2", "0.5.3"),
       ("custom/namedtuple pytree nodes", "float8_e4m3/e3m4/e8m0fnu, "
        "float4_e2m1fn dtypes"), **_V3),
    _v(4, 2, ("0.6.0", "0.6.1", "0.6.2", "0.7.0", "0.7.1", "0.7.2", "0.8.0",
              "0.8.1"), ("PRNG key dtypes",), **_V4),
    _v(5, 3, ("0.8.2", "0.8.3"),
       ("aval memory_space", "uint32 nr_devices"), **_V5),
    _v(6, 3, ("0.9.0", "0.9.0.1", "0.9.1"),
       ("NamedSharding over AbstractMesh (next to the HloSharding)",), **_V6),
    _v(7, 3, (), ("HloSharding dropped (withdrawn version)",), **_V7),
    _v(8, 3, ("0.9.2",), ("AbstractMesh.abstract_device",), **_V8),
    _v(9, 3, (), ("HloSharding dropped",), **_V9),
    _v(10, 3, ("0.10.0",),
       ("unique avals/abstract meshes/named shardings with index vectors",),
       **_V10),
    _v(11, 3, ("0.10.1", "0.10.2"), ("AbstractDevice.platform",), **_V11),
    _v(12, 3, (), ("jax_version (JAX main, 2026-08)",), **_V12),
)

_BY_VERSION = {v.version: v for v in HISTORY}
VERSIONS = tuple(sorted(_BY_VERSION))


def info(version: int) -> ExportVersion:
    return _BY_VERSION[version]


def check_writable(version: int | None) -> ExportVersion:
    """The table row for ``serialize(..., version=version)``."""
    if version is None:
        return _BY_VERSION[DEFAULT_VERSION]
    version = integer(version, "version")
    row = _BY_VERSION.get(version)
    if row is None:
        raise EncodeError(
            f"cannot write JAX export serialization version {version}: "
            f"jaxcolo writes versions {MIN_VERSION}..{MAX_VERSION}")
    return row


def releases_reading(version: int) -> tuple[str, ...]:
    """PyPI releases whose newest version is >= ``version`` (they read it)."""
    return tuple(r for v in HISTORY if v.version >= version for r in v.releases)
