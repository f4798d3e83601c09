"""Bad input and upstream failures: each gets the OpenAI error shape with the right status,
never a traceback; the proxy keeps serving and nothing recorded before is lost."""

from __future__ import annotations

import logging
import time
from typing import Any

import anthropic
import httpx
import pytest
from openai import OpenAI

from benchmarks.support.stack import Upstream, new_database
from benchmarks.support.stub_upstream import COMPLETION, MODEL, stub_app
from proxy.server import AppThread
from proxy.threads import NO_RENDERING
from proxy.vllm import free_port
from recorder.graph import build_sequences

CHAT = [{"role": "user", "content": "Hi"}]


def assert_openai_error(resp: httpx.Response, status: int, mentions: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert mentions in error["message"]
    assert "Traceback" not in resp.text
    return error  # type: ignore[no-any-return]


@pytest.mark.vllm
def test_bad_requests_then_good_ones_and_nothing_lost(make_proxy: Any, vllm: Upstream) -> None:
    proxy = make_proxy(vllm.url, route_unknown_models=False)
    url = f"{proxy.v1}/chat/completions"
    good = {"model": vllm.model, "messages": CHAT, "max_tokens": 2}
    client = OpenAI(base_url=proxy.v1, api_key="s-errors")
    client.chat.completions.create(**good)  # type: ignore[call-overload]
    headers = {"Authorization": "Bearer s-errors", "Content-Type": "application/json"}
    assert_openai_error(httpx.post(url, content=b"{not json", headers=headers), 400, "not valid JSON")
    assert_openai_error(httpx.post(url, content=b"[1, 2]", headers=headers), 400, "JSON object")
    error = assert_openai_error(httpx.post(url, json={"model": vllm.model}, headers=headers), 400, "messages")
    assert error["param"] == "messages"
    assert_openai_error(httpx.post(url, json={**good, "model": 3}, headers=headers), 400, "model")
    assert_openai_error(httpx.post(url, json={**good, "stream": "yes"}, headers=headers), 400, "stream")
    assert_openai_error(
        httpx.post(f"{proxy.v1}/completions", json={"model": vllm.model}, headers=headers), 400, "prompt"
    )
    assert_openai_error(httpx.post(url, json={**good, "model": "no-such-model"}, headers=headers), 404, "no-such-model")
    # An error of the upstream's own passes through as is.
    bad_temperature = httpx.post(url, json={**good, "temperature": -1}, headers=headers, timeout=60)
    assert_openai_error(bad_temperature, 400, "temperature")
    assert_openai_error(httpx.get(f"{proxy.url}/v1/nothing-here", headers=headers), 404, "Not Found")
    client.chat.completions.create(**good)  # type: ignore[call-overload]

    calls = proxy.calls("s-errors")
    assert [c.seq for c in calls] == [1, 2, 3, 4]
    assert [c.ok for c in calls] == [True, False, False, True]
    assert [c.http_status for c in calls] == [200, 404, 400, 200]
    assert calls[0].completions[0].token_ids and calls[3].completions[0].token_ids


@pytest.mark.vllm
def test_body_over_the_limit_is_413(make_proxy: Any, vllm: Upstream) -> None:
    proxy = make_proxy(vllm.url, max_body_bytes=2000)
    big = {"model": vllm.model, "messages": [{"role": "user", "content": "x" * 5000}]}
    assert_openai_error(httpx.post(f"{proxy.v1}/chat/completions", json=big), 413, "limit of 2000 bytes")

    def chunked():  # type: ignore[no-untyped-def]
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        yield b"x" * 5000
        yield b'"}]}'

    json_type = {"Content-Type": "application/json"}
    no_length = httpx.post(f"{proxy.v1}/chat/completions", content=chunked(), headers=json_type)
    assert_openai_error(no_length, 413, "over the limit")
    assert proxy.calls() == []


def test_unreachable_upstream_is_502_and_recorded(make_proxy: Any) -> None:
    proxy = make_proxy(f"http://127.0.0.1:{free_port()}/v1")
    client = OpenAI(base_url=proxy.v1, api_key="s-down", max_retries=0)
    with pytest.raises(Exception) as info:
        client.chat.completions.create(model="m", messages=CHAT)  # type: ignore[arg-type]
    assert getattr(info.value, "status_code", None) == 502
    [call] = proxy.calls("s-down")
    assert not call.ok and call.http_status == 502 and "unreachable" in (call.error or "")
    assert call.request["messages"] == CHAT


def test_slow_upstream_is_504_and_the_proxy_keeps_serving(make_proxy: Any) -> None:
    with AppThread(stub_app(latency=2.0)) as slow, AppThread(stub_app(latency=0.0)) as fast:
        proxy = make_proxy(f"{slow.url}/v1", upstream_timeout=0.3)
        body = {"model": MODEL, "messages": CHAT}
        assert_openai_error(httpx.post(f"{proxy.v1}/chat/completions", json=body, timeout=10), 504, "timed out")
        healthy = make_proxy(f"{fast.url}/v1")
        assert httpx.post(f"{healthy.v1}/chat/completions", json=body).status_code == 200
        assert httpx.get(f"{proxy.url}/healthz").json()["status"] == "ok"
    [call] = proxy.calls()
    assert not call.ok and call.http_status == 504


def test_unknown_sessions_rejected_when_configured(make_proxy: Any) -> None:
    with AppThread(stub_app()) as stub:
        proxy = make_proxy(f"{stub.url}/v1", create_sessions=False)
        body = {"model": MODEL, "messages": CHAT}
        resp = httpx.post(f"{proxy.v1}/chat/completions", json=body, headers={"Authorization": "Bearer who"})
        assert_openai_error(resp, 401, "unknown session")
        created = httpx.post(f"{proxy.url}/admin/sessions", json={"run": "r"}).json()
        ok = httpx.post(
            f"{created['base_url']}/chat/completions", json=body, headers={"Authorization": f"Bearer {created['key']}"}
        )
        assert ok.status_code == 200
    assert [c.session_id for c in proxy.calls()] == [created["id"]]


def test_client_leaving_mid_stream_is_recorded_with_the_tokens_so_far(make_proxy: Any) -> None:
    with AppThread(stub_app(token_delay=0.3)) as stub:
        proxy = make_proxy(f"{stub.url}/v1")
        body = {"model": MODEL, "messages": CHAT, "stream": True}
        with httpx.stream("POST", f"{proxy.v1}/chat/completions", json=body, headers={"x-api-key": "s-gone"}) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # one token, then leave
        deadline = time.monotonic() + 10
        while not proxy.calls("s-gone") and time.monotonic() < deadline:
            time.sleep(0.1)
    [call] = proxy.calls("s-gone")
    assert not call.ok and call.http_status == 499 and call.error == "client disconnected"
    assert 1 <= len(call.completions[0].token_ids) < 8
    assert call.prompt_token_ids


def test_a_stream_missing_token_ids_is_answered_but_never_recorded_as_complete(make_proxy: Any) -> None:
    with AppThread(stub_app(drop_token_ids_at=3)) as faulty, AppThread(stub_app()) as sound:
        body = {"model": MODEL, "messages": CHAT, "stream": True}
        bad = make_proxy(f"{faulty.url}/v1")
        lines = httpx.post(f"{bad.v1}/chat/completions", json=body, headers={"x-api-key": "s-gap"}).text.splitlines()
        assert lines[-2] == "data: [DONE]" and not any('"usage"' in line for line in lines)  # not asked for
        good = make_proxy(f"{sound.url}/v1")
        asked = {**body, "stream_options": {"include_usage": True}}
        shown = httpx.post(f"{good.v1}/chat/completions", json=asked, headers={"x-api-key": "s-whole"}).text
        assert '"completion_tokens":8' in shown
    [gap] = bad.calls("s-gap")
    assert not gap.ok and gap.http_status == 200
    assert gap.error == "token capture incomplete: 7 token ids for 8 completion tokens"
    assert "token capture incomplete" in build_sequences([gap]).skipped[0][1]
    [whole] = good.calls("s-whole")
    assert whole.ok and len(whole.completions[0].token_ids) == 8


def test_after_a_stream_lost_token_ids_streams_are_served_from_whole_answers(make_proxy: Any) -> None:
    """Every API streams on, from whole upstream answers, with every token recorded (stub upstream)."""
    with AppThread(stub_app(drop_token_ids_at=3)) as faulty:
        proxy = make_proxy(f"{faulty.url}/v1")
        client = OpenAI(base_url=proxy.v1, api_key="s-fallback", max_retries=0)
        chat = {"model": MODEL, "messages": CHAT}
        first = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**chat, stream=True))
        assert httpx.get(f"{proxy.url}/healthz").json()["stream_gap"].startswith("token capture incomplete")
        again = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**chat, stream=True))
        messages = httpx.post(
            f"{proxy.v1}/messages", json={**chat, "max_tokens": 8, "stream": True}, headers={"x-api-key": "s-fallback"}
        ).text
        with client.responses.stream(model=MODEL, input="Hi") as stream:
            response = stream.get_final_response()
    # The stub writes "t101 t102 ..." when streaming and "stub answer" when not.
    assert first.startswith("t101 t102") and again == "stub answer"
    assert "message_stop" in messages and "stub answer" in messages
    assert response.output_text == "stub answer" and response.status == "completed"
    gap, *rest = proxy.calls("s-fallback")
    assert not gap.ok and "token capture incomplete" in str(gap.error)
    assert [c.api for c in rest] == ["chat.completions", "anthropic.messages", "openai.responses"]
    for call in rest:
        assert call.ok and call.stream and call.completions[0].token_ids == [101, 102, 103, 104, 105, 106, 107, 2]
        assert len(call.completions[0].logprobs) == 8 and call.prompt_token_ids


