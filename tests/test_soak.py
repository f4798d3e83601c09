"""The short soak in `make test` (`make soak` runs the long one): 64 sessions making multi-turn
calls through `rl-proxy serve` for 20 s on each store, against the STUB upstream (not vLLM).
Nothing lost or mismatched, and the proxy's memory does not climb."""

from __future__ import annotations

import asyncio
import statistics
import sys
from pathlib import Path

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
        load = asyncio.run(run_load(base, 64, 20, KINDS, pid))
    assert not load.errors, load.errors[:5]
    assert len(load.answered) > 64 * 5  # every session got several turns in
    assert verify(db, load) == []
    third = len(load.rss) // 3
    early, late = statistics.median(load.rss[third : 2 * third]), statistics.median(load.rss[-third:])
    assert late - early < 40, f"proxy RSS climbed from {early:.0f} MB to {late:.0f} MB"
