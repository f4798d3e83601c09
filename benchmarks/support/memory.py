"""Peak memory of a piece of work in this process, as Linux counts it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def peak_above(work: Callable[[], object]) -> int:
    """Bytes this process's resident memory peaked above where it was while `work` ran: the peak
    (VmHWM) is reset just before (/proc/self/clear_refs), so an earlier, higher one does not hide it."""
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    work()
    return _status("VmHWM") - before


def _status(key: str) -> int:
    """A /proc/self/status figure, in bytes."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024
