"""What the workers of `rl-proxy serve --workers N` tell each other: a few 8-byte marks in one
file that every worker maps. The worker that changes something the others hold in memory sets
its mark anew (random bytes: no counter to race on); another worker that finds a mark it has not
seen acts on it before its next call. A read is a slice of the map: no system call on a call's
path. One process (no workers) has no marks."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

VERSION = 0  # the trainer announced a new policy version: read it again before stamping a call
ENDED = 1  # a session ended through the admin API: the sessions held by key are read again
SIZE, COUNT = 8, 2


class Marks:
    def __init__(self, path: Path) -> None:
        if not path.exists():
            path.write_bytes(bytes(SIZE * COUNT))
        with path.open("r+b") as file:
            self._map = mmap.mmap(file.fileno(), SIZE * COUNT)

    def read(self, mark: int) -> bytes:
        return self._map[SIZE * mark : SIZE * (mark + 1)]

    def set(self, mark: int) -> bytes:
        said = os.urandom(SIZE)
        self._map[SIZE * mark : SIZE * (mark + 1)] = said
        return said
