"""`rl-proxy serve` end to end: it launches vLLM (with a reasoning parser), serves and records
through it, reasoning text included, and exits with a clear error when vLLM dies under it.

vLLM's `olmo3` reasoning parser runs with the default model (it matches `</think>` as text) and,
streaming, calls everything before `</think>` reasoning; SmolLM2 never writes that, so every
streamed token arrives as vLLM 0.32's `delta.reasoning`. One vLLM serves both checks: each costs
a minute to start on two cores."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anthropic
import httpx
import pytest
from openai import OpenAI

from benchmarks.support.stack import read_calls
from proxy.vllm import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


ASK = [{"role": "user", "content": "Name three colours."}]


def _sockets() -> set[str]:
    return {path.name for path in Path(tempfile.gettempdir()).iterdir() if path.is_socket()}


@pytest.mark.timeout(900)  # vLLM's start may take its 600 s deadline on a busy machine (300 s ran out once)
def test_serve_launches_vllm_records_reasoning_and_exits_when_vllm_dies(tmp_path: Path) -> None:
    """And leaves none of vLLM's IPC sockets in the temp dir (vLLM names them by UUID there and
    never removes them: a machine that ran the suite for a day held 966)."""
    before = _sockets()
    port, vllm_port = free_port(), free_port()
    env = {
        **os.environ,
        "RLP_VLLM_PORT": str(vllm_port),
        "RLP_VLLM_ARGS": '["--enforce-eager", "--reasoning-parser", "olmo3"]',
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
        _reasoning_reaches_every_api_and_the_record(f"http://127.0.0.1:{port}", str(tmp_path / "s.db"))
        vllm_pid = int(subprocess.check_output(["pgrep", "-f", "--", f"--port {vllm_port}"], text=True).split()[0])
        os.killpg(vllm_pid, signal.SIGKILL)
        output, _ = serve.communicate(timeout=60)
    finally:
        if serve.poll() is None:  # SIGTERM: serve stops the vLLM it launched on the way out
            serve.terminate()
            serve.wait(60)
    assert serve.returncode == 1
    assert "vLLM exited" in output and str(tmp_path / "logs" / "vllm.log") in output
    assert _sockets() - before == set()


def _reasoning_reaches_every_api_and_the_record(url: str, db: str) -> None:
    model = "SmolLM2-135M-Instruct"
    openai = OpenAI(base_url=f"{url}/v1", api_key="r-chat", max_retries=0)
    chat = list(openai.chat.completions.create(model=model, messages=ASK, max_tokens=12, temperature=0, stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in chat if c.choices)
    assert reasoning.strip() and not any(c.choices[0].delta.content for c in chat if c.choices)

    claude = anthropic.Anthropic(base_url=url, api_key="r-messages", max_retries=0)
    with claude.messages.stream(model=model, max_tokens=12, messages=ASK, extra_body={"temperature": 0}) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    thinking = [block for block in message.content if block.type == "thinking"]
    assert thinking and thinking[0].thinking == reasoning and "message_stop" in kinds

    openai = OpenAI(base_url=f"{url}/v1", api_key="r-responses", max_retries=0)
    events = list(
        openai.responses.create(model=model, input=ASK[0]["content"], max_output_tokens=12, temperature=0, stream=True)
    )
    assert events[-1].type == "response.incomplete"  # max_output_tokens
    items = [item for item in events[-1].response.output if item.type == "reasoning"]
    assert any(e.type.startswith("response.reasoning") for e in events) and items
    shown = "".join(part.text for item in items for part in (item.content or []) or item.summary)
    assert shown == reasoning

    calls = {key: read_calls(db, key) for key in ("r-chat", "r-messages", "r-responses")}
    for key, found in calls.items():
        [call] = found
        assert call.ok and len(call.completions[0].token_ids) == 12, key
    [messages_call] = calls["r-messages"]
    assert messages_call.response is not None
    assert [b["thinking"] for b in messages_call.response["content"] if b["type"] == "thinking"] == [reasoning]
