"""`rl-proxy serve` end to end: it launches vLLM, serves and records through it, and exits with
a clear error when vLLM dies under it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from proxy.vllm import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_serve_launches_vllm_records_and_exits_when_vllm_dies(tmp_path: Path) -> None:
    port, vllm_port = free_port(), free_port()
    env = {
        **os.environ,
        "RLP_VLLM_PORT": str(vllm_port),
        "RLP_VLLM_ARGS": '["--enforce-eager"]',
        "RLP_LOG_DIR": str(tmp_path / "logs"),
    }
    serve = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--db", str(tmp_path / "s.db"), "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 600
        while True:
            assert serve.poll() is None, serve.stdout.read() if serve.stdout else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(1)
        chat = {"model": "anything", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat, timeout=120)
        assert answer.status_code == 200 and answer.json()["model"] == "SmolLM2-135M-Instruct"
        vllm_pid = int(subprocess.check_output(["pgrep", "-f", "--", f"--port {vllm_port}"], text=True).split()[0])
        os.killpg(vllm_pid, signal.SIGKILL)
        output, _ = serve.communicate(timeout=60)
    finally:
        if serve.poll() is None:  # SIGTERM: serve stops the vLLM it launched on the way out
            serve.terminate()
            serve.wait(60)
    assert serve.returncode == 1
    assert "vLLM exited" in output and str(tmp_path / "logs" / "vllm.log") in output
