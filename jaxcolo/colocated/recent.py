"""A set that remembers only its most recent members.

Executors remember destroyed instance ids to refuse calls of programs kept
past their instance's destroy (possible through the Executor API only: the
wrappers keep their instance alive).  Ids are random 63-bit numbers, never
reused, so a long-running process that makes and drops instances in a loop
would grow such a set without end; this one keeps the newest ``maxlen``.
"""

from __future__ import annotations

MAX_REMEMBERED = 1 << 16


class RecentSet:
    """``add``/``update``/``in``; the oldest members go past ``maxlen``."""

    __slots__ = ("_items", "maxlen")

    def __init__(self, maxlen: int = MAX_REMEMBERED):
        self._items: dict = {}
        self.maxlen = maxlen

    def add(self, item) -> None:
        items = self._items
        items.pop(item, None)
        items[item] = None
        if len(items) > self.maxlen:
            del items[next(iter(items))]

    def update(self, items) -> None:
        for item in items:
            self.add(item)

    def __contains__(self, item) -> bool:
        return item in self._items

    def __len__(self) -> int:
        return len(self._items)
