"""Upstreams other than vLLM (a provider, a litellm proxy), for distillation data: the proxy
sends them their own key, asks for no token ids, and records the calls as text, which
trajectories skip by name. The upstream here is a STUB acting as such a provider."""

from __future__ import annotations

from typing import Any

import httpx
from openai import OpenAI

from benchmarks.support.stub_upstream import MODEL, stub_app
from proxy.server import AppThread
from recorder.graph import build_sequences

ASK = [{"role": "user", "content": "Hi"}]


def test_a_provider_upstream_is_recorded_as_text(make_proxy: Any) -> None:
    with AppThread(stub_app(provider_key="sk-provider")) as provider:
        plain = make_proxy(f"{provider.url}/v1")
        refused = httpx.post(f"{plain.v1}/chat/completions", json={"model": MODEL, "messages": ASK})
        assert refused.status_code == 401  # the session's key is not the provider's, and is not sent
        proxy = make_proxy(f"{provider.url}/v1", upstream_token_ids=False, upstream_api_key="sk-provider")
        client = OpenAI(base_url=proxy.v1, api_key="distill-1", max_retries=0)
        whole = client.chat.completions.create(model=MODEL, messages=ASK)
        chunks = client.chat.completions.create(model=MODEL, messages=ASK, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        message = httpx.post(
            f"{proxy.v1}/messages",
            json={"model": MODEL, "messages": ASK, "max_tokens": 8},
            headers={"x-api-key": "distill-1"},
        ).json()
    assert whole.choices[0].message.content == "stub answer" and streamed.startswith("t101 t102")
    assert message["content"][0]["text"] == "stub answer"
    calls = proxy.calls("distill-1")
    assert [c.ok for c in calls] == [True, True, True] and all(not c.prompt_token_ids for c in calls)
    assert calls[0].response is not None and calls[0].response["choices"][0]["message"]["content"] == "stub answer"
    report = build_sequences(calls)
    assert (
        not report.sequences
        and [reason for _, reason in report.skipped]
        == ["no token ids recorded (an upstream that does not return them?)"] * 3
    )
