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

* an exponent above :data:`MAX_EXPONENT`, more than
  :data:`MAX_MINMAX_GROUP` max/min nested in one another, a product of more
  than :data:`MAX_MINMAX_FACTORS` factors inside a max/min, nested max/min
  spanning more than :data:`MAX_NESTED_GROUP_TEXT` characters, or a line
  break or backslash is refused (EncodeError when writing, PayloadError when
  reading): nothing is written that cannot be read back cheaply;
* a reader charges every text it parses (its length, plus each exponent and
  each max/min group, in units of about 3.5 us) to its buffer's parse budget
  (:meth:`jaxcolo.wire.Buffer.charge_parse`, :func:`jaxcolo.wire.parse_budget`), so the
  total parse work stays proportional to the payload size even when one
  string is referenced from many places; the spec writer adds up the same
  charges and refuses a payload a reader would refuse.

Constraints are the exception no text cost can model: JAX's decision
procedure combines them by elimination, and chained constraints
(``v0 >= v1 + v2``, ``v1 >= v2 + v3``, ...) make its work exponential in their
number (6 of them: >10**7 steps for one ``max``).  So whatever JAX does inside
a scope that has constraints (building it, parsing a dim in it) is counted as
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

from jax._src.export import shape_poly

from jaxcolo.codec.counted import OutOfBudget, run_counted
from jaxcolo.errors import EncodeError, PayloadError

# a^16 parses in ~70 us, like ~20 characters of other text.
MAX_EXPONENT = 16
_EXPONENT_COST = 1  # parse units per unit of exponent (a multiplication)
# max/min nested in one another form a group; a group of n costs about
# _MINMAX_COST[n] units (measured: 4 nested take ~0.8 ms, 8 take ~32 ms).
MAX_MINMAX_GROUP = 4
_MINMAX_COST = (0, 4, 30, 100, 300)
_MINMAX = ("max", "min")
# Bounds of a product inside max/min cost ~2x per factor (12: ~3 ms).
MAX_MINMAX_FACTORS = 8
# Nested max/min cost about the square of their text (5 sums of 5 terms,
# 113 characters: ~22 ms): such a group is charged its length squared and
# limited to MAX_NESTED_GROUP_TEXT characters.
MAX_NESTED_GROUP_TEXT = 128
_LINE_BREAKS = re.compile(r"[\\\x00-\x08\x0a-\x1f\x7f]")
_TERM_ENDS = (tokenize.PLUS, tokenize.MINUS, tokenize.COMMA)
_SKIPPED = (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT)


def _parse_cost(text: str) -> tuple[int, str | None]:
    """(parse units of ``text``, None), or (0, why it is refused)."""
    if _LINE_BREAKS.search(text):  # JAX never prints these
        return 0, "has a line break, backslash or control character"
    cost = len(text)
    opens: list[tuple[bool, int]] = []  # per open parenthesis: (opened by
    # max/min, factors of the term it interrupted)
    inside = group = factors = 0  # open max/min parentheses; size of their
    # group; names in the current product term
    prev = prev_text = None
    group_start = 0
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
                    return 0, (f"has an exponent {tok.string[:20]!r} above "
                               f"{MAX_EXPONENT}")
                cost += _EXPONENT_COST * power
            elif kind == tokenize.NAME:
                factors += 1
                if inside and factors > MAX_MINMAX_FACTORS:
                    return 0, ("has a product of more than "
                               f"{MAX_MINMAX_FACTORS} factors in a max/min")
            elif kind == tokenize.LPAR:
                minmax = prev == tokenize.NAME and prev_text in _MINMAX
                opens.append((minmax, factors))
                factors = 0
                if minmax:
                    if not inside:
                        group, group_start = 1, tok.start[1]
                    else:
                        group += 1
                    inside += 1
                    if group > MAX_MINMAX_GROUP:
                        return 0, (f"nests more than {MAX_MINMAX_GROUP} "
                                   "max/min in one another")
            elif kind == tokenize.RPAR and opens:
                minmax, factors = opens.pop()
                if minmax:
                    inside -= 1
                    if not inside:
                        why = _charge_group(group, tok.end[1] - group_start)
                        if isinstance(why, str):
                            return 0, why
                        cost += why
            elif kind in _TERM_ENDS:
                factors = 0
            prev, prev_text = kind, tok.string
    except (tokenize.TokenError, SyntaxError) as e:
        return 0, f"is not valid symbolic text ({e.args[0]})"
    if inside:  # unclosed: the parser will refuse it
        cost += _MINMAX_COST[group]
    terms = _Expansion(toks).bound()
    if terms > MAX_TERMS:
        return 0, (f"multiplies out to more than {MAX_TERMS} terms")
    return cost + _TERM_COST * terms, None


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
                factor = min(factor ** min(power, MAX_EXPONENT),
                             MAX_TERMS + 1)
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


