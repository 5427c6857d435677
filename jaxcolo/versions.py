"""The single table of schema versions: what each one added.

``SCHEMA_VERSION`` is what this library writes by default;
``MIN_READABLE_VERSION`` is the oldest payload version it reads.  A payload's
header carries both the writer's version and the oldest reader version that
can read it (the highest ``since`` of the features the payload uses), so an old
reader can still read a new payload that uses only old features.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import operator

from jaxcolo.errors import EncodeError

SCHEMA_VERSION = 12
MIN_READABLE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class VersionInfo:
    version: int
    min_readable: int      # oldest payload version a reader of this version reads
    added: tuple[str, ...]  # features first written by this version


HISTORY: tuple[VersionInfo, ...] = (
    VersionInfo(1, 1, (
        "spec_tree",          # root kind: containers over spec objects
        "pytree",             # leaf/None/tuple/list/dict/namedtuple/OrderedDict/defaultdict/custom
        "dtype",              # every JAX 0.10.2 dtype, PRNG keys, StringDType
        "aval",               # ShapedArray/ShapeDtypeStruct, symbolic dims + constraints
        "mesh",               # Mesh as device ids, AbstractMesh with AbstractDevice
        "partition_spec",     # incl. reduced/unreduced and UNCONSTRAINED
        "sharding",           # NamedSharding, SingleDeviceSharding, GSPMDSharding
        "hlo_sharding",       # OpSharding proto bytes
        "device_list",
        "effect",
        "prng_impl",
    )),
    VersionInfo(2, 1, (
        "program",            # root kind 2: a colocated Python program
        "export_bundle",      # root kind 3: JAX Exported + colocated specs
        "hello",              # root kind 4: executor connection handshake
    )),
    VersionInfo(3, 1, (
        "message",            # root kind 5: controller <-> worker messages
    )),
    VersionInfo(4, 1, (
        "layout",             # ShapeDtypeStruct(sharding=Format(layout, s))
    )),
    VersionInfo(5, 1, (
        # No schema change: OpShardings with last_tile_dims (subgroup types,
        # e.g. shard_map's manual subgroups).  Readers frozen at 1..3 fail
        # on them; late version-4 readers read them, and late version-4
        # writers stamped them readable by 1, so readers read them whatever
        # the header says (LENIENT), and `jaxcolo check` finds them in the
        # body (saying version 5, the first whose every reader reads them).
        "hlo_last_tile_dims",
        # No schema change: an AbstractDevice without platform (writers 1..3
        # left an empty platform out).  Readers of 4 read it as None, not
        # "" (a different mesh); readers from 5 read "", as 1..3 did.
        # Only legacy payloads hold it (writers from 4 write the platform),
        # so readers read it under any header (LENIENT), and `jaxcolo
        # check` finds it in the body.
        "abstract_device_without_platform",
    )),
    VersionInfo(6, 1, (
        # SymbolicScope.token.  Needed (min reader 6) only by payloads with
        # two distinct scopes of equal constraints, which older readers merge.
        "symbolic_scope_identity",
        # No schema change: a one-device Mesh with no axes.  Readers frozen
        # at 1..4 refuse it, and so did version-5 readers until a fix late
        # in version 5 (the frozen 5 reads it); writers before 6 stamped it
        # readable by 1, so readers read it whatever the header says
        # (LENIENT), and `jaxcolo check` finds it in the body.
        "mesh_without_axes",
    )),
    VersionInfo(7, 1, (
        # MessageKind.resume: a worker whose part of a multi-host call
        # failed holds its later multi-host calls until every other host is
        # done with that call (sessions at version >= 7 only).
        "message_resume",
        # No schema change: workers build arguments with the weak type their
        # specs carry (earlier workers made them strong: a weak f32 + bf16
        # gave f32), so a weakly typed argument is refused in sessions
        # before 7 (EncodeError) rather than promoted differently.
        "weak_type_args",
        # No schema change: a remote exception pickles with its __cause__
        # (rebuild_exception's fourth argument); controllers before 7 take
        # three, so sessions before 7 leave causes out.
        "remote_exception_cause",
    )),
    VersionInfo(8, 1, (
        # No schema change: a namedtuple class registered as a custom pytree
        # node is a custom node (kind custom, its registered name and
        # auxdata).  Readers before 7 rebuild such a node as a plain
        # namedtuple of its children: wrong, silently.  Late version-7
        # writers already wrote it so, stamped readable by 1, so readers
        # read it whatever the header says (LENIENT), and `jaxcolo check`
        # finds it in the body (saying version 8, the first whose every
        # reader reads it).
        "namedtuple_custom_node",
    )),
    VersionInfo(9, 1, (
        # MessageKind.forget and Message.forgotten: the controller tells a
        # worker which programs will not be called again (their functions
        # are gone), so it drops them (sessions at version >= 9 only).
        "message_forget",
        # No schema change: symbolic text past the cost model of
        # codec/parse_cost.py (an exponent over 16, more than 4 max/min
        # nested, a product of more than 8 factors in a max/min, nested
        # max/min over 128 characters, more than 512 terms; JAX writes such
        # dims for reshapes and concatenations).  Readers from 4 until a fix
        # in 8 refused it; writers before 9 stamped it readable by older
        # readers, so readers read it whatever the header says (LENIENT),
        # and `jaxcolo check` finds it in the body.
        "symbolic_past_cost_model",
    )),
    VersionInfo(10, 1, (
        # No schema change: readers rebuild a custom node with its
        # registered from_children over its children and flatten it again,
        # as jax.export does, so auxdata its unflatten normalises (JSON
        # made a tuple a list) reads back equal.  Readers before 10 (and
        # early 9s) made the node of the auxdata as read: a different tree,
        # silently.  Needed only by nodes whose auxdata reads back
        # different; writers before 10 stamped them readable by older
        # readers, so readers read them whatever the header says (LENIENT),
        # and `jaxcolo check` finds them in the body.
        "custom_node_rebuilt",
    )),
    VersionInfo(11, 1, (
        # ExportBundle.exported_avals: the Exported's avals as a spec
        # payload, with what JAX's format drops (its scope's constraints,
        # weak types); the reader puts them back.  Readers before 11 skip
        # the field (reading the Exported as before), so it raises no
        # bundle's min reader: writers never require it.
        "export_bundle_exported_avals",
    )),
    VersionInfo(12, 1, (
        # No schema change: a remote exception whose class pickles itself
        # (OSError, ImportError, a class with its own __reduce__) pickles
        # with its __cause__ and __context__ too (chain_exception); before
        # 12 only those of classes keeping BaseException's pickling did,
        # and controllers before 12 refuse chain_exception, so sessions
        # before 12 leave such chains out.
        "remote_exception_chain_any_class",
    )),
)

FEATURE_SINCE: dict[str, int] = {
    feature: info.version for info in HISTORY for feature in info.added}

# Features read even under a header declaring an older reader (earlier
# writers stamped them so); readers note where they meet one (note_used).
LENIENT = frozenset({"mesh_without_axes", "symbolic_past_cost_model",
                     "custom_node_rebuilt",
                     "abstract_device_without_platform",
                     "hlo_last_tile_dims", "namedtuple_custom_node"})

_USED: contextvars.ContextVar = contextvars.ContextVar("jaxcolo_used",
                                                       default=None)


@contextlib.contextmanager
def noting_used():
    """Collect (into the set yielded) the LENIENT features that bodies
    decoded inside the block use; decode memos are bypassed meanwhile.
    Nested, the enclosing block's set gets them too."""
    used: set = set()
    outer = _USED.get()
    token = _USED.set(used)
    try:
        yield used
    finally:
        _USED.reset(token)
        if outer is not None:
            outer.update(used)


