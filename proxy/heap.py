"""The cyclic garbage collector, set for a long-running server.

Nearly every object of `rl-proxy serve` is made at start-up (FastAPI, SQLAlchemy, aiohttp and,
once a call translates, litellm) and lives as long as the process, and a call's own objects are
freed by their reference counts when it ends. At Python's defaults the collector walked them all
again about once a second (a full collection: 70-85 ms of CPU each at 700 calls/s, so 0.10-0.12
ms a call and a pause of that length for every call in flight) and the young every few calls,
and under the store benchmark's load it found no garbage at all (docs/benchmarks.md, "Where the
milliseconds go").
"""

from __future__ import annotations

import gc

# A young collection once this many tracked objects more are alive than at the last one (Python's
# default is 700): 64 calls in flight hold a few thousand between them, most freed before it runs.
YOUNG = 10_000


def settle() -> None:
    """Collect once, leave every object alive now out of all later collections (`gc.freeze`),
    and collect the young less often. `rl-proxy serve` calls it before it serves."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG)  # the older generations' as they were


def resettle() -> None:
    """`settle` again after a large import, in a process that froze its heap before
    (`rl-proxy serve`; not a test's or the demo's, whose collector stays as Python sets it). The
    calls in flight wait for its one collection, once, as the first translating call waits
    seconds for the import."""
    if gc.get_freeze_count():
        settle()
