"""The real Codex CLI (npm @openai/codex, installed by `make install` into .harnesses/) as the
shell example's sandboxed config runs it, unchanged but for its instructions (one line of
ours, `model_instructions_file`), on the real vLLM: every call recorded
through the proxy's Responses API with its tokens, and its tool-calling turns joined into one
training sequence whose masked-in tokens are exactly the sampled ids (token-in). SmolLM2-135M
seldom calls a tool of its own accord, so the session's sampling forces `tool_choice: required`
(recorded as a rewrite). Codex in a task's container: tests/harness_adapters/test_swe.py."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.support.sessions import FORCED, HARNESS_BIN, harness_session, masked_in, sampled
from benchmarks.support.stack import Upstream
from recorder.graph import build_sequences

# Episodes of up to 150 s on 2 CPU cores; it may also wait for the shared vLLM to start.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
FIRST_TOKENS = "vllm:time_to_first_token_seconds_count"
INSTRUCTIONS = "You are a coding agent in a terminal. Do the task with your tools, then answer in one sentence.\n"


@pytest.mark.usefixtures("bwrap")  # its commands run in the shell example's sandbox
def test_codex_tool_calls_are_recorded_and_join_one_exact_sequence(
    make_proxy: Any, vllm: Upstream, tmp_path: Path
) -> None:
    assert (HARNESS_BIN / "codex").exists(), "run `make install`: it installs Codex CLI into .harnesses/"
    # A forced call cut at the output cap is no tool call, and Codex then quits. 384 tokens (not
    # the config's 128) leaves most calls room to end, yet about one episode in three has no
    # finished tool call before its last (its first call cut, or too long to answer in time).
    # Under forced tool calls Codex never stops: it is stopped at its timeout, or as soon as one
    # episode has continued (a finished tool call, and a call after it), and the call cut then
    # fails as "client disconnected". One episode first; two more once vLLM has read its prompt
    # (its first token: vLLM's time-to-first-token count), which is then in vLLM's prefix cache.
    # Codex's own instructions (about 3,800 of its ~4,700 prompt tokens) are replaced by one line,
    # as the Claude Code tests give it a system prompt of their own: the same protocol and tools
    # in a prompt of ~900 tokens, whose first call takes seconds here instead of 78-92 s (prefill
    # grows with the square of the prompt on CPU), and the test about 45 s alone instead of 120.
    proxy = make_proxy(vllm.url, max_completion_tokens=384)
    instructions = tmp_path / "instructions.md"
    instructions.write_text(INSTRUCTIONS)
    episode = harness_session(
        "train-codex.yaml", "-c", f'model_instructions_file="{instructions}"', sampling=FORCED, timeout=150
    )
    keys = [f"codex-{i}" for i in range(6)]

    def answered(keys: list[str]) -> dict[str, list[Any]]:  # one read of the store for all
        runs = {s.id: s.run for s in proxy.sessions()}
        recorded: dict[str, list[Any]] = {key: [] for key in keys}
        for call in sorted(proxy.calls(), key=lambda c: c.seq):  # each session's in call order
            recorded.get(runs.get(call.session_id, ""), []).append(call)
        for calls in recorded.values():
            assert all(c.ok for c in calls[:-1]), [c.error for c in calls]  # the last: cut when stopped
        return {key: [c for c in calls if c.ok] for key, calls in recorded.items()}

    def continued(calls: list[Any]) -> bool:  # a tool call finished, and a call after it
        return any(c.completions[0].finish_reason == "tool_calls" for c in calls[:-1])

    def first_tokens() -> float:
        metrics = httpx.get(f"{vllm.url.removesuffix('/v1')}/metrics").text.splitlines()
        return sum(float(line.split()[-1]) for line in metrics if line.startswith(FIRST_TOKENS))

    stop, before = threading.Event(), first_tokens()
    with ThreadPoolExecutor(3) as pool:
        playing = {keys[0]: pool.submit(episode, proxy.url, keys[0], vllm.model, stop)}
        while not playing[keys[0]].done() and first_tokens() == before:
            time.sleep(1)
        # Three at a time; one that ended without continuing (all three first calls of a run
        # in the suite ran to the cap) is replaced, up to six.
        while not all(f.done() for f in playing.values()) or (len(playing) < len(keys) and not stop.is_set()):
            if any(map(continued, answered(list(playing)).values())):
                stop.set()
            running = sum(not f.done() for f in playing.values())
            for key in keys[len(playing) : len(playing) + max(0, 3 - running)] if not stop.is_set() else []:
                playing[key] = pool.submit(episode, proxy.url, key, vllm.model, stop)
            time.sleep(2)
        for finished in playing.values():
            finished.result()  # what went wrong in an episode, raised here
    played = list(answered(list(playing)).values())
    calls = next((c for c in played if continued(c)), [])
    assert calls, f"no tool call finished before the last answered call, in {len(played)} episodes"
    for call in calls:  # each recorded as Codex sent it, with the proxy's rewrites and every token
        assert call.api == "openai.responses" and call.stream
        assert call.rewrites["model"] == ["gpt-5-codex", vllm.model]
        assert call.rewrites["max_tokens"] == [None, 384]  # Codex asks for no limit: the proxy's cap
        assert call.rewrites["tool_choice"][1] == "required"
        assert len(call.prompt_token_ids) > 500 and call.completions[0].token_ids
        assert len(call.completions[0].logprobs) == len(call.completions[0].token_ids)
        assert call.response is not None and call.response["id"] == call.response_id
    # Every continuation was built from the tokens already sampled: none went as messages.
    assert calls[0].thread_start == "first call of the session seen by this proxy"
    for call in calls[1:]:
        assert call.token_in, call.thread_start
    report = build_sequences(calls)
    assert len(report.sequences) <= 1 + sum(c.thread_start is not None for c in calls[1:])
    for sequence in report.sequences:
        assert masked_in(sequence) == sampled(sequence, calls)