@pytest.mark.parametrize("fault", ["break_at", "die_at"])
@pytest.mark.parametrize(
    "path, body, last_event",
    [
        ("/chat/completions", {"messages": CHAT}, '"type":"upstream_error"'),
        ("/messages", {"messages": CHAT, "max_tokens": 8}, '"type":"error"'),
        ("/responses", {"input": "Hi"}, '"type":"response.failed"'),
    ],
)
def test_a_broken_upstream_stream_ends_with_an_error_event_and_a_failed_record(
    make_proxy: Any, path: str, body: dict[str, Any], last_event: str, fault: str
) -> None:
    """Every API: after three tokens the stream breaks with a malformed event, or the upstream
    dies and cuts the connection (stub upstream)."""
    with AppThread(stub_app(**{fault: 3})) as faulty:
        proxy = make_proxy(f"{faulty.url}/v1")
        request = {"model": MODEL, "stream": True, **body}
        events = httpx.post(f"{proxy.v1}{path}", json=request, headers={"x-api-key": "s-broken"}).text.strip()
        ok = httpx.post(f"{proxy.v1}{path}", json={**request, "stream": False}, headers={"x-api-key": "s-broken"})
    last = events.split("\n\n")[-1]
    assert last_event in last and "upstream stream failed" in last and "Traceback" not in events
    assert "[DONE]" not in events and "message_stop" not in events and "response.completed" not in events
    broken, after = proxy.calls("s-broken")
    assert not broken.ok and broken.http_status == 502 and "upstream stream failed" in str(broken.error)
    assert broken.completions[0].token_ids == [101, 102, 103]  # the tokens received before the break
    assert ok.status_code == 200 and after.ok  # the session goes on