def noting() -> bool:
    return _USED.get() is not None


def note_used(feature: str) -> None:
    """A reader met LENIENT ``feature`` in a body."""
    if feature not in LENIENT:
        raise KeyError(f"{feature} is not a LENIENT feature")
    used = _USED.get()
    if used is not None:
        used.add(feature)

_BY_VERSION = {info.version: info for info in HISTORY}


def version_info(version: int) -> VersionInfo:
    return _BY_VERSION[version]


_KNOWN = tuple(sorted(_BY_VERSION))


def known_versions() -> tuple[int, ...]:
    return _KNOWN


def integer(value, what: str) -> int:
    """``value`` as an int if it is an integer (numpy's included, as JAX
    takes them); TypeError for bools and anything else."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{what} must be an int, got {value!r}")


def check_writable(version: int | None) -> int:
    """The version to write for ``serialize(..., version=version)``."""
    if version is None:
        return SCHEMA_VERSION
    version = integer(version, "version")
    if not MIN_READABLE_VERSION <= version <= SCHEMA_VERSION:
        raise EncodeError(
            f"cannot write version {version}: this jaxcolo writes versions "
            f"{MIN_READABLE_VERSION}..{SCHEMA_VERSION}")
    return version


def require(feature: str, version: int, path: str = "$") -> int:
    """Check that ``feature`` exists at ``version``; returns its ``since``."""
    since = FEATURE_SINCE[feature]
    if since > version:
        raise EncodeError(
            f"{feature} needs schema version {since}, but version {version} "
            "was requested", path)
    return since
