"""The per-process caches (token-in threads, Responses answers, sessions by key, call numbers)
are bounded by bytes, not by count: one client sending large bodies cannot make a proxy hold
more than its budget. The least recently used entries go first; each cache is only a shortcut
to the store, so an evicted entry costs a read, never a wrong answer."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

from cachetools import LRUCache

K = TypeVar("K")
V = TypeVar("V")

ENTRY = 256  # bytes an entry costs besides its value: its key (ids are at most 256 characters), the table


def deep_size(value: Any) -> int:
    """The bytes a JSON-like value (dicts, lists, strings, numbers) holds in this process: every
    object's own size, which for a small dict is several times its JSON's length."""
    size = sys.getsizeof(value)
    if isinstance(value, dict):
        return size + sum(sys.getsizeof(k) + deep_size(v) for k, v in value.items())
    if isinstance(value, list):
        return size + sum(deep_size(v) for v in value)
    return size


class ByteLRU(LRUCache[K, V]):
    """At most `budget` bytes as `size` counts each value (ENTRY added). A value larger than the
    whole budget is not kept. `dropped` hears of each entry evicted."""

    def __init__(self, budget: int, size: Callable[[V], int], dropped: Callable[[K, V], None] | None = None) -> None:
        super().__init__(maxsize=budget, getsizeof=lambda value: ENTRY + size(value))
        self._dropped = dropped

    def __setitem__(self, key: K, value: V) -> None:  # type: ignore[override]
        try:
            super().__setitem__(key, value)
        except ValueError:  # larger than the whole budget: not kept (nor an older value)
            self.pop(key, None)

    def popitem(self) -> tuple[K, V]:
        key, value = super().popitem()
        if self._dropped is not None:
            self._dropped(key, value)
        return key, value

    def usage(self) -> dict[str, int]:
        """Its size, as /healthz shows it."""
        return {"entries": len(self), "bytes": int(self.currsize), "budget": int(self.maxsize)}
