"""Bounded parsing of symbolic dimension text with JAX's own shape_poly.

Symbolic dimensions and constraints travel as the text JAX prints for them
(``2*a + b``, ``a^3``, ``mod(a, 4)``) and are parsed back by
``shape_poly``.  Parsing costs time roughly proportional to the text, except
for powers: ``a^N`` multiplies N times.  So, on both sides:

* an exponent above :data:`MAX_EXPONENT` is refused (EncodeError when
  writing, PayloadError when reading): nothing is written that cannot be read
  back cheaply;
* a reader charges every text it parses (its length, plus each exponent) to
  its buffer's parse budget (:meth:`jaxcolo.wire.Buffer.charge_parse`), so
  the total parse work stays proportional to the payload size even when one
  string is referenced from many places.
"""

from __future__ import annotations

import re

from jax._src.export import shape_poly

from jaxcolo.errors import EncodeError, PayloadError

# a^16 parses in ~70 us, like ~20 characters of other text: with a payload
# budget of 4 units per byte, any payload a writer makes stays in budget.
MAX_EXPONENT = 16
_EXPONENTS = re.compile(r"\^\s*([0-9]+)")
_EXPONENT_COST = 1  # parse units per unit of exponent (a multiplication)


def _parse_cost(text: str) -> int | None:
    """Parse units of ``text``, or None when an exponent is too large."""
    cost = len(text)
    for m in _EXPONENTS.finditer(text):
        digits = m.group(1)
        if len(digits) > 4 or int(digits) > MAX_EXPONENT:
            return None
        cost += _EXPONENT_COST * int(digits)
    return cost


def check_writable_text(text: str, path: str) -> None:
    """EncodeError unless a reader can parse ``text`` within its bounds."""
    if _parse_cost(text) is None:
        raise EncodeError(f"symbolic expression {text!r} has an exponent "
                          f"above {MAX_EXPONENT}", path)


def _charge(buf, text: str, path: str) -> None:
    cost = _parse_cost(text)
    if cost is None:
        raise PayloadError(f"symbolic expression {text[:80]!r} has an "
                           f"exponent above {MAX_EXPONENT}", path)
    if buf is not None:
        buf.charge_parse(cost, path)


def parse_shape(text: str, scope, buf, path: str) -> tuple:
    """``shape_poly.symbolic_shape(text, scope=scope)``, bounded; charged to
    ``buf`` (a wire.Buffer, or None).  PayloadError for any bad text."""
    _charge(buf, text, path)
    try:
        return shape_poly.symbolic_shape(text, scope=scope)
    except Exception as e:  # syntax errors, absurd nesting
        raise PayloadError(f"invalid symbolic shape {text[:200]!r}: {e}",
                           path) from None


def make_scope(constraints: tuple, buf, path: str):
    """``shape_poly.SymbolicScope(constraints)``, bounded like parse_shape."""
    for i, c in enumerate(constraints):
        _charge(buf, c, f"{path}[{i}]")
    try:
        return shape_poly.SymbolicScope(constraints)
    except Exception as e:
        raise PayloadError(f"invalid symbolic constraints: {e}", path) \
            from None
