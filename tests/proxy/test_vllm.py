"""Launching vLLM: clear errors when it cannot start, nothing left running, and on the CPU build
an engine core that does not spin while the model runs."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil
import pytest

from benchmarks.support.stack import Upstream, vllm_cpu_seconds
from proxy.vllm import BackendError, VllmServer

pytestmark = pytest.mark.slow


def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_model_vllm_cannot_load_is_a_clear_error(tmp_path: Path) -> None:
    """And the folder of vLLM's sockets goes with it (test_serve.py: none is left in the temp dir)."""
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    server = VllmServer(str(empty), "broken", log_file=tmp_path / "vllm.log")
    with pytest.raises(BackendError, match="exited with code") as info:
        server.start(timeout=300)
    assert str(tmp_path / "vllm.log") in str(info.value)
    assert "not-a-model" in str(info.value)  # the end of vLLM's log comes with the error
    assert server.sockets is not None and not server.sockets.exists()


def test_no_start_in_time_is_a_clear_error_and_the_process_is_stopped(tmp_path: Path) -> None:
    server = VllmServer(str(tmp_path), "slow", log_file=tmp_path / "vllm.log")
    with pytest.raises(BackendError, match="did not start within 1 s"):
        server.start(timeout=1)
    assert server.process is not None and _gone(server.process.pid)


@pytest.mark.vllm
def test_the_engine_core_sleeps_while_the_model_worker_decodes(vllm: Upstream) -> None:
    """proxy/vllm_plugin.py, loaded by every vLLM of this environment: on the CPU build the engine
    core waits for each step of the worker on a socket. vLLM's own wait spins: the engine core
    spent as many CPU-seconds as the worker (65 against 67), a core that the learner, the
    harnesses and the proxy share on a CPU machine."""
    if vllm.log is None:
        pytest.skip("a vLLM started elsewhere (RLP_TEST_UPSTREAM) loads the plugins of its own environment")
    port = urlsplit(vllm.url).port
    [server] = [c.pid for c in psutil.net_connections("tcp") if c.laddr.port == port and c.status == "LISTEN"]
    before = vllm_cpu_seconds(server)
    body = {"model": vllm.model, "messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 48}
    answer = httpx.post(f"{vllm.url}/chat/completions", json={**body, "min_tokens": 48}, timeout=300)
    assert answer.json()["usage"]["completion_tokens"] == 48
    after = vllm_cpu_seconds(server)
    engine, worker = (after[kind] - before[kind] for kind in ("EngineCore", "Worker"))
    assert worker > 1.0, (engine, worker)  # 48 steps of the model
    assert engine < worker / 4, (engine, worker)
