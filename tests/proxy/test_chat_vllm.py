"""Chat Completions and Completions through the proxy, against the real vLLM CPU server,
driven by the real openai SDK; the database is read back and compared token by token."""

from __future__ import annotations

import asyncio
import json
from array import array
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError, OpenAI

from benchmarks.support.samples import ADD_TOOL, FORCE_ADD
from benchmarks.support.stack import RunningProxy, Upstream, direct_chat
from proxy.capture import parse_answer, parse_rendering

pytestmark = pytest.mark.vllm

ASK = [{"role": "user", "content": "Name three colours."}]
TOKENS = {"return_token_ids": True}


def test_recorded_tokens_equal_what_vllm_returned(proxy: RunningProxy, vllm: Upstream) -> None:
    client = OpenAI(base_url=proxy.v1, api_key="s-exact")
    resp = client.chat.completions.create(
        model=vllm.model,
        messages=ASK,
        max_tokens=16,
        logprobs=True,
        extra_body=TOKENS,  # type: ignore[arg-type]
    )
    raw = resp.model_dump()
    [call] = proxy.calls("s-exact")
    [completion] = call.completions
    assert call.ok and call.api == "chat.completions" and call.seq == 1
    assert call.prompt_token_ids == raw["prompt_token_ids"] and len(call.prompt_token_ids) > 5
    assert completion.token_ids == raw["choices"][0]["token_ids"]
    sent = [t["logprob"] for t in raw["choices"][0]["logprobs"]["content"]]
    assert len(completion.logprobs) == len(completion.token_ids) == len(sent)
    assert completion.logprobs == pytest.approx(sent, abs=1e-6)
    assert completion.finish_reason == raw["choices"][0]["finish_reason"]
    assert call.request["messages"] == ASK
    assert call.response is not None and call.response["id"] == raw["id"]


def test_vllm_writes_prompt_ids_as_the_proxy_reads_them_without_an_int_each(vllm: Upstream) -> None:
    """parse_answer reads an answer's prompt ids from its bytes (proxy/capture.py) only as vLLM
    writes them; another form is parsed as plain JSON, correct but an int at a time (several ms a
    long agent call). So a vLLM that writes them otherwise fails here, whole and streamed."""
    body = {"model": vllm.model, "messages": ASK, "max_tokens": 4, "return_token_ids": True, "logprobs": True}
    whole = httpx.post(f"{vllm.url}/chat/completions", json=body, timeout=120).content
    with httpx.stream("POST", f"{vllm.url}/chat/completions", json=body | {"stream": True}, timeout=120) as resp:
        first = next(line for line in resp.iter_lines() if line.startswith("data:"))
    for raw in (whole, first.removeprefix("data:").strip().encode()):
        ids = parse_answer(raw)["prompt_token_ids"]
        assert isinstance(ids, array) and ids.tolist() == json.loads(raw)["prompt_token_ids"], raw[:200]
    # and /tokenize's answer, which token-in reads where vLLM has not rl-proxy's plugin
    root = vllm.url.removesuffix("/v1")
    rendered = httpx.post(f"{root}/tokenize", json={"model": vllm.model, "messages": ASK}, timeout=120).content
    tokens = parse_rendering(rendered)["tokens"]
    assert isinstance(tokens, array) and tokens.tolist() == json.loads(rendered)["tokens"], rendered[:200]


def test_client_that_asks_nothing_sees_plain_vllm_answer(proxy: RunningProxy, vllm: Upstream) -> None:
    client = OpenAI(base_url=proxy.v1, api_key="s-plain")
    resp = client.chat.completions.create(model=vllm.model, messages=ASK, max_tokens=12, temperature=0)
    raw = resp.model_dump()
    assert raw["choices"][0]["logprobs"] is None
    assert raw.get("prompt_token_ids") is None and raw["choices"][0].get("token_ids") is None
    [call] = proxy.calls("s-plain")
    reference = direct_chat(vllm, messages=ASK, max_tokens=12, temperature=0)
    assert call.prompt_token_ids == reference["prompt_token_ids"]
    assert call.completions[0].token_ids == reference["choices"][0]["token_ids"]
    assert len(call.completions[0].logprobs) == len(call.completions[0].token_ids) == 12


