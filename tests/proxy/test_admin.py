"""The admin API, /healthz and /metrics, with a stub upstream (NOT vLLM) behind the proxy,
since none of this depends on the model; the vLLM path of a created key is in test_chat_vllm."""

from __future__ import annotations

from typing import Any

import httpx

from tests.support.stub_upstream import MODEL


def test_admin_open_on_loopback_without_token(make_proxy: Any, stub: str) -> None:
    proxy = make_proxy(stub)
    created = httpx.post(f"{proxy.url}/admin/sessions", json={"run": "r1", "task_id": "t1", "group_id": "g1",
                                                             "metadata": {"seed": 3}})  # fmt: skip
    assert created.status_code == 201
    session = created.json()
    assert session["key"].startswith("rlp-") and len(session["key"]) > 30
    assert session["base_url"] == f"{proxy.url}/v1"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(2):
        r = httpx.post(f"{session['base_url']}/chat/completions", json=chat, headers={"x-api-key": session["key"]})
        assert r.status_code == 200
    sid = session["id"]
    assert httpx.post(f"{proxy.url}/admin/sessions/{sid}/reward", json={"value": 0.25}).json()["reward"] == 0.25
    after = httpx.post(f"{proxy.url}/admin/sessions/{sid}/reward", json={"value": 0.5, "source": "verifier"}).json()
    assert after["reward"] == 0.75 and after["calls"] == 2
    per_call = httpx.post(f"{proxy.url}/admin/sessions/{sid}/reward", json={"value": 2.0, "seq": 2}).json()
    assert per_call["reward"] == 0.75  # a call's reward is not the session's
    ended = httpx.post(f"{proxy.url}/admin/sessions/{sid}/end").json()
    assert ended["status"] == "ended" and ended["ended_at"]
    listed = httpx.get(f"{proxy.url}/admin/sessions", params={"run": "r1"}).json()["data"]
    assert [s["id"] for s in listed] == [sid]
    assert listed[0]["metadata"] == {"seed": 3} and "key" not in listed[0]
    assert httpx.get(f"{proxy.url}/admin/sessions/nope").status_code == 404
    bad = httpx.post(f"{proxy.url}/admin/sessions/{sid}/reward", json={"value": "high"})
    assert bad.status_code == 400 and "value" in bad.json()["error"]["message"]
    dup = httpx.post(f"{proxy.url}/admin/sessions", json={"id": sid})
    assert dup.status_code == 409


def test_admin_needs_the_token_when_one_is_set(make_proxy: Any, stub: str) -> None:
    proxy = make_proxy(stub, admin_token="s3cret")
    assert httpx.get(f"{proxy.url}/admin/sessions").status_code == 401
    wrong = httpx.get(f"{proxy.url}/admin/sessions", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    right = httpx.get(f"{proxy.url}/admin/sessions", headers={"Authorization": "Bearer s3cret"})
    assert right.status_code == 200


def test_healthz_and_metrics(make_proxy: Any, stub: str) -> None:
    proxy = make_proxy(stub)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    httpx.post(f"{proxy.v1}/chat/completions", json=chat).raise_for_status()
    httpx.post(f"{proxy.v1}/chat/completions", json={**chat, "stream": True}).raise_for_status()
    health = httpx.get(f"{proxy.url}/healthz").json()
    assert health["status"] == "ok" and health["upstream"] == stub
    text = httpx.get(f"{proxy.url}/metrics").text
    assert 'rlp_calls_total{api="chat.completions",status="ok"} 2.0' in text
    assert 'rlp_tokens_total{kind="completion"} 16.0' in text
    assert "rlp_call_latency_seconds_bucket" in text
