"""The short soaks in `make test` (`make soak` and `make soak-scale` run the long ones), against
the STUB upstream (not vLLM): 64 sessions making multi-turn calls through `rl-proxy serve` for
12 s on each store (and 5 calls each at least, however slow the machine), nothing lost or
mismatched and the proxy's memory flat; and the scale soak
in small: sessions moving between two proxies behind nginx on PostgreSQL through a SIGKILL,
cut database connections and a database crash."""

from __future__ import annotations

import asyncio
import statistics
import sys
from pathlib import Path

from benchmarks.soak_scale import scale_soak
from benchmarks.support.load import KINDS, proxy, run_load, verify
from benchmarks.support.stack import process
from proxy.vllm import free_port


def test_64_sessions_multi_turn_nothing_lost_memory_flat(db: str, tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.support.stub_upstream", "--port", str(port), "--latency", "0.02"]
    with (
        process(cmd, f"http://127.0.0.1:{port}/v1/models", tmp_path / "stub.log"),
        proxy(f"http://127.0.0.1:{port}/v1", db, tmp_path / "proxy.log") as (base, pid),
    ):
        load = asyncio.run(run_load(base, 64, 12, KINDS, pid, min_turns=5))  # on a busy machine: longer
    assert not load.errors, load.errors[:5]
    assert len(load.answered) >= 64 * 5  # every session got its turns in
    assert verify(db, load) == []
    third = len(load.rss) // 3
    early, late = statistics.median(load.rss[third : 2 * third]), statistics.median(load.rss[-third:])
    assert late - early < 40, f"proxy RSS climbed from {early:.0f} MB to {late:.0f} MB"


def test_proxies_behind_a_balancer_lose_nothing_through_a_kill_cut_connections_and_a_crash(nginx: str) -> None:
    """24 sessions on the four APIs over 2 proxies for 24 s (6 calls each at least), with the
    scale soak's faults: every answered call recorded once and whole, every continuing chat call
    joined (token-in) though round robin served its previous turn on the other proxy."""
    run, found, _ = scale_soak(sessions=24, count=2, seconds=24.0, latency=0.02, min_turns=6)  # busy: longer
    assert len(run.faults) == 3, run.faults
    assert sum(run.failures.values()) > 0  # the faults were felt: calls failed and were sent again
    assert (run.errors, found.lost, found.duplicated, found.mismatched) == ([], [], [], [])
    assert len(run.answered) >= 24 * 6
    assert found.continuing > 0 and found.joined == found.continuing
