"""The benchmarks' own machinery, where a fault would not fail a benchmark but skew its figures:
`--proxy-cpus` (benchmarks/support/cpus.py) must put every thread of a proxy on the proxies'
CPUs, those it started before the pin (the writer's, the reader pool's) and those after."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks.support import cpus

CPUS = os.sched_getaffinity(0)
pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="splitting CPUs needs two")

SERVER = """
import sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("started", flush=True)
sys.stdin.readline()
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("started another", flush=True)
time.sleep(60)
"""


def test_a_pinned_server_runs_every_thread_on_the_proxies_cpus() -> None:
    first = min(CPUS)
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert server.stdin is not None and server.stdout is not None
    try:
        server.stdout.readline()
        cpus.pin({first}, server.pid)
        server.stdin.write(b"\n")
        server.stdin.flush()
        server.stdout.readline()
        threads = os.listdir(f"/proc/{server.pid}/task")
        assert len(threads) == 3
        assert {t: os.sched_getaffinity(int(t)) for t in threads} == {t: {first} for t in threads}
    finally:
        server.kill()
        server.wait()


def test_the_load_gets_the_cpus_the_proxies_do_not_and_not_none() -> None:
    first = min(CPUS)
    shown = f"from benchmarks.support import cpus; import os; cpus.split({{{first}}}); print(os.sched_getaffinity(0))"
    out = subprocess.run([sys.executable, "-c", shown], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == str(CPUS - {first})
    every = ",".join(map(str, CPUS))
    taken = subprocess.run([sys.executable, "-c", f"from benchmarks.support import cpus; cpus.split({{{every}}})"])
    assert taken.returncode != 0
    assert cpus.parse("0-2,5") == {0, 1, 2, 5}
    assert cpus.split(set()) == "" and os.sched_getaffinity(0) == CPUS  # none named: nothing pinned
