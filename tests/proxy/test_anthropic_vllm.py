"""Anthropic Messages through the proxy with the real `anthropic` SDK and the real vLLM CPU
server: answers in Anthropic's shape, every call recorded with exact token ids."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

from benchmarks.support.stack import RunningProxy, Upstream, direct_chat

pytestmark = pytest.mark.vllm

ASK = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0}  # this anthropic SDK takes no temperature argument of its own
WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search"}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
ADD = {
    "name": "add",
    "description": "Add two integers.",
    "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
}


def client(proxy: RunningProxy, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0)


def test_message_recorded_with_the_tokens_vllm_sampled(proxy: RunningProxy, vllm: Upstream) -> None:
    reply = client(proxy, "a-plain").messages.create(
        model=vllm.model, max_tokens=16, system="Be brief.", messages=ASK, extra_body=GREEDY
    )
    assert reply.type == "message" and reply.role == "assistant" and reply.stop_reason in ("max_tokens", "end_turn")
    assert reply.content[0].type == "text"
    [call] = proxy.calls("a-plain")
    reference = direct_chat(
        vllm, messages=[{"role": "system", "content": "Be brief."}, *ASK], max_tokens=16, temperature=0
    )
    assert call.api == "anthropic.messages" and call.ok
    assert call.prompt_token_ids == reference["prompt_token_ids"]
    assert call.completions[0].token_ids == reference["choices"][0]["token_ids"]
    assert len(call.completions[0].logprobs) == reply.usage.output_tokens == len(call.completions[0].token_ids)
    assert call.request["system"] == "Be brief."  # the client's own request, not the translation
    assert call.response is not None and call.response["content"][0]["text"] == reply.content[0].text


def test_stream_has_the_full_event_sequence_and_the_same_tokens(proxy: RunningProxy, vllm: Upstream) -> None:
    c = client(proxy, "a-stream")
    with c.messages.stream(model=vllm.model, max_tokens=12, messages=ASK, extra_body=GREEDY) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(events)
    c.messages.create(model=vllm.model, max_tokens=12, messages=ASK, extra_body=GREEDY)
    streamed, plain = proxy.calls("a-stream")
    assert streamed.stream and not plain.stream
    assert streamed.prompt_token_ids == plain.prompt_token_ids
    assert streamed.completions[0].token_ids == plain.completions[0].token_ids
    assert len(streamed.completions[0].logprobs) == final.usage.output_tokens == len(plain.completions[0].token_ids)
    assert streamed.response is not None
    assert streamed.response["content"][0]["text"] == final.content[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_and_tool_result(proxy: RunningProxy, vllm: Upstream, stream: bool) -> None:
    key = f"a-tools-{stream}"
    c = client(proxy, key)
    ask = [{"role": "user", "content": "Use the add tool to add 2 and 3."}]
    kwargs: Any = dict(
        model=vllm.model,
        max_tokens=80,
        tools=[ADD],
        tool_choice={"type": "tool", "name": "add"},
        messages=ask,
        extra_body=GREEDY,
    )
    if stream:
        with c.messages.stream(**kwargs) as s:
            reply = s.get_final_message()
    else:
        reply = c.messages.create(**kwargs)
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert [u.name for u in uses] == ["add"] and reply.stop_reason == "tool_use"
    result = {"type": "tool_result", "tool_use_id": uses[0].id, "content": "5"}
    follow = [
        *ask,
        {"role": "assistant", "content": [u.model_dump() for u in uses]},
        {"role": "user", "content": [result]},
    ]
    answer = c.messages.create(model=vllm.model, max_tokens=8, tools=[ADD], messages=follow, extra_body=GREEDY)
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens")
    first, second = proxy.calls(key)
    assert first.response is not None
    assert [b["name"] for b in first.response["content"] if b["type"] == "tool_use"] == ["add"]
    assert first.completions[0].token_ids and second.completions[0].token_ids
    assert second.request["messages"][2]["content"][0]["type"] == "tool_result"


def test_count_tokens_matches_the_recorded_prompt(proxy: RunningProxy, vllm: Upstream) -> None:
    c = client(proxy, "a-count")
    counted = c.messages.count_tokens(model=vllm.model, messages=ASK)
    c.messages.create(model=vllm.model, max_tokens=1, messages=ASK)
    [call] = proxy.calls("a-count")
    assert counted.input_tokens == len(call.prompt_token_ids)


def test_claude_code_style_request_is_fitted(proxy: RunningProxy, vllm: Upstream) -> None:
    """Claude Code's own model names and 32000-token limit: served by the policy, capped, recorded.
    Greedy and ended at its first full stop: sampled, the answer ran to the 2,048-token cap now and
    then (150 s on two cores), and greedy it took 20 s."""
    c = anthropic.Anthropic(base_url=proxy.url, api_key="a-claude", max_retries=0, default_query={"beta": "true"})
    greedy, asked = {"temperature": 0}, {"max_tokens": 32000, "stop_sequences": ["."]}
    with c.messages.stream(model="claude-sonnet-4-5", messages=ASK, extra_body=greedy, **asked) as stream:
        reply = stream.get_final_message()
    assert reply.type == "message" and reply.content
    [call] = proxy.calls("a-claude")
    assert call.rewrites == {"model": ["claude-sonnet-4-5", vllm.model], "max_tokens": [32000, 2048]}
    assert call.request["model"] == "claude-sonnet-4-5"


def test_errors_come_in_anthropic_shape(make_proxy: Any, vllm: Upstream) -> None:
    proxy = make_proxy(vllm.url, route_unknown_models=False)
    url = f"{proxy.url}/v1/messages?beta=true"
    headers = {"x-api-key": "a-errors", "anthropic-version": "2023-06-01"}
    cases = [
        ({"model": vllm.model, "messages": ASK}, 400, "max_tokens"),
        ({"model": vllm.model, "max_tokens": 5, "messages": [{"role": "user", "content": [IMAGE]}]}, 400, "image"),
        ({"model": "claude-not-served", "max_tokens": 5, "messages": ASK}, 404, "claude-not-served"),
        ({"model": vllm.model, "max_tokens": 5, "messages": ASK, "tools": [WEB_SEARCH]}, 400, "web_search_20250305"),
    ]
    for body, status, mentions in cases:
        resp = httpx.post(url, json=body, headers=headers, timeout=60)
        assert resp.status_code == status, resp.text
        data = resp.json()
        assert data["type"] == "error" and mentions in data["error"]["message"]
        assert data["error"]["type"] in ("invalid_request_error", "not_found_error")
    with pytest.raises(anthropic.BadRequestError):
        client(proxy, "a-errors").messages.create(model=vllm.model, max_tokens=0, messages=ASK)
    ok = httpx.post(url, json={"model": vllm.model, "max_tokens": 2, "messages": ASK}, headers=headers, timeout=60)
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    assert [c.ok for c in proxy.calls("a-errors")] == [False, True]  # the 404 reached vLLM and is recorded


def test_fields_that_are_not_messages_fields_never_reach_vllm(proxy: RunningProxy, vllm: Upstream) -> None:
    """litellm's adapter passed unknown fields through: `n: 3` past the proxy's choice limit and
    vLLM's own `logit_bias` reached vLLM (three choices sampled). They are dropped and recorded so."""
    extra = {"n": 3, "logit_bias": {"42": 5.0}, "context_management": {"edits": []}}
    reply = client(proxy, "a-extra").messages.create(
        model=vllm.model, max_tokens=4, messages=ASK, extra_body={**GREEDY, **extra}
    )
    assert reply.type == "message"
    [call] = proxy.calls("a-extra")
    assert len(call.completions) == 1
    assert {name: call.rewrites[name] for name in extra} == {name: [value, None] for name, value in extra.items()}