def test_streaming_is_relayed_and_every_token_recorded(proxy: RunningProxy, vllm: Upstream) -> None:
    client = OpenAI(base_url=proxy.v1, api_key="s-stream")
    chunks = list(
        client.chat.completions.create(model=vllm.model, messages=ASK, max_tokens=20, temperature=0, stream=True)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) >= 20  # one chunk per token, not one buffered answer
    [call] = proxy.calls("s-stream")
    reference = direct_chat(vllm, messages=ASK, max_tokens=20, temperature=0)
    assert call.stream and call.ok
    assert call.prompt_token_ids == reference["prompt_token_ids"]
    assert call.completions[0].token_ids == reference["choices"][0]["token_ids"]
    assert len(call.completions[0].logprobs) == 20
    assert call.response is not None
    assert call.response["choices"][0]["message"]["content"] == text == reference["choices"][0]["message"]["content"]


def test_stream_with_token_fields_passes_them_through(proxy: RunningProxy, vllm: Upstream) -> None:
    client = OpenAI(base_url=proxy.v1, api_key="s-stream-tok")
    ids: list[int] = []
    prompt: list[int] = []
    for chunk in client.chat.completions.create(  # greedy: sampled, the model once ended its turn at 5 tokens
        model=vllm.model, messages=ASK, max_tokens=8, stream=True, logprobs=True, extra_body=TOKENS, temperature=0
    ):
        extra = chunk.model_dump()
        prompt = prompt or extra.get("prompt_token_ids") or []
        for choice in extra["choices"]:
            ids += choice.get("token_ids") or []
    [call] = proxy.calls("s-stream-tok")
    assert call.completions[0].token_ids == ids and (len(ids) == 8 or ids[-1] == 2)  # 2: SmolLM2's end of turn
    assert call.prompt_token_ids == prompt


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_recorded(proxy: RunningProxy, vllm: Upstream, stream: bool) -> None:
    key = f"s-tools-{stream}"
    client = OpenAI(base_url=proxy.v1, api_key=key)
    messages = [{"role": "user", "content": "Use the add tool to add 2 and 3."}]
    kwargs = dict(
        model=vllm.model, messages=messages, tools=[ADD_TOOL], tool_choice=FORCE_ADD, max_tokens=80, temperature=0
    )
    if stream:
        names = [
            tc.function.name
            for chunk in client.chat.completions.create(**kwargs, stream=True)  # type: ignore[call-overload]
            for tc in (chunk.choices[0].delta.tool_calls or [] if chunk.choices else [])
            if tc.function and tc.function.name
        ]
    else:
        reply = client.chat.completions.create(**kwargs).choices[0].message  # type: ignore[call-overload]
        names = [tc.function.name for tc in reply.tool_calls or []]
    assert names == ["add"]
    [call] = proxy.calls(key)
    assert call.request["tools"] == [ADD_TOOL]
    assert call.response is not None
    recorded = call.response["choices"][0]["message"]["tool_calls"]
    assert [t["function"]["name"] for t in recorded] == ["add"]
    reference = direct_chat(
        vllm, messages=messages, tools=[ADD_TOOL], tool_choice=FORCE_ADD, max_tokens=80, temperature=0
    )
    assert call.completions[0].token_ids == reference["choices"][0]["token_ids"]
    assert (
        recorded[0]["function"]["arguments"]
        == reference["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    )


def test_text_completions_recorded(proxy: RunningProxy, vllm: Upstream) -> None:
    client = OpenAI(base_url=proxy.v1, api_key="s-text")
    resp = client.completions.create(model=vllm.model, prompt="1, 2, 3,", max_tokens=6, temperature=0)
    assert resp.choices[0].logprobs is None
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=vllm.model, prompt="1, 2, 3,", max_tokens=6, temperature=0, stream=True
        )
    )
    assert streamed == resp.choices[0].text
    first, second = proxy.calls("s-text")
    assert first.api == second.api == "completions"
    assert first.prompt_token_ids == second.prompt_token_ids and len(first.prompt_token_ids) >= 5
    assert first.completions[0].token_ids == second.completions[0].token_ids
    assert len(first.completions[0].logprobs) == len(first.completions[0].token_ids) == 6
    assert second.response is not None and second.response["choices"][0]["text"] == streamed


