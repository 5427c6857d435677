"""The cost model of JAX's symbolic-dimension parser, from the tokens of a
text (see :mod:`jaxcolo.codec.symbolic`, which charges and runs parses by
it): what parsing a text costs in parse units (about 3.5 us each), whether
it is past the model (its parse must be counted as it runs), or why no
reader parses it at all; and how large the ints JAX computes for it can be
(:func:`magnitude`, :func:`constraint_bits`).
"""

from __future__ import annotations

import io
import re
import tokenize
from typing import NamedTuple


# Text the cost model below covers is charged by it.  Text past one of
# its limits is parsed with JAX's work counted as it runs instead (as in a
# scope with constraints), charged to the same budget and stopped there.
# a^16 parses in ~70 us, like ~20 characters of other text.
MODELLED_EXPONENT = 16
_EXPONENT_COST = 1  # parse units per unit of exponent (a multiplication)
# JAX builds a list as long as an exponent before any counted work.
MAX_EXPONENT = 1024
# JAX's ints (constants, coefficients, bounds) do their arithmetic in C,
# uncounted, in time growing with their size.  The bits of each int a text
# can make JAX compute are bounded by the grammar (a number: its digits'
# worth; a sum of n terms: the largest term's plus the bits of n; a
# product: its factors' added up; a power: its base's times the exponent;
# max/min/mod/floordiv: the larger operand's, their difference one more; a
# name: what its scope's constraints make it, see constraint_bits); text
# whose bound is over this many bits is refused.  (JAX prints dims that fit
# in int64.)
MAX_MAGNITUDE_BITS = 1024
# max/min nested in one another form a group; a group of n costs about
# _MINMAX_COST[n] units (measured: 4 nested take ~0.8 ms, 8 take ~32 ms).
MAX_MINMAX_GROUP = 4
_MINMAX_COST = (0, 4, 30, 100, 300)
_MINMAX = ("max", "min")
# Bounds of a product inside max/min cost ~2x per factor (12: ~3 ms).
MAX_MINMAX_FACTORS = 8
# JAX's work on a product grows with the square of its factors, much of it
# in C between the events a count sees (128 names: ~4 ms, 2000: ~0.6 s,
# 8000: ~30 s): the k-th factor of a product costs k // _FACTOR_SHARE units
# more (n factors: ~n*n/16 units).
_FACTOR_SHARE = 8
# Nested max/min cost about the square of their text (5 sums of 5 terms,
# 113 characters: ~22 ms): such a group is charged its length squared;
# longer ones are counted.
MAX_NESTED_GROUP_TEXT = 128
_LINE_BREAKS = re.compile(r"[\\\x00-\x08\x0a-\x1f\x7f]")
_TERM_ENDS = (tokenize.PLUS, tokenize.MINUS, tokenize.COMMA)
_SKIPPED = (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT)


class Cost(NamedTuple):
    units: int                  # parse units the model charges
    refused: str | None = None  # why no reader parses it
    counted: bool = False       # past the model: count JAX's work
    # JAX's work must be counted (past the model, or max/min: JAX works
    # out bounds of their operands, in time the model's charge for a group,
    # by its length, does not see: 113 characters of nested max/min over
    # sums of 7 names take 16 s, one max over a sum of 18 mod terms 12 s)
    work_counted: bool = False
    # what a reader charges before counting that work: ``units`` without
    # the model's charge for max/min groups (readers before counting it,
    # in releases of schema version 11 and older, charge ``units``)
    read_units: int = 0


