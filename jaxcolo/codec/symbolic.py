"""Bounded parsing of symbolic dimension text with JAX's own shape_poly.

Symbolic dimensions and constraints travel as the text JAX prints for them
(``2*a + b``, ``a^3``, ``mod(a, 4)``, ``max(a, b)``) and are parsed back by
``shape_poly``.  Parsing costs time roughly proportional to the text, except:

* powers: ``a^N`` multiplies N times;
* nested ``max``/``min``: each level costs about 2.5x the one inside it
  (JAX works out bounds of both operands), so ``max`` nested 15 deep in
  150 characters would take hours;
* products of sums: JAX multiplies them out, so a product of k two-term
  factors builds 2**k terms (a bound of the terms, by JAX's grammar, is
  charged and limited to :data:`MAX_TERMS`).

So the text is tokenized first (:mod:`jaxcolo.codec.parse_cost`, where the
limits named here live), with the tokenizer JAX's parser uses (it
reads ``1_000`` and line continuations exactly as the parser will), and on
both sides:

* a line break or backslash, an exponent above :data:`MAX_EXPONENT` (JAX
  builds a list that long before any work that can be counted), or text
  that can make JAX compute ints of more than :data:`MAX_MAGNITUDE_BITS`
  bits (constants, their powers, bounds its constraints give: their
  arithmetic runs in C, uncounted) is refused (EncodeError when writing,
  PayloadError when reading);
* text within the cost model (exponents up to :data:`MODELLED_EXPONENT`, at
  most :data:`MAX_MINMAX_GROUP` max/min nested in one another, products of
  at most :data:`MAX_MINMAX_FACTORS` factors inside a max/min, nested
  max/min within :data:`MAX_NESTED_GROUP_TEXT` characters, at most
  :data:`MAX_TERMS` terms multiplied out) is charged by it: its length,
  plus each exponent and term, in units of about 3.5 us, to
  its buffer's parse budget (:meth:`jaxcolo.wire.Buffer.charge_parse`,
  :func:`jaxcolo.wire.parse_budget`), so the total parse work stays
  proportional to the payload size even when one string is referenced
  from many places; the spec writer adds up the same charges and refuses a
  payload a reader would refuse;
* text with max/min is parsed with JAX's work counted too, as below: the
  model charges a group by its length (as readers before this did;
  writers charge the larger of the two), but JAX works out bounds of the
  operands, in time growing with their names and terms (113 characters
  of nested max/min over sums of 7 names take 16 s, one max over a sum of
  18 mod terms 12 s);
* text past the model (JAX writes such dims: ``a^17`` for a reshape of a
  rank-17 array, ``min(n0, n0 + ... + n29)`` for a slice of a
  concatenation) is charged its length and parsed with JAX's work counted,
  as below (readers before version 9 refuse it).

Constraints are what no text cost can model: JAX's decision
procedure combines them by elimination, and chained constraints
(``v0 >= v1 + v2``, ``v1 >= v2 + v3``, ...) make its work exponential in their
number (6 of them: >10**7 steps for one ``max``).  So whatever JAX does inside
a scope that has constraints (building it, parsing a dim in it), and its
parse of text with max/min or past the model, is counted as
it runs (:mod:`jaxcolo.codec.counted`: Python calls and returns), charged to the same parse budget (:data:`EVENTS_PER_UNIT` per unit)
and stopped at the budget.  The writer runs the same parses in a fresh scope
and charges twice what it counted (without constraints, where JAX's work is
the same each time, :data:`FREE_TRIAL_MARGIN` times); a reader gives the first such work of a
payload :data:`COLD_START_EVENTS` free (JAX's first constrained scope in a
process costs more).  JAX's work there varies from run to run (it iterates
sets), so the margins make a refusal by a reader unlikely, not impossible,
and only for constraints that take JAX itself seconds.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref

from jax._src.export import shape_poly

from jaxcolo.codec.counted import OutOfBudget, run_counted
from jaxcolo.codec.parse_cost import constraint_bits, parse_cost, scope_bits
from jaxcolo import versions
from jaxcolo.errors import EncodeError, PayloadError

# Text past the cost model (an exponent over 16, more than 4 max/min
# nested, a product of more than 8 factors in a max/min, nested max/min
# over 128 characters, more than 512 terms): readers from version 4 until a
# fix in version 8 refused it (versions.py).
PAST_MODEL = "symbolic_past_cost_model"
_PAST_MODEL_SEEN: contextvars.ContextVar = contextvars.ContextVar(
    "jaxcolo_past_model", default=None)


@contextlib.contextmanager
def noting_past_model():
    """Collect (into the list yielded) the paths of symbolic text past the
    cost model that writers inside the block write (for writers of formats
    with no feature list of their own: a bundle's Exported)."""
    seen: list = []
    token = _PAST_MODEL_SEEN.set(seen)
    try:
        yield seen
    finally:
        _PAST_MODEL_SEEN.reset(token)


def writable_cost(text: str, path: str, name_bits: int = 0):
    """The cost (parse_cost.Cost) of ``text`` to a reader: ``units`` it
    charges by the cost model; ``counted``: past the model (readers before
    PAST_MODEL's version refuse it); ``work_counted``: a reader counts
    JAX's work on it too (a writer's trial parse tells how much).
    EncodeError if no reader parses it (``name_bits``: see
    :func:`scope_bits`)."""
    cost = parse_cost(text, name_bits)
    if cost.refused is not None:
        raise EncodeError(f"symbolic expression {text[:200]!r} "
                          f"{cost.refused}", path)
    if cost.counted:
        seen = _PAST_MODEL_SEEN.get()
        if seen is not None:
            seen.append(path)
    return cost


def legacy_or_current_charge(cost, work: int, constrained: bool) -> int:
    """The larger of what readers charge for text of ``cost`` whose parse
    takes ``work`` units of JAX's work (a trial's): this reader charges
    ``read_units`` and counts the work of every ``work_counted`` text;
    readers before it charge ``units`` and count the work of text past the
    model (``counted``) or in a scope with constraints only."""
    legacy = cost.units + (work if cost.counted or constrained else 0)
    current = cost.read_units + (work if cost.work_counted or constrained
                                 else 0)
    return max(legacy, current)


def writable_text(text: str, path: str,
                  name_bits: int = 0) -> tuple[int, bool]:
    """(``units``, ``counted``) of :func:`writable_cost`."""
    cost = writable_cost(text, path, name_bits)
    return cost.units, cost.counted


def check_writable_constraints(constraints, path: str) -> tuple[int, bool]:
    """(the parse units a reader charges for a scope's ``constraints`` by
    the cost model (JAX's work building it is counted: the writer runs
    that trial itself), whether one is past the model); EncodeError if no
    reader builds it."""
    units, past = 0, False
    for c, bits in zip(constraints, constraint_bits(constraints)):
        u, counted = writable_text(c, path, bits)
        units += u
        past |= counted
    return units, past


def _charge(buf, text: str, path: str, name_bits: int = 0) -> bool:
    """Charge ``text`` to ``buf``'s parse budget by the cost model; True if
    JAX's work on it must be counted too.  PayloadError if it is refused."""
    cost = parse_cost(text, name_bits)
    if cost.refused is not None:
        raise PayloadError(f"symbolic expression {text[:80]!r} "
                           f"{cost.refused}", path)
    if buf is not None:
        buf.charge_parse(cost.read_units, path)
    if cost.counted and versions.noting():
        versions.note_used(PAST_MODEL)  # (read under any header)
    return cost.work_counted


_SCOPE_BITS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def bits_of_scope(scope) -> int:
    """``scope_bits`` of ``scope``'s constraints (remembered)."""
    if scope is None or not scope._explicit_constraints:
        return 0
    bits = _SCOPE_BITS.get(scope)
    if bits is None:
        bits = _SCOPE_BITS[scope] = scope_bits(
            c.debug_str for c in scope._explicit_constraints)
    return bits


# Profile events (Python calls and returns) per parse unit: counted, each
# takes 0.15-0.24 us of JAX's work and the count's (measured: sums of
# thousands of names, powers of sums with growing coefficients).
EVENTS_PER_UNIT = 16
# JAX's work parsing text in a scope without constraints is the same to a
# few events each time (measured); a writer's trial of it is charged with
# this margin (with constraints: 2x).
FREE_TRIAL_MARGIN = 1.125
# A writer's trial parses stop here (~1 s of JAX's work): EncodeError.
MAX_TRIAL_EVENTS = 1 << 23
# JAX's first constrained scope in a process costs ~12k events (~1.3k warm).
COLD_START_EVENTS = 1 << 15


def empty_scope():
    """A fresh scope without constraints, for a writer's trial parse."""
    return shape_poly.SymbolicScope(())


def _has_constraints(scope) -> bool:
    return bool(scope is not None and scope._explicit_constraints)


def _run_charged(fn, buf, what: str, path: str):
    """fn() (JAX's work on constrained or costly symbolic text), its events
    charged to ``buf``'s parse budget; PayloadError once over it.  The
    first such work of a buffer has COLD_START_EVENTS free (what JAX's
    first constrained scope in a process costs, which a writer's warm trial
    does not see)."""
    free = buf.memo.get("constraint_events_free", COLD_START_EVENTS)
    try:
        out, events = run_counted(
            fn, max(buf.parse_left, 0) * EVENTS_PER_UNIT + free)
    except OutOfBudget:
        raise PayloadError(
            f"{what} takes JAX's work out of proportion to the payload "
            "size (chained constraints, or costly text)", path) from None
    used_free = min(free, events)
    buf.memo["constraint_events_free"] = free - used_free
    buf.charge_parse((events - used_free) // EVENTS_PER_UNIT, path)
    return out


# Bounds JAX caches in a scope, past which a decode's first parse in the
# scope clears them: a scope may outlive a decode (one the application
# holds, which readers reuse for payloads naming it), and each decode's
# dims would add their bounds there for good (~1 KB each).  JAX clears
# them itself at times; they are only a cache.  Never cleared during a
# decode: a writer's trial (one scope, never cleared) finds the work of
# bounds that dims share charged once, and so must the reader.
MAX_CACHED_BOUNDS = 1024


def parse_shape(text: str, scope, buf, path: str) -> tuple:
    """``shape_poly.symbolic_shape(text, scope=scope)``, bounded; charged to
    ``buf`` (a wire.Buffer, or None).  PayloadError for any bad text."""
    if buf is not None and scope is not None:
        seen = buf.memo.setdefault("scopes parsed in", set())
        if id(scope) not in seen:  # (the buffer holds scope via its dims)
            seen.add(id(scope))
            cache = getattr(scope, "_bounds_cache", None)
            if cache is not None and len(cache) > MAX_CACHED_BOUNDS:
                cache.clear()
    return _parse_shape(text, scope, buf, path)


def _parse_shape(text: str, scope, buf, path: str) -> tuple:
    counted = _charge(buf, text, path, bits_of_scope(scope))
    try:
        if counted and buf is None:  # bounded as a writer's trial
            return _trial_units(
                lambda: shape_poly.symbolic_shape(text, scope=scope),
                f"parsing {text[:80]!r}", path, PayloadError)[0]
        if buf is not None and (counted or _has_constraints(scope)):
            return _run_charged(
                lambda: shape_poly.symbolic_shape(text, scope=scope), buf,
                f"parsing {text[:80]!r}", path)
        return shape_poly.symbolic_shape(text, scope=scope)
    except PayloadError:
        raise
    except Exception as e:  # syntax errors, absurd nesting
        raise PayloadError(f"invalid symbolic shape {text[:200]!r}: {e}",
                           path) from None


def make_scope(constraints: tuple, buf, path: str):
    """``shape_poly.SymbolicScope(constraints)``, bounded like parse_shape."""
    counted = False
    for i, (c, bits) in enumerate(zip(constraints,
                                      constraint_bits(constraints))):
        counted |= _charge(buf, c, f"{path}[{i}]", bits)
    try:
        if counted and buf is None:  # bounded as a writer's trial
            return _trial_units(lambda: shape_poly.SymbolicScope(constraints),
                                "building the scope", path, PayloadError)[0]
        if buf is not None and constraints:
            return _run_charged(lambda: shape_poly.SymbolicScope(constraints),
                                buf, "building the scope", path)
        return shape_poly.SymbolicScope(constraints)
    except PayloadError:
        raise
    except Exception as e:
        raise PayloadError(f"invalid symbolic constraints: {e}", path) \
            from None


def _trial_units(fn, what: str, path: str, error=EncodeError,
                 margin: float = 2.0):
    """(fn(), parse units a reader is charged for it, times ``margin``)."""
    try:
        out, events = run_counted(fn, MAX_TRIAL_EVENTS)
    except OutOfBudget:
        raise error(
            f"{what} takes JAX's work over {MAX_TRIAL_EVENTS} steps; a "
            "reader would refuse it (chained constraints, or costly text)",
            path) from None
    return out, int(margin * events) // EVENTS_PER_UNIT


def trial_scope(constraints: tuple, path: str):
    """(a fresh scope of ``constraints``, the units a reader is charged for
    building it beyond its text), as a reader builds it."""
    try:
        return _trial_units(lambda: shape_poly.SymbolicScope(constraints),
                            "building the scope", path)
    except EncodeError:
        raise
    except Exception as e:  # the writer's own scope: not expected
        raise EncodeError(f"its constraints do not parse back: {e}",
                          path) from None


def trial_shape_units(text: str, path: str, margin: float) -> int:
    """The units a reader is charged for JAX's work parsing shape ``text``
    (dims joined by commas) in a scope without constraints, times
    ``margin`` (that work is the same, to a few events, every time)."""
    try:
        return _trial_units(
            lambda: shape_poly.symbolic_shape(text, scope=empty_scope()),
            f"parsing {text[:80]!r}", path, margin=margin)[1]
    except EncodeError:
        raise
    except Exception as e:
        raise EncodeError(f"symbolic shape {text[:80]!r} does not parse "
                          f"back: {e}", path) from None


def trial_parse_units(text: str, scope, path: str, dim,
                      margin: float = 2.0) -> int:
    """The units a reader is charged for parsing ``text`` (the printed form
    of ``dim``) in ``scope`` (the trial scope of its constraints) beyond its
    text, times ``margin``; EncodeError unless it reads back equal to ``dim``.  Equality
    constraints may rewrite what is parsed: with ``a == 2*b`` and
    ``b == mod(c, 3) + 1``, ``max(a, c)`` prints as ``max(2*b, c)`` and
    reads back as ``max(2*mod(c, 3) + 2, c)``, which JAX does not find
    equal to it (``a`` itself reads back as ``2*mod(c, 3) + 2``, equal)."""
    try:
        dims, units = _trial_units(
            lambda: shape_poly.symbolic_shape(text, scope=scope),
            f"parsing {text[:80]!r}", path, margin=margin)
    except EncodeError:
        raise
    except Exception as e:
        raise EncodeError(f"symbolic dim {text[:80]!r} does not parse back: "
                          f"{e}", path) from None
    back = str(dims[0]) if len(dims) == 1 else str(dims)
    if back == text:  # the same expression (the usual case)
        return units
    # Another form: is it equal to ``dim``, in its own scope (where a
    # reader in this process reads it, and where equality is defined)?
    equal, _ = _trial_units(
        lambda: dim == shape_poly.symbolic_shape(text, scope=dim.scope)[0],
        f"comparing {text[:80]!r} with what it reads back as", path)
    if not equal:
        raise EncodeError(
            f"symbolic dim {text[:80]!r} reads back as {back[:80]!r} under "
            "its scope's constraints (an equality constraint rewrites it), "
            "which is not equal to it", path)
    return units
