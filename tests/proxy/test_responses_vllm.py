"""OpenAI Responses through the proxy with the real `openai` SDK and the real vLLM CPU server:
answers the SDK parses, every call recorded with exact token ids, `previous_response_id`
resolved from the store (also after a restart)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from benchmarks.support.stack import RunningProxy, Upstream, direct_chat, read_store
from proxy.app import create_app
from proxy.server import AppThread
from proxy.settings import Settings

pytestmark = pytest.mark.vllm

ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
}
FORCE_ADD = {"type": "function", "name": "add"}
ASK_ADD = "Use the add tool to add 2 and 3."
IMAGE = {"type": "input_image", "image_url": "http://example.com/a.png"}


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_response_recorded_with_the_tokens_vllm_sampled(proxy: RunningProxy, vllm: Upstream) -> None:
    reply = client(proxy.url, "r-plain").responses.create(
        model=vllm.model, input="Name three colours.", instructions="Be brief.", max_output_tokens=16, temperature=0
    )
    assert reply.object == "response" and reply.status in ("completed", "incomplete") and reply.output_text
    [call] = proxy.calls("r-plain")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
    reference = direct_chat(vllm, messages=messages, max_tokens=16, temperature=0)
    assert call.api == "openai.responses" and call.ok and call.response_id == reply.id
    assert call.prompt_token_ids == reference["prompt_token_ids"]
    assert call.completions[0].token_ids == reference["choices"][0]["token_ids"]
    assert reply.usage is not None and len(call.completions[0].logprobs) == reply.usage.output_tokens
    assert call.request["instructions"] == "Be brief."  # the client's own request, not the translation
    assert call.response is not None and call.response["id"] == reply.id
    assert call.response["output"][0]["content"][0]["text"] == reply.output_text


def test_stream_has_the_full_event_sequence_and_the_same_tokens(proxy: RunningProxy, vllm: Upstream) -> None:
    c = client(proxy.url, "r-stream")
    # Long enough to complete: the SDK's final response needs response.completed, not .incomplete.
    kwargs: Any = dict(
        model=vllm.model, input="Name three colours.", instructions="Be brief.", max_output_tokens=40, temperature=0
    )
    with c.responses.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_response()
    assert events[:2] == ["response.created", "response.in_progress"] and events[-1] == "response.completed"
    assert {"response.output_item.added", "response.output_text.delta", "response.output_item.done"} <= set(events)
    c.responses.create(**kwargs)
    streamed, plain = proxy.calls("r-stream")
    assert streamed.stream and not plain.stream and streamed.ok
    assert streamed.prompt_token_ids == plain.prompt_token_ids
    assert streamed.completions[0].token_ids == plain.completions[0].token_ids
    assert final.usage is not None and len(streamed.completions[0].logprobs) == final.usage.output_tokens
    assert streamed.response is not None and streamed.response["id"] == final.id == streamed.response_id
    assert streamed.response["output"][0]["content"][0]["text"] == final.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_round_trip_through_previous_response_id(
    proxy: RunningProxy, vllm: Upstream, stream: bool
) -> None:
    key = f"r-tools-{stream}"
    c = client(proxy.url, key)
    kwargs: Any = dict(
        model=vllm.model, input=ASK_ADD, tools=[ADD], tool_choice=FORCE_ADD, max_output_tokens=80, temperature=0
    )
    if stream:
        with c.responses.stream(**kwargs) as s:
            first = s.get_final_response()
    else:
        first = c.responses.create(**kwargs)
    [called] = [item for item in first.output if item.type == "function_call"]
    assert called.name == "add" and called.call_id
    result = {"type": "function_call_output", "call_id": called.call_id, "output": "5"}
    second = c.responses.create(
        model=vllm.model, previous_response_id=first.id, input=[result], tools=[ADD], max_output_tokens=8, temperature=0
    )
    assert second.previous_response_id == first.id and second.output_text
    # The same conversation sent whole, without previous_response_id: the same prompt tokens.
    item = {"type": "function_call", "call_id": called.call_id, "name": "add", "arguments": called.arguments}
    whole = [{"role": "user", "content": ASK_ADD}, item, result]
    c.responses.create(model=vllm.model, input=whole, tools=[ADD], max_output_tokens=8, temperature=0)
    one, two, three = proxy.calls(key)
    assert one.response is not None and one.response["output"][0]["type"] == "function_call"
    assert two.request["previous_response_id"] == first.id  # recorded as the client sent it
    assert two.prompt_token_ids == three.prompt_token_ids
    assert two.completions[0].token_ids == three.completions[0].token_ids
    assert two.token_in and three.token_in  # both continue the first call's tokens (docs/proxy.md#token-in)
    assert c.responses.retrieve(second.id).output_text == second.output_text


def test_previous_response_id_survives_a_restart_and_stays_in_its_session(tmp_path: Path, vllm: Upstream) -> None:
    db = str(tmp_path / "calls.db")
    with AppThread(create_app(Settings(upstream=vllm.url, db=db))) as first_proxy:
        first = client(first_proxy.url, "r-restart").responses.create(
            model=vllm.model, input="My name is Ada. Say hello.", max_output_tokens=10, temperature=0
        )
    with AppThread(create_app(Settings(upstream=vllm.url, db=db))) as second_proxy:
        again = client(second_proxy.url, "r-restart").responses.create(
            model=vllm.model, input="What is my name?", previous_response_id=first.id, max_output_tokens=10
        )
        with pytest.raises(openai.BadRequestError) as stranger:
            client(second_proxy.url, "r-stranger").responses.create(
                model=vllm.model, input="What is my name?", previous_response_id=first.id, max_output_tokens=10
            )
    assert again.previous_response_id == first.id
    assert "not found" in stranger.value.message and stranger.value.body["param"] == "previous_response_id"
    calls = read_store(db, lambda s: _calls(s, "r-restart"))
    before, after = calls
    # The follow-up's prompt holds the whole first exchange: its prompt and its sampled tokens.
    assert after.prompt_token_ids[: len(before.prompt_token_ids)] == before.prompt_token_ids
    assert len(after.prompt_token_ids) > len(before.prompt_token_ids) + len(before.completions[0].token_ids)
    assert read_store(db, lambda s: _calls(s, "r-stranger")) == []


async def _calls(store: Any, session: str) -> list[Any]:
    return [c async for c in store.iter_calls(session)]


@pytest.mark.parametrize(
    "body, named",
    [
        ({"tools": [{"type": "web_search"}]}, "'web_search'"),
        ({"input": [{"role": "user", "content": [IMAGE]}]}, "'input_image'"),
        ({"background": True}, "'background'"),
        ({"input": ""}, "'input'"),
        ({"previous_response_id": "resp_never"}, "resp_never"),
    ],
)
def test_unsupported_requests_get_an_openai_error_naming_the_cause(
    proxy: RunningProxy, vllm: Upstream, body: dict[str, Any], named: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client(proxy.url, "r-bad").responses.create(**{"model": vllm.model, "input": "Hi", **body})
    assert refused.value.status_code == 400 and named in refused.value.message
    assert proxy.calls("r-bad") == []
