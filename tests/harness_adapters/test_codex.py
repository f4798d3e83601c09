"""The real Codex CLI (npm @openai/codex, installed by `make install` into .harnesses/) as the
shell example's sandboxed config runs it, unchanged, on the real vLLM: every call recorded
through the proxy's Responses API with its tokens, and its tool-calling turns joined into one
training sequence whose masked-in tokens are exactly the sampled ids (token-in). SmolLM2-135M
seldom calls a tool of its own accord, so the session's sampling forces `tool_choice: required`
(recorded as a rewrite). Codex in a task's container: tests/harness_adapters/test_swe.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from benchmarks.support.sessions import FORCED, HARNESS_BIN, harness_session, masked_in, sampled
from benchmarks.support.stack import Upstream
from recorder.graph import build_sequences

# A ~4,700-token prompt on 2 CPU cores, two rounds of episodes at most; it may also wait for the shared vLLM to start.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.usefixtures("bwrap")  # its commands run in the shell example's sandbox
def test_codex_tool_calls_are_recorded_and_join_one_exact_sequence(make_proxy: Any, vllm: Upstream) -> None:
    assert (HARNESS_BIN / "codex").exists(), "run `make install`: it installs Codex CLI into .harnesses/"
    # A forced call cut at the output cap is no tool call, and Codex then quits. 384 tokens (not
    # the config's 128) leaves most calls room to end, yet about one episode in three has no
    # finished tool call before its last (its first call cut, or too long to answer in time).
    # Under forced tool calls Codex never stops: its timeout ends it, and the call cut then fails
    # as "client disconnected". 90 s: an episode's first call, with `make test`'s other worker
    # busy beside it, once took more than 60. One episode first, which leaves Codex's prompt in
    # vLLM's prefix cache; if it did not continue, three at once (vLLM batches them: three took
    # 91 s here, as one does, once the prompt was cached; cold, three first calls of ~4,700 tokens
    # ran out of time together). One after the other, five episodes took up to 436 s.
    proxy = make_proxy(vllm.url, max_completion_tokens=384)
    episode = harness_session("train-codex.yaml", sampling=FORCED, timeout=90)

    def answered(session: str) -> list[Any]:
        recorded = proxy.calls(session)
        assert all(c.ok for c in recorded[:-1]), [c.error for c in recorded]  # the last: cut at the timeout
        return [c for c in recorded if c.ok]

    def continued(calls: list[Any]) -> bool:  # a tool call finished, and a call after it
        return any(c.completions[0].finish_reason == "tool_calls" for c in calls[:-1])

    played: list[list[Any]] = []
    for round_, size in enumerate((1, 3)):
        with ThreadPoolExecutor(size) as pool:
            keys = [f"codex-{round_}-{i}" for i in range(size)]
            played += [answered(s) for s in pool.map(lambda key: episode(proxy.url, key, vllm.model), keys)]
        if any(map(continued, played)):
            break
    calls = next((c for c in played if continued(c)), [])
    assert calls, f"no tool call finished before the last answered call, in {len(played)} episodes"
    for call in calls:  # each recorded as Codex sent it, with the proxy's rewrites and every token
        assert call.api == "openai.responses" and call.stream
        assert call.rewrites["model"] == ["gpt-5-codex", vllm.model]
        assert call.rewrites["max_tokens"] == [None, 384]  # Codex asks for no limit: the proxy's cap
        assert call.rewrites["tool_choice"][1] == "required"
        assert len(call.prompt_token_ids) > 3000 and call.completions[0].token_ids
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