def parse_cost(text: str, name_bits: int = 0) -> Cost:
    """What parsing ``text`` costs, by the tokens JAX's parser will see
    (``name_bits``: the bits of the bounds of its names, see
    :func:`constraint_bits`)."""
    if _LINE_BREAKS.search(text):  # JAX never prints these
        return Cost(0, "has a line break, backslash or control character")
    cost = len(text)
    counted = False  # a limit of the model was passed
    opens: list[tuple[bool, int]] = []  # per open parenthesis: (opened by
    # max/min, factors of the term it interrupted)
    inside = group = factors = 0  # open max/min parentheses; size of their
    # group; names in the current product term
    prev = prev_text = None
    group_start = 0
    any_minmax = False
    groups = 0  # the model's charge for max/min groups
    toks = []  # (kind, text) of the significant tokens, for _Walk
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
                    return Cost(0, f"has an exponent {tok.string[:20]!r} "
                                 f"above {MAX_EXPONENT}")
                if power > MODELLED_EXPONENT:
                    counted = True
                cost += _EXPONENT_COST * power
            elif kind == tokenize.NAME:
                factors += 1
                cost += factors // _FACTOR_SHARE
                if inside and factors > MAX_MINMAX_FACTORS:
                    counted = True
            elif kind == tokenize.LPAR:
                minmax = prev == tokenize.NAME and prev_text in _MINMAX
                opens.append((minmax, factors))
                factors = 0
                if minmax:
                    any_minmax = True
                    if not inside:
                        group, group_start = 1, tok.start[1]
                    else:
                        group += 1
                    inside += 1
                    if group > MAX_MINMAX_GROUP:
                        counted = True
            elif kind == tokenize.RPAR and opens:
                minmax, factors = opens.pop()
                if minmax:
                    inside -= 1
                    if not inside:
                        length = tok.end[1] - group_start
                        if group > 1 and length > MAX_NESTED_GROUP_TEXT:
                            counted = True
                        elif not counted:
                            groups += _group_cost(group, length)
            elif kind in _TERM_ENDS:
                factors = 0
            prev, prev_text = kind, tok.string
    except (tokenize.TokenError, SyntaxError) as e:
        return Cost(0, f"is not valid symbolic text ({e.args[0]})")
    walk = _Walk(toks, name_bits)
    terms = walk.run()
    if walk.too_deep:
        return Cost(0, f"nests operations more than {_MAX_DEPTH} deep")
    if walk.bits > MAX_MAGNITUDE_BITS:
        return Cost(0, f"makes JAX compute ints of more than "
                     f"{MAX_MAGNITUDE_BITS} bits (constants, powers of "
                     "them, or bounds its constraints give)")
    if counted or terms > MAX_TERMS:
        return Cost(cost + groups, None, True, True, cost)
    if inside:  # unclosed: the parser will refuse it
        cost += _MINMAX_COST[min(group, MAX_MINMAX_GROUP)]
    cost += _TERM_COST * terms
    if any_minmax:  # JAX's work on it is counted: not charged for
        return Cost(cost + groups, None, False, True, cost)
    return Cost(cost, None, False, False, cost)


def magnitude(text: str, name_bits: int = 0) -> int:
    """The bits of the largest int parsing ``text`` can make JAX compute,
    by the grammar (0 for text the tokenizer refuses)."""
    toks = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.exact_type not in _SKIPPED:
                toks.append((tok.exact_type, tok.string))
    except (tokenize.TokenError, SyntaxError):
        return 0
    walk = _Walk(toks, name_bits)
    walk.run()
    return walk.bits


def constraint_bits(constraints) -> list[int]:
    """The bits of names' ints in each of ``constraints`` (text), in the
    order JAX builds them, then in the scope they make (the last entry).
    An equality ``x == e`` becomes a rule rewriting ``x`` into ``e`` in what
    is built after it, so a name may stand for what the constraints before
    made: their largest magnitude, carried along.  (Bounds JAX derives from
    inequalities are floats: past 2**1024 they overflow, an error.)"""
    bits = [0]
    for c in constraints:
        bits.append(max(bits[-1], magnitude(c, bits[-1])))
    return bits


def scope_bits(constraints) -> int:
    """The bits of names' ints in a scope of ``constraints``."""
    return constraint_bits(constraints)[-1]


# JAX multiplies products of sums out (max(a + b, 0) is a + b once bounds
# show a + b >= 0), so a product of k two-term factors builds 2**k terms
# (17 such factors in 300 characters: 12 s).  ~90 us per term.
MAX_TERMS = 512
_TERM_COST = 25
_OPERATIONS = ("max", "min", "mod", "floordiv")
_MAX_DEPTH = 64