def test_a_messages_stream_whose_text_names_message_stop_keeps_its_order(make_proxy: Any) -> None:
    """Only the message_stop event waits for the record; a text delta that merely contains the
    words `message_stop` goes out in its place (stub upstream)."""
    words = ["Then ", "message_stop ", "is ", "sent ", "last", ".", "", ""]
    with AppThread(stub_app(stream_words=words)) as upstream:
        proxy = make_proxy(f"{upstream.url}/v1")
        request = {"model": MODEL, "stream": True, "messages": CHAT, "max_tokens": 8}
        events = httpx.post(f"{proxy.v1}/messages", json=request, headers={"x-api-key": "s-order"}).text
    kinds = [block.split("\n", 1)[0].removeprefix("event: ") for block in events.strip().split("\n\n")]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    assert kinds.count("content_block_delta") == 6  # every word, all before message_delta
    [call] = proxy.calls("s-order")
    assert call.ok and call.response["content"][0]["text"] == "".join(words)


@pytest.mark.parametrize(
    ("path", "body", "last_event"),
    [
        ("/messages", {"messages": CHAT, "max_tokens": 8}, "event: error"),
        ("/responses", {"input": "Hi"}, "event: response.failed"),
    ],
)
def test_a_stream_the_translation_cannot_follow_ends_with_an_error_event(
    make_proxy: Any, path: str, body: dict[str, Any], last_event: str
) -> None:
    """Stub upstreams: a stream that opens with a chunk without choices is translated as usual;
    one with a chunk no translator can follow ends with the API's own error event (not a reset
    connection) and is recorded as failed with 502 and its tokens (not as a client's 499)."""
    request = {"model": MODEL, "stream": True, **body}
    with AppThread(stub_app(choiceless_first=True)) as odd, AppThread(stub_app(garbled_at=2)) as garbled:
        answers = []
        for upstream, key in ((odd, "s-odd"), (garbled, "s-garbled")):
            proxy = make_proxy(f"{upstream.url}/v1")
            with httpx.stream("POST", f"{proxy.v1}{path}", json=request, headers={"x-api-key": key}) as answer:
                answers.append(b"".join(answer.iter_bytes()).decode())
            [call] = proxy.calls(key)
            answers.append(call)
    fine, fine_call, broken, broken_call = answers
    assert fine_call.ok and fine_call.completions[0].token_ids == COMPLETION
    assert "message_stop" in fine or "response.completed" in fine
    last = broken.strip().split("\n\n")[-1]
    assert last.startswith(last_event) and "could not be relayed" in last and "Traceback" not in broken, broken[-600:]
    assert not broken_call.ok and broken_call.http_status == 502 and broken_call.completions[0].token_ids


