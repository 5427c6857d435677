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

So the text is tokenized first, with the tokenizer JAX's parser uses (it
reads ``1_000`` and line continuations exactly as the parser will), and on
both sides:

* a line break or backslash, an exponent above :data:`MAX_EXPONENT` (JAX
  builds a list that long before any work that can be counted), or a
  product whose constants have more than :data:`MAX_CONSTANT_DIGITS` digits
  (they multiply in C, in time quadratic in their digits) is refused
  (EncodeError when writing, PayloadError when reading);
* text within the cost model (exponents up to :data:`MODELLED_EXPONENT`, at
  most :data:`MAX_MINMAX_GROUP` max/min nested in one another, products of
  at most :data:`MAX_MINMAX_FACTORS` factors inside a max/min, nested
  max/min within :data:`MAX_NESTED_GROUP_TEXT` characters, at most
  :data:`MAX_TERMS` terms multiplied out) is charged by it: its length,
  plus each exponent and each max/min group, in units of about 3.5 us, to
  its buffer's parse budget (:meth:`jaxcolo.wire.Buffer.charge_parse`,
  :func:`jaxcolo.wire.parse_budget`), so the total parse work stays
  proportional to the payload size even when one string is referenced
  from many places; the spec writer adds up the same charges and refuses a
  payload a reader would refuse;
* text past the model (JAX writes such dims: ``a^17`` for a reshape of a
  rank-17 array, ``min(n0, n0 + ... + n29)`` for a slice of a
  concatenation) is charged its length and parsed with JAX's work counted,
  as below.

