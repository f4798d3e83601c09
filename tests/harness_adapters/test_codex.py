"""The real Codex CLI (npm @openai/codex, installed by `make install` into .harnesses/) run as an
episode by the command adapter with the recipe in docs/harnesses.md (its config written into
the workdir), talking to the proxy's Responses API, against the real vLLM."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from benchmarks.support.sessions import HARNESS_BIN
from benchmarks.support.stack import Upstream
from harness_adapters.harnesses import CommandAdapter
from harness_adapters.runner import EpisodeRunner
from harness_adapters.tasks import Task

# Prompts of 4,500 to 7,600 tokens on 2 CPU cores, and the first test also waits for the shared
# vLLM to start: Claude Code took 330 s of it on a quiet machine (2026-11-23), so these get 600 s.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

CODEX = HARNESS_BIN / "codex"
CONFIG = """model = "gpt-5-codex"
model_provider = "rlp"
web_search = "disabled"
[model_providers.rlp]
name = "rl-proxy"
base_url = "{openai_base_url}"
env_key = "RLP_SESSION_KEY"
wire_api = "responses"
"""


def test_codex_runs_as_an_episode_and_every_call_is_recorded(make_proxy: Any, vllm: Upstream, tmp_path: Path) -> None:
    assert CODEX.exists(), "run `make install`: it installs Codex CLI into .harnesses/"
    # Codex asks for no output limit: the proxy's cap keeps the 135M model from writing to the
    # end of its context (and this test short).
    proxy = make_proxy(vllm.url, max_completion_tokens=48)
    codex = CommandAdapter(
        [str(CODEX), "exec", "--skip-git-repo-check", "{prompt}"],
        env={"CODEX_HOME": "{workdir}/.codex"},
        files={".codex/config.toml": CONFIG},
    )
    runner = EpisodeRunner(proxy.url, codex, [], vllm.model, tmp_path, "codex", timeout=600)
    [result] = asyncio.run(runner.run_all([Task("hello", "Say hello.")], 1))
    log = Path(str(result.outcome.log)).read_text() + result.outcome.output
    assert result.calls >= 1, f"Codex made no call through the proxy: {log[-800:]}"
    for call in proxy.calls(result.session_id):
        assert call.ok and call.api == "openai.responses" and call.stream, call.error
        assert call.rewrites["model"] == ["gpt-5-codex", vllm.model]
        assert call.rewrites["max_tokens"] == [None, 48]
        assert len(call.prompt_token_ids) > 3000 and call.completions[0].token_ids
        assert len(call.completions[0].logprobs) == len(call.completions[0].token_ids)
        assert call.response is not None and call.response["id"] == call.response_id
    # The 135M model does not finish in 48 tokens: Codex reports the incomplete response (exit
    # code 1), which it can only do after parsing the whole event stream.
    assert result.status == "ok" or "Incomplete response returned, reason: max_output_tokens" in log, log[-800:]
    assert "stream disconnected" not in log and "error decoding" not in log.lower()