def test_text_completions_of_a_batch_or_with_echo_are_refused_and_streams_stay_streams(
    proxy: RunningProxy, vllm: Upstream
) -> None:
    """A list of prompts and `echo` are refused with 400 before anything goes upstream (one
    record holds one prompt's ids; echo put null prompt logprobs first). A prompt given as token
    ids is one prompt. None of this switches streaming off for anyone."""
    client = OpenAI(base_url=proxy.v1, api_key="s-batch", max_retries=0)
    for refused, param in (({"prompt": ["1, 2,", "a, b,"]}, "prompt"), ({"prompt": "1, 2,", "echo": True}, "echo")):
        for stream in (False, True):
            with pytest.raises(BadRequestError) as caught:
                client.completions.create(model=vllm.model, max_tokens=4, stream=stream, **refused)  # type: ignore[call-overload]
            assert caught.value.status_code == 400 and caught.value.body["param"] == param  # type: ignore[index]
    for field, value in (("echo", True), ("include_reasoning", False)):  # vLLM streams these without ids
        chat = {"model": vllm.model, "messages": ASK, field: value}
        refused = httpx.post(f"{proxy.v1}/chat/completions", json=chat, headers={"x-api-key": "s-batch"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field
    ids = client.completions.create(model=vllm.model, prompt=[16, 28, 216], max_tokens=4, temperature=0)
    assert ids.choices[0].text
    chunks = list(client.completions.create(model=vllm.model, prompt="1, 2, 3,", max_tokens=6, stream=True))
    assert len(chunks) > 2 and httpx.get(f"{proxy.url}/healthz").json()["stream_gap"] is None
    [by_ids, streamed] = proxy.calls("s-batch")
    assert by_ids.prompt_token_ids == [16, 28, 216] and by_ids.ok and streamed.ok


def test_models_lists_the_served_model(proxy: RunningProxy, vllm: Upstream) -> None:
    models = OpenAI(base_url=proxy.v1, api_key="x").models.list()
    assert [m.id for m in models.data] == [vllm.model]


def test_sessions_told_apart_by_key_header_and_path(proxy: RunningProxy, vllm: Upstream) -> None:
    body = {"model": vllm.model, "messages": ASK, "max_tokens": 2}
    OpenAI(base_url=proxy.v1, api_key="run=r1,task=t1,group=g1,id=by-key,seed=7").chat.completions.create(**body)  # type: ignore[call-overload]
    OpenAI(base_url=proxy.v1, api_key="ignored", default_headers={"X-Session-Id": "by-header"}).chat.completions.create(
        **body
    )  # type: ignore[call-overload]
    OpenAI(base_url=f"{proxy.url}/s/by-path/v1", api_key="ignored").chat.completions.create(**body)  # type: ignore[call-overload]
    httpx.post(
        f"{proxy.v1}/chat/completions", json=body, headers={"x-api-key": "by-x-api-key"}, timeout=60
    ).raise_for_status()
    sessions = {s.id: s for s in proxy.sessions()}
    assert set(sessions) == {"by-key", "by-header", "by-path", "by-x-api-key"}
    assert all(s.calls == 1 for s in sessions.values())
    labelled = sessions["by-key"]
    assert (labelled.run, labelled.task_id, labelled.group_id) == ("r1", "t1", "g1")
    assert labelled.metadata == {"seed": "7"}


def test_policy_version_stamped(proxy: RunningProxy, vllm: Upstream) -> None:
    version = httpx.get(f"{vllm.url.removesuffix('/v1')}/weight_info").json()["weight_version"]
    OpenAI(base_url=proxy.v1, api_key="s-version").chat.completions.create(model=vllm.model, messages=ASK, max_tokens=2)
    [call] = proxy.calls("s-version")
    assert call.policy_version == call.policy_version_end == str(version)


def test_fifty_concurrent_sessions_lose_nothing(proxy: RunningProxy, vllm: Upstream) -> None:
    """50 sessions, two turns each, all at once: every call recorded, in its own session."""

    async def session(i: int) -> list[str]:
        client = AsyncOpenAI(base_url=proxy.v1, api_key=f"run=load,id=load-{i}")
        messages: list[dict] = [{"role": "user", "content": f"Agent {i}: say hello."}]
        answers = []
        for turn in range(2):
            stream = turn == 1
            if stream:
                chunks = await client.chat.completions.create(
                    model=vllm.model,
                    messages=messages,
                    max_tokens=4,
                    stream=True,  # type: ignore[arg-type]
                )
                text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
            else:
                resp = await client.chat.completions.create(model=vllm.model, messages=messages, max_tokens=4)  # type: ignore[arg-type]
                text = resp.choices[0].message.content or ""
            answers.append(text)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Agent {i} again."}]
        await client.close()
        return answers

    async def main() -> list[list[str]]:
        return await asyncio.gather(*(session(i) for i in range(50)))

    answers = asyncio.run(main())
    calls = proxy.calls()
    assert len(calls) == 100 and all(c.ok for c in calls)
    by_session: dict[str, list] = {}
    for c in calls:
        by_session.setdefault(c.session_id, []).append(c)
    assert len(by_session) == 50
    for i in range(50):
        first, second = sorted(by_session[f"load-{i}"], key=lambda c: c.seq)
        assert (first.seq, second.seq) == (1, 2)
        assert json.dumps(first.request["messages"]).count(f"Agent {i}:") == 1
        assert second.request["messages"][1]["content"] == answers[i][0]
        assert second.response is not None
        assert second.response["choices"][0]["message"]["content"] == answers[i][1]
        # turn 2's prompt extends turn 1's prompt and completion (token-level append)
        assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids


def test_harness_model_names_and_limits_fitted_and_recorded(make_proxy: Any, vllm: Upstream) -> None:
    """A harness asks for its own model name and an impossible length (Claude Code: 32000; Codex:
    none): the call goes to the policy model with a capped limit, and each rewrite is recorded."""
    proxy = make_proxy(vllm.url, max_completion_tokens=8, model_aliases={"judge-model": vllm.model})
    client = OpenAI(base_url=proxy.v1, api_key="s-fit")
    reply = client.chat.completions.create(model="claude-sonnet-4-5", messages=ASK, max_tokens=32000)
    assert reply.usage is not None and reply.usage.completion_tokens <= 8
    client.chat.completions.create(model="judge-model", messages=ASK)  # no limit at all
    client.chat.completions.create(model=vllm.model, messages=ASK, max_tokens=4)  # nothing to change
    first, second, third = proxy.calls("s-fit")
    assert first.rewrites == {"model": ["claude-sonnet-4-5", vllm.model], "max_tokens": [32000, 8]}
    assert first.request["model"] == "claude-sonnet-4-5"  # the request as the client sent it
    assert second.rewrites == {"model": ["judge-model", vllm.model], "max_tokens": [None, 8]}
    assert third.rewrites == {} and len(third.completions[0].token_ids) <= 4


def test_a_limit_longer_than_the_context_is_fitted_to_it(make_proxy: Any, vllm: Upstream) -> None:
    proxy = make_proxy(vllm.url, max_completion_tokens=None)
    client = OpenAI(base_url=proxy.v1, api_key="s-context")
    # Ended at its first full stop: the answer's length is not what is tested (it took 19 s).
    client.chat.completions.create(model=vllm.model, messages=ASK, max_tokens=100_000, temperature=0, stop=["."])
    [call] = proxy.calls("s-context")
    assert call.ok and call.rewrites == {"max_tokens": [100_000, vllm.max_model_len]}


def test_n_choices_recorded_each_and_n_over_the_limit_refused(make_proxy: Any, vllm: Upstream) -> None:
    """n samples of one prompt (a GRPO group in one call) are each recorded token by token; an n
    past RLP_MAX_CHOICES, which bounds a call's recorded size, is a 400 and reaches nobody."""
    proxy = make_proxy(vllm.url, max_choices=3)
    client = OpenAI(base_url=proxy.v1, api_key="s-n", max_retries=0)
    reply = client.chat.completions.create(model=vllm.model, messages=ASK, max_tokens=6, n=3, temperature=1.0)
    for n in (4, 0, "2"):
        resp = httpx.post(
            f"{proxy.v1}/chat/completions",
            headers={"Authorization": "Bearer s-n"},
            json={"model": vllm.model, "messages": ASK, "n": n},
        )
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "n", resp.text
    [call] = proxy.calls("s-n")
    assert call.ok and [c.index for c in call.completions] == [0, 1, 2]
    assert [c["message"]["content"] for c in call.response["choices"]] == [c.message.content for c in reply.choices]
    assert all(0 < len(c.token_ids) == len(c.logprobs) <= 6 for c in call.completions)


def test_a_session_created_with_sampling_settings_is_sampled_so_whatever_the_harness_asks(
    proxy: RunningProxy, vllm: Upstream
) -> None:
    """The admin API's `sampling` (how the trainer evaluates greedy through an unchanged harness):
    a harness asking for temperature 1.5 gets vLLM's greedy answer, every time, and the record
    keeps its request with the change beside it. Settings the proxy does not set are refused."""
    created = httpx.post(f"{proxy.url}/admin/sessions", json={"sampling": {"temperature": 0, "seed": 3}})
    key = created.json()["key"]
    client = OpenAI(base_url=proxy.v1, api_key=key, max_retries=0)
    answers = [
        client.chat.completions.create(model=vllm.model, messages=ASK, max_tokens=16, temperature=1.5) for _ in range(2)
    ]
    greedy = direct_chat(vllm, messages=ASK, max_tokens=16, temperature=0)
    assert [a.choices[0].message.content for a in answers] == [greedy["choices"][0]["message"]["content"]] * 2
    for call in proxy.calls(created.json()["id"]):
        assert call.request["temperature"] == 1.5 and call.rewrites["temperature"] == [1.5, 0.0]
        assert call.rewrites["seed"] == [None, 3]
    refused = httpx.post(f"{proxy.url}/admin/sessions", json={"sampling": {"min_tokens": 5}})
    assert refused.status_code == 400 and "min_tokens" in refused.text


def test_a_session_can_force_tool_calls_on_the_calls_that_offer_tools(proxy: RunningProxy, vllm: Upstream) -> None:
    """`sampling.tool_choice: required` (a small model through Claude Code or Codex): a call that
    offers tools calls one; a call without tools is sent as asked (vLLM refuses `required` there)."""
    created = httpx.post(f"{proxy.url}/admin/sessions", json={"sampling": {"tool_choice": "required"}}).json()
    client = OpenAI(base_url=proxy.v1, api_key=created["key"], max_retries=0)
    ask = [{"role": "user", "content": "Hello."}]
    called = client.chat.completions.create(
        model=vllm.model,
        messages=ask,
        tools=[ADD_TOOL],
        max_tokens=60,  # type: ignore[arg-type,list-item]
        temperature=0,
    )
    plain = client.chat.completions.create(model=vllm.model, messages=ask, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert called.choices[0].message.tool_calls and called.choices[0].message.tool_calls[0].function.name == "add"
    assert plain.choices[0].message.content
    with_tools, without = proxy.calls(created["id"])
    assert with_tools.rewrites["tool_choice"] == [None, "required"] and "tool_choice" not in without.rewrites
    refused = httpx.post(f"{proxy.url}/admin/sessions", json={"sampling": {"tool_choice": "two words"}})
    assert refused.status_code == 400 and "tool_choice" in refused.text


def test_a_session_can_force_one_named_tool_on_the_calls_that_offer_it(proxy: RunningProxy, vllm: Upstream) -> None:
    """`sampling.tool_choice: NAME` (Claude Code's Agent tool, to start a subagent): a call that
    offers that tool calls it; a call offering other tools only (the subagent's) is sent as asked."""
    created = httpx.post(f"{proxy.url}/admin/sessions", json={"sampling": {"tool_choice": "add"}}).json()
    client = OpenAI(base_url=proxy.v1, api_key=created["key"], max_retries=0)
    other = {"type": "function", "function": {"name": "echo", "parameters": {"type": "object", "properties": {}}}}
    ask = [{"role": "user", "content": "Say hello."}]
    for tools in ([other, ADD_TOOL], [other]):
        client.chat.completions.create(model=vllm.model, messages=ask, tools=tools, max_tokens=120, temperature=0)  # type: ignore[arg-type]
    offered, not_offered = proxy.calls(created["id"])
    assert offered.rewrites["tool_choice"] == [None, {"type": "function", "function": {"name": "add"}}]
    assert offered.rewrites["strict"] == [None, "add"] and "strict" not in str(offered.request)  # the client's as sent
    assert [c["function"]["name"] for c in offered.response["choices"][0]["message"]["tool_calls"]] == ["add"]  # type: ignore[index]
    assert "tool_choice" not in not_offered.rewrites