@pytest.mark.parametrize(
    ("path", "body"), [("/messages", {"messages": CHAT, "max_tokens": 8}), ("/responses", {"input": "Hi"})]
)
def test_a_whole_answer_that_cannot_be_translated_is_recorded(make_proxy: Any, path: str, body: dict[str, Any]) -> None:
    """Stub upstream whose answer has a `tool_calls` no translator can follow: the client gets a
    502 in its API's shape, and the call is recorded as failed with its tokens."""
    with AppThread(stub_app(garbled_at=0)) as garbled:
        proxy = make_proxy(f"{garbled.url}/v1")
        answer = httpx.post(f"{proxy.v1}{path}", json={"model": MODEL, **body}, headers={"x-api-key": "s-whole"})
        [call] = proxy.calls("s-whole")
    assert answer.status_code == 502 and "could not be translated" in answer.text and "Traceback" not in answer.text
    assert (answer.json().get("type") == "error") == (path == "/messages")  # Anthropic shape, else OpenAI's
    assert not call.ok and call.http_status == 502 and call.completions[0].token_ids == COMPLETION


def test_a_responses_answer_that_cannot_be_trained_on_can_still_be_continued(make_proxy: Any) -> None:
    """Stub upstream whose stream loses a token id: the client got response.completed, so the
    answer is continued by previous_response_id (from memory, and from the store after a
    restart) though the call is recorded as not trainable."""
    with AppThread(stub_app(drop_token_ids_at=3)) as faulty:
        proxy = make_proxy(f"{faulty.url}/v1")
        headers = {"x-api-key": "s-chain"}
        opening = {"model": MODEL, "input": "Hi", "stream": True}
        first = httpx.post(f"{proxy.v1}/responses", json=opening, headers=headers)
        assert "response.completed" in first.text
        [call] = proxy.calls("s-chain")
        assert not call.ok and call.response_id
        follow = {"model": MODEL, "input": "and then?", "previous_response_id": call.response_id}
        assert httpx.post(f"{proxy.v1}/responses", json=follow, headers=headers).status_code == 200
        restarted = make_proxy(f"{faulty.url}/v1", db=proxy.db)  # nothing in its memory
        assert httpx.post(f"{restarted.v1}/responses", json=follow, headers=headers).status_code == 200


