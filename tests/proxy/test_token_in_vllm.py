"""Token-in against the real vLLM CPU server: a tool-using session through real SDKs becomes one
training sequence whose masked-in tokens are exactly the sampled ids, where the chat template
(SmolLM2's drops tool calls) breaks it into one sequence per call in messages mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import pytest
from openai import OpenAI

from recorder import CallRecord
from recorder.trajectories import build_sequences
from tests.support.samples import ADD_TOOL, FORCE_ADD
from tests.support.stack import Upstream

pytestmark = pytest.mark.vllm

ASK = [{"role": "user", "content": "Add 2 and 3 with the add tool, then add 4 to the result."}]


def tool_session(url: str, key: str, model: str, stream: bool = False) -> None:
    """Three calls of the openai SDK: two forced `add` calls answered with tool results, then one
    free answer, each call sending the whole conversation again as a harness does."""
    client = OpenAI(base_url=url, api_key=key, max_retries=0)
    messages: list[dict[str, Any]] = list(ASK)
    for turn in range(3):
        kwargs: Any = dict(model=model, messages=messages, tools=[ADD_TOOL], max_tokens=80, temperature=0,
                           tool_choice=FORCE_ADD if turn < 2 else "auto")  # fmt: skip
        if stream:
            final = client.chat.completions.stream(**kwargs).__enter__().get_final_completion()
        else:
            final = client.chat.completions.create(**kwargs)
        message = final.choices[0].message
        messages.append(message.model_dump(exclude_none=True, exclude={"parsed"}))
        messages += [{"role": "tool", "tool_call_id": t.id, "content": "5"} for t in message.tool_calls or []]


def assert_one_exact_sequence(calls: list[CallRecord]) -> None:
    report = build_sequences(calls)
    [sequence] = report.sequences
    assert [span.seq for span in sequence.spans] == [c.seq for c in calls]
    sampled = [t for c in calls for t in c.completions[0].token_ids]
    assert [t for t, m in zip(sequence.input_ids, sequence.loss_mask, strict=True) if m] == sampled
    logprobs = [lp for c in calls for lp in c.completions[0].logprobs]
    assert [lp for lp, m in zip(sequence.logprobs, sequence.loss_mask, strict=True) if m] == logprobs
    assert [c.token_in for c in calls] == [False] + [True] * (len(calls) - 1)
    assert calls[0].thread_start == "first call of the session seen by this proxy"
    assert all(c.thread_start is None for c in calls[1:])


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_calling_session_is_one_exact_sequence(make_proxy: Any, vllm: Upstream, stream: bool) -> None:
    proxy = make_proxy(vllm.url)
    tool_session(proxy.v1, "ti-tools", vllm.model, stream)
    assert_one_exact_sequence(proxy.calls("ti-tools"))


def test_in_messages_mode_the_template_breaks_the_same_session_apart(make_proxy: Any, vllm: Upstream) -> None:
    proxy = make_proxy(vllm.url, messages_mode=True)
    tool_session(proxy.v1, "ti-messages", vllm.model)
    calls = proxy.calls("ti-messages")
    assert len(build_sequences(calls).sequences) == 3 and not any(c.token_in for c in calls)


def test_an_anthropic_tool_use_round_trip_is_one_sequence(make_proxy: Any, vllm: Upstream) -> None:
    proxy = make_proxy(vllm.url)
    claude = anthropic.Anthropic(base_url=proxy.url, api_key="ti-claude", max_retries=0)
    add = {"name": "add", "description": "Add two integers.", "input_schema": ADD_TOOL["function"]["parameters"]}
    ask: list[dict[str, Any]] = [{"role": "user", "content": "Use the add tool to add 2 and 3."}]
    greedy: Any = {"extra_body": {"temperature": 0}, "tools": [add], "model": vllm.model}
    forced = {"type": "tool", "name": "add"}
    with claude.messages.stream(max_tokens=60, messages=ask, tool_choice=forced, **greedy) as s:  # type: ignore[arg-type]
        reply = s.get_final_message()
    [use] = [b for b in reply.content if b.type == "tool_use"]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "5"}
    follow = [*ask, {"role": "assistant", "content": [use.model_dump()]}, {"role": "user", "content": [result]}]
    claude.messages.create(max_tokens=12, messages=follow, **greedy)
    assert_one_exact_sequence(proxy.calls("ti-claude"))


def test_an_edited_history_starts_a_new_thread_and_says_why(make_proxy: Any, vllm: Upstream) -> None:
    proxy = make_proxy(vllm.url)
    client = OpenAI(base_url=proxy.v1, api_key="ti-edit", max_retries=0)
    ask = [{"role": "user", "content": "What is 2 + 3? Answer with one number."}]
    first = client.chat.completions.create(model=vllm.model, messages=ask, max_tokens=30, temperature=0)
    assert first.choices[0].finish_reason == "stop"  # so the end-of-turn token is known
    answer = {"role": "assistant", "content": first.choices[0].message.content}
    edited = {"role": "assistant", "content": "Something the model never said."}
    for said in (edited, answer):
        client.chat.completions.create(model=vllm.model, messages=[*ask, said, {"role": "user", "content": "Go on."}],
                                       max_tokens=8, temperature=0)  # fmt: skip
    _, rewritten, continued = proxy.calls("ti-edit")
    assert not rewritten.token_in and rewritten.thread_start == "message 2 is not the assistant answer sampled there"
    assert continued.token_in and continued.thread_start is None
    shown = build_sequences([_, rewritten])
    assert shown.breaks and shown.breaks[0].thread_start == rewritten.thread_start


THINK_TEMPLATE = (Path(__file__).parent.parent / "support" / "think_template.jinja").read_text()
# SmolLM2's template, except that earlier assistant turns lose their <think> blocks (as Qwen3's
# does), sent with each request; the answers are made to think by a regex.
THINKING = {"chat_template": THINK_TEMPLATE,
            "structured_outputs": {"regex": r"<think>[a-z ]{4,40}</think>[A-Za-z ,.]{4,40}"}}  # fmt: skip


def think_session(url: str, key: str, model: str) -> None:
    """Four turns whose answers think first; the harness sends them back whole or stripped of
    their thinking, turn about."""
    client = OpenAI(base_url=url, api_key=key, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Think, then name a colour."}]
    for turn in range(4):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0,  # type: ignore[call-overload]
                                               extra_body=THINKING)  # fmt: skip
        answer = reply.choices[0].message.content
        assert "</think>" in answer and reply.choices[0].finish_reason == "stop", answer
        shown = answer if turn % 2 else answer.split("</think>")[-1].strip()
        messages += [{"role": "assistant", "content": shown}, {"role": "user", "content": "And another?"}]


def test_a_template_that_strips_earlier_thinking_still_gives_one_sequence(make_proxy: Any, vllm: Upstream) -> None:
    token_in, messages_mode = make_proxy(vllm.url), make_proxy(vllm.url, messages_mode=True)
    think_session(token_in.v1, "ti-think", vllm.model)
    think_session(messages_mode.v1, "ti-think", vllm.model)
    assert_one_exact_sequence(token_in.calls("ti-think"))
    assert len(build_sequences(messages_mode.calls("ti-think")).sequences) == 4