class _Walk:
    """A walk of a text by the grammar of JAX's parser (sums of products of
    powers of names, numbers and operations on two sums), left to right as
    it parses: ``run()`` is an upper bound of the terms JAX builds (it
    multiplies products of sums out); ``bits`` of the ints it computes on
    the way (see MAX_MAGNITUDE_BITS).  Where the grammar fails, the parser
    fails too: the walk stops there."""

    def __init__(self, toks: list, name_bits: int = 0):
        self.toks = toks  # (exact token type, text), layout tokens left out
        self.i = 0
        self.name_bits = name_bits
        self.bits = 0  # the largest bound of an int met so far
        self.too_deep = False

    def run(self) -> int:
        total = 0
        try:
            while self.i < len(self.toks):
                kind = self.toks[self.i][0]
                if kind in (tokenize.NAME, tokenize.NUMBER, tokenize.MINUS,
                            tokenize.PLUS):
                    total = min(total + self.expr(0)[0], MAX_TERMS + 1)
                else:  # shape parentheses, commas, comparisons
                    self.i += 1
        except (IndexError, ValueError):
            pass
        return total

    def _peek(self):
        return self.toks[self.i][0] if self.i < len(self.toks) else None

    def _met(self, bits: int) -> int:
        if bits > self.bits:
            self.bits = bits
            if bits > MAX_MAGNITUDE_BITS:
                raise ValueError("too large")  # refused: stop here
        return bits

    def expr(self, depth: int) -> tuple[int, int]:
        """(terms, bits) of a sum."""
        if depth > _MAX_DEPTH:
            self.too_deep = True
            raise ValueError("too deep")
        if self._peek() in (tokenize.PLUS, tokenize.MINUS):
            self.i += 1
        total, bits = self.term(depth)
        n = 1
        while self._peek() in (tokenize.PLUS, tokenize.MINUS):
            self.i += 1
            terms, more = self.term(depth)
            total = min(total + terms, MAX_TERMS + 1)
            bits, n = max(bits, more), n + 1
        return total, self._met(bits + (n - 1).bit_length())

    def term(self, depth: int) -> tuple[int, int]:
        """(terms, bits) of a product."""
        product, bits = 1, 0
        while True:
            factor, more = self.factor(depth)
            if self._peek() == tokenize.CIRCUMFLEX:
                self.i += 1
                power = int(self.toks[self.i][1]) if \
                    self._peek() == tokenize.NUMBER else 1
                self.i += 1
                if factor > 1:
                    factor = min(factor ** min(power, 10), MAX_TERMS + 1)
                more *= max(power, 1)
            product = min(product * factor, MAX_TERMS + 1)
            bits = self._met(bits + more)
            if self._peek() != tokenize.STAR:
                return product, bits
            self.i += 1

    def factor(self, depth: int) -> tuple[int, int]:
        """(terms, bits) of a name, a number or an operation."""
        kind, text = self.toks[self.i]
        self.i += 1
        if kind == tokenize.NAME and text in _OPERATIONS and \
                self._peek() == tokenize.LPAR:
            self.i += 1
            first, b1 = self.expr(depth + 1)
            if self._peek() != tokenize.COMMA:
                raise ValueError("not an operation")
            self.i += 1
            second, b2 = self.expr(depth + 1)
            self.i += 1  # the closing parenthesis
            self._met(max(b1, b2) + 1)  # their difference, for bounds
            return max(first, second), max(b1, b2)  # one operand's bound
        if kind == tokenize.NAME:
            return 1, self.name_bits
        if kind == tokenize.MINUS and self._peek() == tokenize.NUMBER:
            kind, text = self.toks[self.i]  # a negative number
            self.i += 1
        if kind == tokenize.NUMBER:
            try:
                bits = int(text).bit_length()
            except ValueError:  # not an int, or too long to convert
                bits = (len(text) * 10 + 2) // 3  # (10 digits: 33.2 bits)
            return 1, self._met(bits)
        return 1, 0


def _group_cost(group: int, length: int) -> int:
    """Parse units of a max/min group of ``group`` (at most
    MAX_MINMAX_GROUP) nested in ``length`` characters (at most
    MAX_NESTED_GROUP_TEXT, if nested)."""
    if group == 1:
        return _MINMAX_COST[1]
    return _MINMAX_COST[group] + length * length
