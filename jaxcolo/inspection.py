"""``jaxcolo.inspect``: a JSON-serialisable description of any payload."""

from __future__ import annotations


def inspect(data) -> dict:
    raise NotImplementedError
