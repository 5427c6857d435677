"""Symbolic scopes: the constraints symbolic dims are parsed in.

A scope is stored as its constraint texts, parsed back with JAX's own
shape_poly in a SymbolicScope rebuilt from them.  JAX compares dims by scope
identity, so each distinct scope object is its own entry with a token
(version 6): random per scope in the writing process, and kept by a scope a
reader made, so a scope that travels out and back is the same object again.
A reader maps a token to the live scope it names (made by this process's
writer or an earlier decode), else to a new scope.  Thus a round trip gives
dims equal to the originals, two scopes with equal constraints stay apart,
and payloads decoded one after another agree on their scopes.  Readers
before version 6 (and payloads written for them) know a scope only by its
constraints: they use the live scope most recently encoded or decoded with
those constraints, and a payload with two distinct scopes of equal
constraints needs version 6.
"""

from __future__ import annotations

import os
import threading
import weakref

from jax._src.export import shape_poly

import jaxcolo_fb as fb
from jaxcolo import versions
from jaxcolo.codec.core import register_table
from jaxcolo.codec.symbolic import PAST_MODEL, check_writable_constraints, \
    make_scope, trial_scope
from jaxcolo.errors import EncodeError
from jaxcolo.fastbuilder import string_vector
from jaxcolo.wire import layout

LC = layout(fb, "SymbolicScope")

_SCOPES: "weakref.WeakValueDictionary[tuple, shape_poly.SymbolicScope]" = \
    weakref.WeakValueDictionary()  # constraints -> latest scope (no token)
_BY_TOKEN: "weakref.WeakValueDictionary[int, shape_poly.SymbolicScope]" = \
    weakref.WeakValueDictionary()
_TOKENS: "weakref.WeakKeyDictionary[shape_poly.SymbolicScope, int]" = \
    weakref.WeakKeyDictionary()
_TOKEN_LOCK = threading.Lock()
_IDENTITY = "symbolic_scope_identity"


def scope_constraints(scope) -> tuple:
    return tuple(c.debug_str for c in scope._explicit_constraints)


def _scope_token(scope) -> int:
    """The token of ``scope``: a random non-zero u64, made on first use."""
    token = _TOKENS.get(scope)
    if token is None:
        with _TOKEN_LOCK:
            token = _TOKENS.get(scope)
            if token is None:
                token = int.from_bytes(os.urandom(8), "little") or 1
                _TOKENS[scope] = token
                _BY_TOKEN[token] = scope
    return token


def scope_entry(writer, scope, path) -> int:
    """1 + the index of ``scope``'s entry in the payload's scopes table."""
    hit = writer.memo.get(("scope", id(scope)))
    if hit is not None:
        return hit
    key = scope_constraints(scope)
    units, past_model = check_writable_constraints(key, path + ".scope")
    if past_model:
        writer.require(PAST_MODEL, path + ".scope")
    if key:  # what JAX's reasoning about the constraints costs a reader
        trial, extra = trial_scope(key, path + ".scope")
        writer.memo[("trial scope", id(scope))] = trial
        units += extra
    writer.parsed[("scope", id(scope))] = units
    _SCOPES[key] = scope  # the latest encoded scope wins (for old readers)
    seen = writer.memo.setdefault("scope constraints", set())
    if key in seen:  # another scope with equal constraints is in this payload
        if writer.version < versions.FEATURE_SINCE[_IDENTITY]:
            raise EncodeError(
                "symbolic dims from two distinct scopes with equal "
                f"constraints {list(key)}: readers before version "
                f"{versions.FEATURE_SINCE[_IDENTITY]} cannot tell them apart "
                "(make the shapes in one SymbolicScope, or write a newer "
                "version)", path)
        writer.require(_IDENTITY, path)
    seen.add(key)
    ref = 1 + writer.intern("scopes", ("scope", id(scope)),
                            (key, _scope_token(scope), scope))
    writer.memo[("scope", id(scope))] = ref
    return ref


def build_scope(writer, builder, item) -> int:
    constraints, token, _ = item
    off = string_vector(builder, constraints)
    fb.SymbolicScopeStart(builder)
    fb.SymbolicScopeAddConstraints(builder, off)
    if writer.version >= versions.FEATURE_SINCE[_IDENTITY]:
        fb.SymbolicScopeAddToken(builder, token)
    return fb.SymbolicScopeEnd(builder)


def decode_scope(reader, t, path):
    constraints = tuple(t.strings(LC.constraints, path, "constraints"))
    seen = reader.state.setdefault("scope constraints", set())
    if constraints in seen:  # only writers of version >= 6 repeat them
        reader.check_declared(_IDENTITY, path)
    seen.add(constraints)
    token = t.scalar(LC.token, "u64", 0, path, "token")
    if token:
        scope = _BY_TOKEN.get(token)
        if scope is not None and scope_constraints(scope) == constraints:
            return scope
    else:
        scope = _SCOPES.get(constraints)
        if scope is not None:
            return scope
    scope = make_scope(constraints, t.buf, f"{path}.constraints")
    with _TOKEN_LOCK:  # another thread may have made it meanwhile: its
        if token:      # scope is the one (dims of two are not comparable)
            held = _BY_TOKEN.get(token)
            if held is None:
                _BY_TOKEN[token] = scope
                _TOKENS[scope] = token
            elif scope_constraints(held) == constraints:
                return held
            # else: a token reused with other constraints keeps its scope
        else:
            held = _SCOPES.get(constraints)
            if held is not None:
                return held
        _SCOPES[constraints] = scope
    return scope


register_table("scopes", build_scope, decode_scope)
