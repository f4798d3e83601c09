"""The real Codex CLI (npm @openai/codex, installed by `make install` into .harnesses/) pointed at
the proxy's Responses API with a provider given on the command line, against the real vLLM."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Upstream

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CODEX = Path(__file__).resolve().parents[2] / ".harnesses" / "node_modules" / ".bin" / "codex"


def codex_command(base_url: str, model: str, prompt: str) -> list[str]:
    """`codex exec` on the proxy: the README's recipe, as command-line overrides."""
    provider = f'{{name="rl-proxy", base_url="{base_url}", env_key="RLP_SESSION_KEY", wire_api="responses"}}'
    return [
        str(CODEX), "exec", "--skip-git-repo-check",
        "-c", "model_provider=rlp", "-c", f"model_providers.rlp={provider}",
        "-c", "web_search=disabled",  # a hosted tool: the proxy would refuse the request
        "-m", model, prompt,
    ]  # fmt: skip


def test_codex_runs_through_the_proxy_and_every_call_is_recorded(
    make_proxy: Any, vllm: Upstream, tmp_path: Path
) -> None:
    assert CODEX.exists(), "run `make install`: it installs Codex CLI into .harnesses/"
    # Codex asks for no output limit: the proxy's cap keeps the 135M model from writing to the
    # end of its context (and this test short).
    proxy = make_proxy(vllm.url, max_completion_tokens=48)
    env = {**os.environ, "RLP_SESSION_KEY": "run=harness,task=hello,id=codex-1", "CODEX_HOME": str(tmp_path)}
    done = subprocess.run(
        codex_command(proxy.v1, "gpt-5-codex", "Say hello."),
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    calls = proxy.calls("codex-1")
    assert calls, f"Codex made no call through the proxy: {done.stdout[-500:]} {done.stderr[-500:]}"
    for call in calls:
        assert call.ok and call.api == "openai.responses" and call.stream, call.error
        assert call.rewrites["model"] == ["gpt-5-codex", vllm.model]
        assert call.rewrites["max_tokens"] == [None, 48]
        assert len(call.prompt_token_ids) > 3000 and call.completions[0].token_ids
        assert len(call.completions[0].logprobs) == len(call.completions[0].token_ids)
        assert call.response is not None and call.response["id"] == call.response_id
    # The 135M model does not finish in 48 tokens: Codex reports the incomplete response, which
    # it could only do after parsing the whole event stream.
    output = done.stdout + done.stderr
    assert done.returncode == 0 or "Incomplete response returned, reason: max_output_tokens" in output, output[-800:]
    assert "stream disconnected" not in output and "error decoding" not in output.lower()