Constraints are what no text cost can model: JAX's decision
procedure combines them by elimination, and chained constraints
(``v0 >= v1 + v2``, ``v1 >= v2 + v3``, ...) make its work exponential in their
number (6 of them: >10**7 steps for one ``max``).  So whatever JAX does inside
a scope that has constraints (building it, parsing a dim in it), and its
parse of text past the model, is counted as
it runs (:mod:`jaxcolo.codec.counted`: Python calls and returns), charged to the same parse budget (:data:`EVENTS_PER_UNIT` per unit)
and stopped at the budget.  The writer runs the same parses in a fresh scope
and charges twice what it counted; a reader gives the first such work of a
payload :data:`COLD_START_EVENTS` free (JAX's first constrained scope in a
process costs more).  JAX's work there varies from run to run (it iterates
sets), so the margins make a refusal by a reader unlikely, not impossible,
and only for constraints that take JAX itself seconds.
"""

from __future__ import annotations

import io
import re
import tokenize
from typing import NamedTuple

from jax._src.export import shape_poly

from jaxcolo.codec.counted import OutOfBudget, run_counted
from jaxcolo.errors import EncodeError, PayloadError

# Text the cost model below covers is charged by it.  Text past one of
# its limits is parsed with JAX's work counted as it runs instead (as in a
# scope with constraints), charged to the same budget and stopped there.
# a^16 parses in ~70 us, like ~20 characters of other text.
MODELLED_EXPONENT = 16
_EXPONENT_COST = 1  # parse units per unit of exponent (a multiplication)
# JAX builds a list as long as an exponent before any counted work.
MAX_EXPONENT = 1024
# Constants multiply in C, uncounted, in time quadratic in their digits:
# a product term's constants may have this many digits in all (JAX prints
# dims that fit in int64; their products, 38 digits).
MAX_CONSTANT_DIGITS = 64
# max/min nested in one another form a group; a group of n costs about
# _MINMAX_COST[n] units (measured: 4 nested take ~0.8 ms, 8 take ~32 ms).
MAX_MINMAX_GROUP = 4
_MINMAX_COST = (0, 4, 30, 100, 300)
_MINMAX = ("max", "min")
# Bounds of a product inside max/min cost ~2x per factor (12: ~3 ms).
MAX_MINMAX_FACTORS = 8
# Nested max/min cost about the square of their text (5 sums of 5 terms,
# 113 characters: ~22 ms): such a group is charged its length squared;
# longer ones are counted.
MAX_NESTED_GROUP_TEXT = 128
_LINE_BREAKS = re.compile(r"[\\\x00-\x08\x0a-\x1f\x7f]")
_TERM_ENDS = (tokenize.PLUS, tokenize.MINUS, tokenize.COMMA)
_SKIPPED = (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT)


class _Cost(NamedTuple):
    units: int                  # parse units the model charges
    refused: str | None = None  # why no reader parses it
    counted: bool = False       # past the model: count JAX's work


def _parse_cost(text: str) -> _Cost:
    """What parsing ``text`` costs, by the tokens JAX's parser will see."""
    if _LINE_BREAKS.search(text):  # JAX never prints these
        return _Cost(0, "has a line break, backslash or control character")
    cost = len(text)
    counted = False  # a limit of the model was passed
    opens: list[tuple[bool, int, int]] = []  # per open parenthesis: (opened
    # by max/min, factors and constant digits of the term it interrupted)
    inside = group = factors = digits = 0  # open max/min parentheses; size
    # of their group; names and constant digits in the current product term
    prev = prev_text = None
    group_start = base_digits = 0
    toks = []  # (kind, text) of the significant tokens, for _Expansion
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            kind = tok.exact_type
            if kind in _SKIPPED:
                continue
            toks.append((kind, tok.string))
            if kind == tokenize.NUMBER and prev == tokenize.CIRCUMFLEX:
                try:
                    power = int(tok.string)
                except ValueError:
                    power = None
                if power is None or power > MAX_EXPONENT:
                    return _Cost(0, f"has an exponent {tok.string[:20]!r} "
                                 f"above {MAX_EXPONENT}")
                if power > MODELLED_EXPONENT:
                    counted = True
                cost += _EXPONENT_COST * power
                digits += base_digits * (power - 1)  # a constant's power
            elif kind == tokenize.NUMBER:
                digits += len(tok.string)
            elif kind == tokenize.NAME:
                factors += 1
                if inside and factors > MAX_MINMAX_FACTORS:
                    counted = True
            elif kind == tokenize.LPAR:
                minmax = prev == tokenize.NAME and prev_text in _MINMAX
                opens.append((minmax, factors, digits))
                factors = digits = 0
                if minmax:
                    if not inside:
                        group, group_start = 1, tok.start[1]
                    else:
                        group += 1
                    inside += 1
                    if group > MAX_MINMAX_GROUP:
                        counted = True
            elif kind == tokenize.RPAR and opens:
                minmax, factors, digits = opens.pop()
                if minmax:
                    inside -= 1
                    if not inside:
                        length = tok.end[1] - group_start
                        if group > 1 and length > MAX_NESTED_GROUP_TEXT:
                            counted = True
                        elif not counted:
                            cost += _group_cost(group, length)
            elif kind in _TERM_ENDS:
                factors = digits = 0
            if digits > MAX_CONSTANT_DIGITS:
                return _Cost(0, "has constants of more than "
                             f"{MAX_CONSTANT_DIGITS} digits in one product")
            if kind == tokenize.CIRCUMFLEX:  # the digits of its base
                base_digits = len(prev_text) if prev == tokenize.NUMBER else 0
            prev, prev_text = kind, tok.string
    except (tokenize.TokenError, SyntaxError) as e:
        return _Cost(0, f"is not valid symbolic text ({e.args[0]})")
    if counted:
        return _Cost(cost, None, True)
    if inside:  # unclosed: the parser will refuse it
        cost += _MINMAX_COST[min(group, MAX_MINMAX_GROUP)]
    terms = _Expansion(toks).bound()
    if terms > MAX_TERMS:
        return _Cost(cost, None, True)
    return _Cost(cost + _TERM_COST * terms)


# JAX multiplies products of sums out (max(a + b, 0) is a + b once bounds
# show a + b >= 0), so a product of k two-term factors builds 2**k terms
# (17 such factors in 300 characters: 12 s).  ~90 us per term.
MAX_TERMS = 512
_TERM_COST = 25
_OPERATIONS = ("max", "min", "mod", "floordiv")
_MAX_DEPTH = 64


