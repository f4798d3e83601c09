"""Token-in through the real Claude Code and Codex CLIs (the shell example's sandboxed configs,
unchanged) on the real vLLM: their tool-calling turns join one training sequence whose masked-in
tokens are exactly the sampled ids. SmolLM2-135M seldom calls a tool of its own accord, so the
session's sampling forces `tool_choice: required` (recorded as a rewrite)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.support.sessions import FORCED, harness_session, masked_in, sampled
from benchmarks.support.stack import Upstream
from recorder.graph import build_sequences

# ~5,800 (Claude Code) and ~4,700-token (Codex) prompts on 2 CPU cores, up to 3 episodes; the
# first test may also wait for the shared vLLM to start.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize(
    ("config", "extra", "env", "timeout"),
    [
        ("train-claude.yaml", ("--max-turns", "3"), {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "384"}, 240),
        ("train-codex.yaml", (), {}, 60),  # under forced tool calls it never stops: its timeout ends it
    ],
)
@pytest.mark.usefixtures("bwrap")  # its commands run in the shell example's sandbox
def test_a_harness_tool_calling_episode_joins_one_exact_sequence(
    make_proxy: Any, vllm: Upstream, config: str, extra: tuple[str, ...], env: dict[str, str], timeout: float
) -> None:
    # A forced call cut at the output cap is no tool call: Codex then quits, Claude Code sends the
    # turn again. 384 tokens (not the configs' 128) leaves most calls room to end, and an episode
    # with no finished tool call before its last is run again, up to 5 times (Codex's first call
    # was cut in 3 episodes in a row once, 2026-11-28: about 28 s an episode).
    proxy = make_proxy(vllm.url, max_completion_tokens=384)
    episode = harness_session(config, *extra, sampling=FORCED, timeout=timeout, env=env)
    for attempt in range(5):
        calls = [c for c in proxy.calls(episode(proxy.url, f"ti-harness-{attempt}", vllm.model)) if c.ok]
        continued = any(c.completions[0].finish_reason == "tool_calls" for c in calls[:-1])  # and a call after it
        if continued:
            break
    assert continued, f"{config}: no tool call finished before the last of {len(calls)} answered call(s), in 5 episodes"
    assert all(c.rewrites["tool_choice"][1] == "required" for c in calls)
    # Every continuation was built from the tokens already sampled: none went as messages. A
    # harness that sends a turn again (Claude Code after an answer cut at its output cap) forks.
    assert calls[0].thread_start == "first call of the session seen by this proxy"
    for call in calls[1:]:
        assert call.token_in, call.thread_start
    report = build_sequences(calls)
    assert len(report.sequences) <= 1 + sum(c.thread_start is not None for c in calls[1:])
    for sequence in report.sequences:
        assert masked_in(sequence) == sampled(sequence, calls)
