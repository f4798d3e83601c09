"""What the workers of `rl-proxy serve --workers N` tell each other, through one small file that
every worker maps: the trainer's announce of a new policy version, and the sessions ended through
the admin API. The worker that takes either writes it there; another worker finds it before its
next call (a read is a slice of the map: no system call on a call's path) and acts on it. One
process (no workers) has no marks.

The file: the announce (8 bytes, set anew to random bytes: no counter to race on), the count of
sessions ended (8 bytes), then the key digests of the last RING of them, each in the slot of its
number; writers take the file's lock, readers none (a slot is written before the count)."""

from __future__ import annotations

import fcntl
import mmap
import os
from pathlib import Path

RING = 256  # ended sessions' digests kept: a worker that missed more forgets every session it holds
DIGEST = 32  # a key digest's SHA-256 (recorder.schema.key_digest), as bytes
PREFIX = "sha256:"
ANNOUNCE, COUNT, RING_AT = slice(0, 8), slice(8, 16), 16  # where each lies in the file
SIZE = RING_AT + RING * DIGEST


class Marks:
    def __init__(self, path: Path) -> None:
        if not path.exists():
            path.write_bytes(bytes(SIZE))
        self._file = path.open("r+b")
        self._map = mmap.mmap(self._file.fileno(), SIZE)

    def announced(self) -> bytes:
        return self._map[ANNOUNCE]

    def announce(self) -> bytes:
        said = os.urandom(ANNOUNCE.stop)
        self._map[ANNOUNCE] = said
        return said

    def ended_count(self) -> int:
        return int.from_bytes(self._map[COUNT], "little")

    def end(self, digest: str) -> None:
        """A session ended here: its key digest, for the other workers to forget."""
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)
        try:
            count = self.ended_count() + 1
            at = RING_AT + (count % RING) * DIGEST
            self._map[at : at + DIGEST] = bytes.fromhex(digest.removeprefix(PREFIX))
            self._map[COUNT] = count.to_bytes(8, "little")
        finally:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)

    def ended_since(self, seen: int) -> tuple[int, list[str] | None]:
        """The count now, and the digests of the sessions ended after the `seen`th: None if the
        ring no longer holds them all."""
        count = self.ended_count()
        if count - seen > RING:
            return count, None
        slots = [RING_AT + (n % RING) * DIGEST for n in range(seen + 1, count + 1)]
        digests = [PREFIX + self._map[at : at + DIGEST].hex() for at in slots]
        lapped = self.ended_count() - seen > RING  # read again: a writer may have overwritten one meanwhile
        return count, None if lapped else digests
