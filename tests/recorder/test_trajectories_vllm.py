"""Reconstruction on sessions recorded from the real vLLM CPU server through the proxy."""

from __future__ import annotations

from typing import Any

import pytest
from openai import OpenAI

from benchmarks.support.samples import ADD_TOOL, FORCE_ADD
from benchmarks.support.stack import RunningProxy, Upstream
from recorder import CallRecord
from recorder.graph import build_sequences

pytestmark = pytest.mark.vllm

SYSTEM = {"role": "system", "content": "You are an agent. To use the calculator, write: CALC <expression>."}


def turn(client: OpenAI, model: str, messages: list[Any], max_tokens: int = 24) -> str:
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    text = reply.choices[0].message.content or ""
    messages.append({"role": "assistant", "content": text})
    return text


def assert_lines_up(sequence: Any, calls: list[CallRecord]) -> None:
    """Every sampled span is exactly a recorded completion, with its logprobs, and nothing else."""
    by_seq = {c.seq: c for c in calls}
    for span in sequence.spans:
        completion = by_seq[span.seq].completions[0]
        assert sequence.input_ids[span.start : span.end] == completion.token_ids
        assert sequence.logprobs[span.start : span.end] == completion.logprobs
        assert sequence.loss_mask[span.start : span.end] == [1] * len(completion.token_ids)
        assert span.version == by_seq[span.seq].policy_version
    assert sum(sequence.loss_mask) == sum(len(by_seq[s.seq].completions[0].token_ids) for s in sequence.spans)
    last = by_seq[sequence.spans[-1].seq]
    assert sequence.input_ids == last.prompt_token_ids + last.completions[0].token_ids


def test_four_turn_tool_using_session_merges_into_one_sequence(proxy: RunningProxy, vllm: Upstream) -> None:
    client = OpenAI(base_url=proxy.v1, api_key="run=traj,id=tools-4")
    messages: list[Any] = [SYSTEM, {"role": "user", "content": "What is 12 * 7? Use the calculator."}]
    turn(client, vllm.model, messages)
    messages.append({"role": "tool", "content": "84"})
    turn(client, vllm.model, messages)
    messages.append({"role": "user", "content": "And 84 + 16?"})
    turn(client, vllm.model, messages)
    messages.append({"role": "tool", "content": "100"})
    turn(client, vllm.model, messages)
    calls = proxy.calls("tools-4")
    report = build_sequences(calls)
    assert report.breaks == [] and report.skipped == []
    [sequence] = report.sequences
    assert sequence.calls == [1, 2, 3, 4]
    assert_lines_up(sequence, calls)
    assert report.tokens < report.unmerged_tokens / 2


def test_summarised_context_splits_with_the_reason(proxy: RunningProxy, vllm: Upstream) -> None:
    client = OpenAI(base_url=proxy.v1, api_key="id=summary")
    messages: list[Any] = [SYSTEM, {"role": "user", "content": "Tell me about Paris."}]
    turn(client, vllm.model, messages)
    messages.append({"role": "user", "content": "And its museums?"})
    turn(client, vllm.model, messages)
    compacted = [SYSTEM, {"role": "user", "content": "Summary so far: we talked about Paris. Now: its parks?"}]
    turn(client, vllm.model, compacted)
    calls = proxy.calls("summary")
    report = build_sequences(calls)
    assert [s.calls for s in report.sequences] == [[1, 2], [3]]
    [brk] = report.breaks
    assert brk.seq == 3 and brk.reason == "prefix diverges" and brk.at is not None and brk.at > 0
    assert brk.found == calls[2].prompt_token_ids[max(0, brk.at - 8) : brk.at + 8]
    for sequence in report.sequences:
        assert_lines_up(sequence, calls)


def test_two_interleaved_agents_give_two_sequences(proxy: RunningProxy, vllm: Upstream) -> None:
    client = OpenAI(base_url=proxy.v1, api_key="id=two-agents")
    planner: list[Any] = [{"role": "system", "content": "You plan."}, {"role": "user", "content": "Plan a picnic."}]
    critic: list[Any] = [{"role": "system", "content": "You criticise."}, {"role": "user", "content": "Judge a plan."}]
    for _ in range(2):
        turn(client, vllm.model, planner, max_tokens=12)
        planner.append({"role": "user", "content": "Go on."})
        turn(client, vllm.model, critic, max_tokens=12)
        critic.append({"role": "user", "content": "More."})
    calls = proxy.calls("two-agents")
    report = build_sequences(calls)
    assert sorted(s.calls for s in report.sequences) == [[1, 3], [2, 4]]
    assert [b.seq for b in report.breaks] == [2]
    for sequence in report.sequences:
        assert_lines_up(sequence, calls)


def test_official_tool_calls_that_the_template_drops_are_a_reported_break(make_proxy: Any, vllm: Upstream) -> None:
    """In messages mode (no token-in) SmolLM2's chat template renders only `content`: an
    assistant tool call sent back is not the text the model sampled, so the next prompt cannot
    extend the chain. It must be a reported break, never a wrong merge (token-in merges it:
    test_token_in_vllm.py)."""
    proxy = make_proxy(vllm.url, messages_mode=True)
    client = OpenAI(base_url=proxy.v1, api_key="id=template-drops")
    messages: list[Any] = [{"role": "user", "content": "Use the add tool to add 2 and 3."}]
    first = client.chat.completions.create(
        model=vllm.model, messages=messages, tools=[ADD_TOOL], tool_choice=FORCE_ADD, max_tokens=80, temperature=0
    )
    [tool_call] = first.choices[0].message.tool_calls or []
    messages.append({"role": "assistant", "content": "", "tool_calls": [tool_call.model_dump()]})
    messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": "5"})
    client.chat.completions.create(model=vllm.model, messages=messages, tools=[ADD_TOOL], max_tokens=8, temperature=0)
    report = build_sequences(proxy.calls("template-drops"))
    assert len(report.sequences) == 2
    assert [(b.seq, b.reason) for b in report.breaks] == [(2, "prefix diverges")]