class _Expansion:
    """An upper bound of the terms JAX's parser builds for a text, by its
    grammar (sums of products of powers of names, numbers and operations
    on two sums); anything else is left to the parser to refuse."""

    def __init__(self, toks: list):
        self.toks = toks  # (exact token type, text), layout tokens left out
        self.i = 0

    def bound(self) -> int:
        total = 0
        try:
            while self.i < len(self.toks) and total <= MAX_TERMS:
                kind = self.toks[self.i][0]
                if kind in (tokenize.NAME, tokenize.NUMBER, tokenize.MINUS,
                            tokenize.PLUS):
                    total += self.expr(0)
                else:  # shape parentheses, commas, comparisons
                    self.i += 1
        except (IndexError, ValueError, RecursionError):
            return MAX_TERMS + 1 if total > MAX_TERMS else total
        return total

    def _peek(self):
        return self.toks[self.i][0] if self.i < len(self.toks) else None

    def expr(self, depth: int) -> int:
        if depth > _MAX_DEPTH:
            raise ValueError("too deep")
        if self._peek() in (tokenize.PLUS, tokenize.MINUS):
            self.i += 1
        total = self.term(depth)
        while self._peek() in (tokenize.PLUS, tokenize.MINUS):
            self.i += 1
            total = min(total + self.term(depth), MAX_TERMS + 1)
        return total

    def term(self, depth: int) -> int:
        product = 1
        while True:
            factor = self.factor(depth)
            if self._peek() == tokenize.CIRCUMFLEX:
                self.i += 1
                power = int(self.toks[self.i][1]) if \
                    self._peek() == tokenize.NUMBER else 1
                self.i += 1
                factor = min(factor ** min(power, 10), MAX_TERMS + 1)
            product = min(product * factor, MAX_TERMS + 1)
            if self._peek() != tokenize.STAR:
                return product
            self.i += 1

    def factor(self, depth: int) -> int:
        kind, text = self.toks[self.i]
        self.i += 1
        if kind == tokenize.NAME and text in _OPERATIONS and \
                self._peek() == tokenize.LPAR:
            self.i += 1
            first = self.expr(depth + 1)
            if self._peek() != tokenize.COMMA:
                raise ValueError("not an operation")
            self.i += 1
            second = self.expr(depth + 1)
            self.i += 1  # the closing parenthesis
            return max(first, second)  # one operand, or the operation
        if kind == tokenize.MINUS:  # a negative number
            self.i += 1
        return 1


def _group_cost(group: int, length: int) -> int:
    """Parse units of a max/min group of ``group`` (at most
    MAX_MINMAX_GROUP) nested in ``length`` characters (at most
    MAX_NESTED_GROUP_TEXT, if nested)."""
    if group == 1:
        return _MINMAX_COST[1]
    return _MINMAX_COST[group] + length * length


def writable_text(text: str, path: str) -> tuple[int, bool]:
    """(the parse units a reader charges for ``text`` by the cost model,
    whether it counts JAX's work on it too); EncodeError if no reader
    parses it."""
    cost = _parse_cost(text)
    if cost.refused is not None:
        raise EncodeError(f"symbolic expression {text[:200]!r} "
                          f"{cost.refused}", path)
    return cost.units, cost.counted


def check_writable_text(text: str, path: str) -> int:
    """``writable_text``'s units, for text whose parse a reader counts only
    in a scope with constraints (the writer runs that trial itself)."""
    return writable_text(text, path)[0]


def _charge(buf, text: str, path: str) -> bool:
    """Charge ``text`` to ``buf``'s parse budget by the cost model; True if
    JAX's work on it must be counted too.  PayloadError if it is refused."""
    cost = _parse_cost(text)
    if cost.refused is not None:
        raise PayloadError(f"symbolic expression {text[:80]!r} "
                           f"{cost.refused}", path)
    if buf is not None:
        buf.charge_parse(cost.units, path)
    return cost.counted


# Profile events (Python calls and returns, ~70-170 ns of JAX's work each)
# per parse unit.
EVENTS_PER_UNIT = 32
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


def parse_shape(text: str, scope, buf, path: str) -> tuple:
    """``shape_poly.symbolic_shape(text, scope=scope)``, bounded; charged to
    ``buf`` (a wire.Buffer, or None).  PayloadError for any bad text."""
    counted = _charge(buf, text, path)
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
    for i, c in enumerate(constraints):
        counted |= _charge(buf, c, f"{path}[{i}]")
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


def _trial_units(fn, what: str, path: str, error=EncodeError):
    """(fn(), parse units a reader is charged for it, with a 2x margin)."""
    try:
        out, events = run_counted(fn, MAX_TRIAL_EVENTS)
    except OutOfBudget:
        raise error(
            f"{what} takes JAX's work over {MAX_TRIAL_EVENTS} steps; a "
            "reader would refuse it (chained constraints, or costly text)",
            path) from None
    return out, 2 * events // EVENTS_PER_UNIT


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


def trial_parse_units(text: str, scope, path: str, dim) -> int:
    """The units a reader is charged for parsing ``text`` (the printed form
    of ``dim``) in ``scope`` (the trial scope of its constraints) beyond its
    text; EncodeError unless it reads back equal to ``dim``.  Equality
    constraints may rewrite what is parsed: with ``a == 2*b`` and
    ``b == mod(c, 3) + 1``, ``max(a, c)`` prints as ``max(2*b, c)`` and
    reads back as ``max(2*mod(c, 3) + 2, c)``, which JAX does not find
    equal to it (``a`` itself reads back as ``2*mod(c, 3) + 2``, equal)."""
    try:
        dims, units = _trial_units(
            lambda: shape_poly.symbolic_shape(text, scope=scope),
            f"parsing {text[:80]!r}", path)
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
