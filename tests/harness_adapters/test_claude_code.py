"""The real Claude Code CLI (npm @anthropic-ai/claude-code, installed by `make install` into
.harnesses/) pointed at the proxy with two environment variables, against the real vLLM."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from benchmarks.support.sessions import HARNESS_BIN
from benchmarks.support.stack import Upstream
from recorder.trajectories import build_sequences

# Prompts of 4,500 to 7,600 tokens on 2 CPU cores, and the first test also waits for the shared
# vLLM to start: Claude Code took 330 s of it on a quiet machine (2026-11-23), so these get 600 s.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

CLAUDE = HARNESS_BIN / "claude"


def test_claude_code_runs_through_the_proxy_and_every_call_is_recorded(
    make_proxy: Any, vllm: Upstream, tmp_path: Path
) -> None:
    assert CLAUDE.exists(), "run `make install`: it installs Claude Code into .harnesses/"
    proxy = make_proxy(vllm.url)
    env = {
        **os.environ,
        "ANTHROPIC_BASE_URL": proxy.url,
        "ANTHROPIC_API_KEY": "run=harness,task=hello,id=claude-code-1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "48",  # its prompt is ~7,600 tokens of an 8,192 context
        "DISABLE_AUTOUPDATER": "1",
        "HOME": str(tmp_path),
    }
    done = subprocess.run(
        [str(CLAUDE), "-p", "Say hello.", "--model", "claude-sonnet-4-5"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    calls = proxy.calls("claude-code-1")
    # The 135M model rarely finishes inside Claude Code's output limit, so Claude Code may exit 1
    # ("response exceeded the output token maximum"); what matters here is that every call it
    # made went through the proxy and was recorded with its tokens.
    assert calls, f"Claude Code made no call through the proxy: {done.stdout[-500:]} {done.stderr[-500:]}"
    for call in calls:
        assert call.ok and call.api == "anthropic.messages" and call.stream
        assert call.request["model"] == "claude-sonnet-4-5"
        assert call.rewrites["model"] == ["claude-sonnet-4-5", vllm.model]
        assert len(call.prompt_token_ids) > 5000 and call.completions[0].token_ids
        assert len(call.completions[0].logprobs) == len(call.completions[0].token_ids)
    assert done.returncode == 0 or "output token maximum" in done.stdout + done.stderr
    report = build_sequences(calls)
    assert sum(len(s.calls) for s in report.sequences) == len(calls) and not report.skipped
