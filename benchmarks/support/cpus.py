"""A benchmark's CPUs split in two: the proxies on some, the load and the stub upstream on the rest.

On a machine of few cores the proxy, the stub it calls and the clients that load it take turns on
the same CPUs, so a proxy's added latency includes its waits for a core the others hold. With
`--proxy-cpus` a benchmark gives its proxies (and their floors) CPUs of their own: what they add
then is their own cost.
"""

from __future__ import annotations

import os
from pathlib import Path


def parse(text: str) -> set[int]:
    """CPUs as `taskset -c` writes them: `0`, `0,2` or `0-3`."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus |= set(range(int(first), int(last or first) + 1))
    return cpus


def split(proxy_cpus: set[int]) -> str:
    """Pins this process (the load, and every server it starts from now on) to the CPUs that are
    not `proxy_cpus`, and says so in a line for the benchmark's tables; none: nothing is pinned."""
    if not proxy_cpus:
        return ""
    rest = os.sched_getaffinity(0) - proxy_cpus
    if not rest or not proxy_cpus <= os.sched_getaffinity(0):
        raise SystemExit(f"--proxy-cpus must name some, not all, of this machine's CPUs {os.sched_getaffinity(0)}")
    for thread in Path("/proc/self/task").iterdir():
        os.sched_setaffinity(int(thread.name), rest)
    return f"The proxies and floors ran on CPUs {sorted(proxy_cpus)}, the load and the other servers on {sorted(rest)}."


def pin(cpus: set[int], *pids: int) -> None:
    """Every thread of each process of `pids` and of its children (a `--workers` server's) on
    `cpus`; threads they start later inherit it. None: nothing is pinned."""
    if not cpus:
        return
    import psutil  # vLLM's dependency

    for pid in pids:
        for process in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
            for thread in process.threads():
                os.sched_setaffinity(thread.id, cpus)