def _charge_group(group: int, length: int) -> int | str:
    """Parse units of a max/min group of ``group`` nested in ``length``
    characters, or why it is refused."""
    if group == 1:
        return _MINMAX_COST[1]
    if length > MAX_NESTED_GROUP_TEXT:
        return (f"has nested max/min in more than {MAX_NESTED_GROUP_TEXT} "
                "characters")
    return _MINMAX_COST[group] + length * length


def check_writable_text(text: str, path: str) -> int:
    """The parse units a reader charges for ``text``; EncodeError unless it
    can parse it within its bounds."""
    cost, refused = _parse_cost(text)
    if refused is not None:
        raise EncodeError(f"symbolic expression {text[:200]!r} {refused}",
                          path)
    return cost


def _charge(buf, text: str, path: str) -> None:
    cost, refused = _parse_cost(text)
    if refused is not None:
        raise PayloadError(f"symbolic expression {text[:80]!r} {refused}",
                           path)
    if buf is not None:
        buf.charge_parse(cost, path)


# Profile events (Python calls and returns, ~70-170 ns of JAX's work each)
# per parse unit.
EVENTS_PER_UNIT = 32
# A writer's trial parses stop here (~1 s of JAX's work): EncodeError.
MAX_TRIAL_EVENTS = 1 << 23
# JAX's first constrained scope in a process costs ~12k events (~1.3k warm).
COLD_START_EVENTS = 1 << 15


def _has_constraints(scope) -> bool:
    return bool(scope is not None and scope._explicit_constraints)


def _run_charged(fn, buf, what: str, path: str):
    """fn() (JAX's work on constrained symbolic text), its profile events
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
            f"{what} takes JAX's reasoning about the constraints out of "
            "proportion to the payload size (chained constraints)",
            path) from None
    used_free = min(free, events)
    buf.memo["constraint_events_free"] = free - used_free
    buf.charge_parse((events - used_free) // EVENTS_PER_UNIT, path)
    return out


def parse_shape(text: str, scope, buf, path: str) -> tuple:
    """``shape_poly.symbolic_shape(text, scope=scope)``, bounded; charged to
    ``buf`` (a wire.Buffer, or None).  PayloadError for any bad text."""
    _charge(buf, text, path)
    try:
        if buf is not None and _has_constraints(scope):
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
    for i, c in enumerate(constraints):
        _charge(buf, c, f"{path}[{i}]")
    try:
        if buf is not None and constraints:
            return _run_charged(lambda: shape_poly.SymbolicScope(constraints),
                                buf, "building the scope", path)
        return shape_poly.SymbolicScope(constraints)
    except PayloadError:
        raise
    except Exception as e:
        raise PayloadError(f"invalid symbolic constraints: {e}", path) \
            from None


def _trial_units(fn, what: str, path: str):
    """(fn(), parse units a reader is charged for it, with a 2x margin)."""
    try:
        out, events = run_counted(fn, MAX_TRIAL_EVENTS)
    except OutOfBudget:
        raise EncodeError(
            f"{what} takes JAX's reasoning about the constraints over "
            f"{MAX_TRIAL_EVENTS} steps; a reader would refuse it (chained "
            "constraints)", path) from None
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