def test_a_messages_stream_with_two_tool_calls_gives_each_its_own_whole_input(make_proxy: Any) -> None:
    """Stub upstream streaming two tool calls as vLLM's parser does (arguments in pieces): the
    anthropic SDK gets two tool_use blocks, each with its own input (one that is not an object wrapped whole)."""
    calls = [("add", '{"a": 2, "b": 3}'), ("mul", '"2,3"')]
    with AppThread(stub_app(tool_calls=calls)) as tools:
        proxy = make_proxy(f"{tools.url}/v1")
        claude = anthropic.Anthropic(base_url=proxy.url, api_key="s-two-tools", max_retries=0)
        with claude.messages.stream(model=MODEL, max_tokens=32, messages=CHAT) as stream:
            message = stream.get_final_message()
        [call] = proxy.calls("s-two-tools")
    blocks = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    assert blocks == [("add", {"a": 2, "b": 3}), ("mul", {"_raw_arguments": '"2,3"'})]
    assert (
        message.stop_reason == "tool_use"
        and call.ok
        and call.completions[0].token_ids == [200, 201, 202, 203, 204, 205, 206]
    )


@pytest.mark.parametrize("tool_calls", [None, [("add", '{"a": 2, "b": 3}'), ("mul", '"2,3"')]])
def test_a_responses_stream_names_its_items_as_the_whole_response_does(
    make_proxy: Any, tool_calls: list[tuple[str, str]] | None
) -> None:
    """Stub upstream streaming text, or two tool calls: the items the openai SDK sees added have
    the ids, order and content of response.completed's output and of the record."""
    with AppThread(stub_app(tool_calls=tool_calls)) as upstream:
        proxy = make_proxy(f"{upstream.url}/v1")
        client = OpenAI(base_url=proxy.v1, api_key="s-items", max_retries=0)
        events = list(client.responses.create(model=MODEL, input="Hi", stream=True))
        [call] = proxy.calls("s-items")
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert events[-1].type == "response.completed" and call.ok and call.response is not None
    assert [e.item.id for e in events if e.type == "response.output_item.added"] == [item.id for item in done]
    assert [item.model_dump(exclude_none=True) for item in events[-1].response.output] == [
        item.model_dump(exclude_none=True) for item in done
    ]
    assert [item["id"] for item in call.response["output"]] == [item.id for item in done]
    assert [item.type for item in done] == (["function_call"] * 2 if tool_calls else ["message"])
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_an_upstream_that_cannot_render_is_found_out_once(make_proxy: Any, caplog: Any) -> None:
    """Stub upstream without /tokenize: a continuing call is sent as messages, answered and
    recorded, and says why it started a thread; the upstream is asked once and the log says so once."""
    with AppThread(stub_app(tokenize=False)) as server:
        _no_rendering(make_proxy(f"{server.url}/v1"), caplog)


def _no_rendering(proxy: Any, caplog: Any) -> None:
    messages: list[dict[str, Any]] = list(CHAT)
    with caplog.at_level(logging.WARNING, logger="rl_proxy.threads"):
        for _ in range(3):
            answer = httpx.post(
                f"{proxy.v1}/chat/completions",
                json={"model": MODEL, "messages": messages},
                headers={"x-api-key": "s-norender"},
            )
            assert answer.status_code == 200
            messages += [answer.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
    first, *rest = proxy.calls("s-norender")
    assert first.thread_start == "first call of the session seen by this proxy"
    assert [c.thread_start for c in rest] == [NO_RENDERING] * 2 and not any(c.token_in for c in rest)
    assert len([r for r in caplog.records if "no /tokenize" in r.getMessage()]) == 1


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_previous_response_id_with_a_nul_is_a_400_on_either_store(
    make_proxy: Any, request: pytest.FixtureRequest, kind: str
) -> None:
    """PostgreSQL's text refuses NUL even in a query's parameter: found by `make soak`'s long fuzz,
    such an id was looked up, and the refusal answered 503 "the store is unavailable"."""
    db = new_database(request.getfixturevalue("postgres")) if kind == "postgresql" else None
    with AppThread(stub_app()) as stub:
        proxy = make_proxy(f"{stub.url}/v1", db=db)
        body = {"model": MODEL, "input": "Hi", "previous_response_id": "resp_\x00"}
        resp = httpx.post(f"{proxy.v1}/responses", json=body, headers={"x-api-key": "s-nul"})
        assert_openai_error(resp, 400, "previous_response_id")
        assert httpx.post(f"{proxy.v1}/responses", json={"model": MODEL, "input": "Hi"}).status_code == 200
