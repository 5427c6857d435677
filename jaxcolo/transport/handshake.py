"""The Hello payload and version negotiation between controller and worker.

Right after authentication each side sends a Hello (its readable payload
version range, role, software, and for workers the controller device ids it
owns).  Both sides then compute the same agreed version with
:func:`negotiate`: the highest version inside both ranges.  No common version
raises :class:`jaxcolo.VersionError` naming both ranges and who must upgrade
(or raise the version limit it was told to keep to).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

import jaxcolo_fb as fb
from jaxcolo_fb import RootKind
from jaxcolo import envelope, versions
from jaxcolo.errors import PayloadError, VersionError
from jaxcolo.fastbuilder import FastBuilder
from jaxcolo.wire import Buffer, layout

L = layout(fb, "Hello")
ROLES = ("controller", "worker")
MAX_DEVICES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Hello:
    min_version: int
    max_version: int
    role: str
    software: str = ""
    host_index: int = 0
    device_ids: tuple[int, ...] = ()

    def range_text(self) -> str:
        return f"{self.min_version}..{self.max_version}"


def software_string() -> str:
    from importlib import metadata
    try:
        jax_version = metadata.version("jax")
    except metadata.PackageNotFoundError:
        jax_version = "?"
    return f"jaxcolo schema {versions.SCHEMA_VERSION} / jax {jax_version}"


def local_hello(role: str, *, min_version: int | None = None,
                max_version: int | None = None, host_index: int = 0,
                device_ids=()) -> Hello:
    """This process's Hello; the range defaults to everything it supports
    and may only narrow it (ValueError otherwise: a peer would agree on a
    version this process cannot speak)."""
    lo = versions.MIN_READABLE_VERSION if min_version is None else \
        versions.integer(min_version, "min_version")
    hi = versions.SCHEMA_VERSION if max_version is None else \
        versions.integer(max_version, "max_version")
    ok = range(versions.MIN_READABLE_VERSION, versions.SCHEMA_VERSION + 1)
    if lo not in ok or hi not in ok or lo > hi:
        raise ValueError(
            f"payload version range {lo}..{hi} is not within this jaxcolo's "
            f"{ok.start}..{ok.stop - 1}, low to high")
    return Hello(lo, hi, role, software_string(), host_index,
                 tuple(int(i) for i in device_ids))


def encode_hello(hello: Hello) -> bytes:
    """A Hello payload, readable by every version that has a transport."""
    b = FastBuilder(128)
    role = b.CreateString(hello.role)
    software = b.CreateString(hello.software)
    ids = b.CreateNumpyVector(np.asarray(hello.device_ids, np.uint32)) \
        if hello.device_ids else 0
    fb.HelloStart(b)
    fb.HelloAddMinVersion(b, hello.min_version)
    fb.HelloAddMaxVersion(b, hello.max_version)
    fb.HelloAddRole(b, role)
    fb.HelloAddSoftware(b, software)
    fb.HelloAddHostIndex(b, hello.host_index)
    if ids:
        fb.HelloAddDeviceIds(b, ids)
    b.Finish(fb.HelloEnd(b))
    since = versions.FEATURE_SINCE["hello"]
    return envelope.seal(b.Output(), RootKind.hello, since, since)


@envelope.shares_inflation
def decode_hello(data) -> Hello:
    """Read a peer's Hello.  Only the envelope's checksum and root kind are
    judged here, not its version: the point is to compare versions."""
    header = envelope.read_header(data)
    if header.root_kind != RootKind.hello:
        raise PayloadError(f"expected a Hello, got root kind "
                           f"{header.root_kind}", "$.header.root_kind")
    root = Buffer(envelope.open_body(data, header)).root("$")
    lo = root.scalar(L.min_version, "u16", 0, "$", "min_version")
    hi = root.scalar(L.max_version, "u16", 0, "$", "max_version")
    if not 1 <= lo <= hi:
        raise PayloadError(f"invalid version range {lo}..{hi}",
                           "$.min_version")
    role = root.string(L.role, "$", "role")
    if role not in ROLES:
        raise PayloadError(f"unknown role {role!r}", "$.role")
    n = root.vector_length(L.device_ids, 4, "$", "device_ids")
    if n > MAX_DEVICES:
        raise PayloadError(f"{n} device ids", "$.device_ids")
    ids = root.ints(L.device_ids, "u32", "$", "device_ids")
    if len(set(ids)) != len(ids):
        raise PayloadError("duplicate device ids", "$.device_ids")
    return Hello(lo, hi, role, root.string(L.software, "$", "software") or "",
                 root.scalar(L.host_index, "u32", 0, "$", "host_index"),
                 tuple(ids))


def decode_hello_root(data, device_resolver=None) -> Hello:
    """``jaxcolo.deserialize`` of a Hello payload (root kind registry)."""
    return decode_hello(data)


def inspect_hello(data, header) -> dict:
    """``jaxcolo.inspect`` content of a Hello payload."""
    hello = dataclasses.asdict(decode_hello(data))
    hello["device_ids"] = list(hello["device_ids"])  # JSON-friendly
    return {"hello": hello}


def _advice(hello: Hello, whose: str, needed: int) -> str:
    """What the side of ``hello`` must change to speak version ``needed``:
    its version limit if its software writes that version but it was told
    to speak older ones, else its jaxcolo."""
    m = re.search(r"schema (\d+)", hello.software or "")
    if m and int(m.group(1)) >= needed > hello.max_version:
        option = "--max-version" if hello.role == "worker" else "max_version"
        return (f"raise {whose} {option} (its jaxcolo writes up to version "
                f"{m.group(1)})")
    return f"upgrade {whose} jaxcolo"


def negotiate(local: Hello, remote: Hello, *, need: int = 1) -> int:
    """The highest payload version both sides read, at least ``need``."""
    agreed = min(local.max_version, remote.max_version)
    if agreed < max(local.min_version, remote.min_version, need):
        if local.max_version < remote.min_version or local.max_version < need:
            advice = _advice(local, f"this {local.role}'s",
                             max(remote.min_version, need))
        else:
            advice = _advice(remote, f"the {remote.role}'s",
                             max(local.min_version, need))
        needs = f" (executor calls need version >= {need})" if need > 1 else ""
        raise VersionError(
            f"no common payload version: this {local.role} speaks "
            f"{local.range_text()} ({local.software or '?'}), the "
            f"{remote.role} speaks {remote.range_text()} "
            f"({remote.software or '?'}){needs}; {advice}",
            "$.hello")
    return agreed


def _register() -> None:
    """Make this root kind known to jaxcolo.deserialize / jaxcolo.inspect."""
    from jaxcolo.inspection import register_inspector
    from jaxcolo.payload import register_root
    register_root(RootKind.hello, decode_hello_root)
    register_inspector(RootKind.hello, inspect_hello)


_register()
