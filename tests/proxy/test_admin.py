"""The admin API, /healthz and /metrics, with a stub upstream (NOT vLLM) behind the proxy,
since none of this depends on the model; the vLLM path of a created key is in test_chat_vllm."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import httpx

from benchmarks.support.stub_upstream import MODEL


def test_admin_open_on_loopback_without_token(make_proxy: Any, stub: str) -> None:
    proxy = make_proxy(stub)
    created = httpx.post(
        f"{proxy.url}/admin/sessions", json={"run": "r1", "task_id": "t1", "group_id": "g1", "metadata": {"seed": 3}}
    )
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
    # sampling integers the store's JSON cannot hold (past 64 bits) are the client's error (the fuzz found a 503)
    for sampling in ({"seed": 2**64}, {"top_k": 2**64}):
        huge = httpx.post(f"{proxy.url}/admin/sessions", json={"sampling": sampling})
        assert huge.status_code == 400 and next(iter(sampling)) in huge.json()["error"]["message"], huge.text


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


def test_open_admin_still_needs_the_token_for_forwarded_requests(make_proxy: Any, stub: str) -> None:
    """A reverse proxy on this machine makes every request a loopback one: a request it forwarded
    (or any request carrying forwarding headers, or addressed to a name that is not loopback, as
    a page that rebinds its name to 127.0.0.1 would) needs the token like one from outside."""
    proxy = make_proxy(stub)
    assert httpx.get(f"{proxy.url}/admin/sessions").status_code == 200
    assert httpx.get(f"{proxy.url.replace('127.0.0.1', 'localhost')}/admin/sessions").status_code == 200
    for header in (
        {"X-Forwarded-For": "203.0.113.7"},
        {"Forwarded": "for=203.0.113.7"},
        {"X-Real-IP": "203.0.113.7"},
        {"Via": "1.1 nginx"},
    ):
        refused = httpx.get(f"{proxy.url}/admin/sessions", headers=header)
        assert refused.status_code == 401 and "admin-token" in refused.json()["error"]["message"]
    rebound = httpx.get(f"{proxy.url}/admin/sessions", headers={"Host": "rebound.example"})  # any route, on loopback
    assert rebound.status_code == 403 and "loopback name" in rebound.json()["error"]["message"]
    guarded = make_proxy(stub, admin_token="s3cret")
    forwarded = {"X-Forwarded-For": "203.0.113.7", "Authorization": "Bearer s3cret"}
    assert httpx.get(f"{guarded.url}/admin/sessions", headers=forwarded).status_code == 200


def test_a_non_ascii_admin_token_is_refused_not_a_crash(make_proxy: Any, stub: str) -> None:
    proxy = make_proxy(stub, admin_token="s3cret")
    r = httpx.get(f"{proxy.url}/admin/sessions", headers={"Authorization": "Bearer s\xe9cret".encode("latin-1")})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_an_ended_session_takes_no_more_calls(make_proxy: Any, stub: str) -> None:
    proxy = make_proxy(stub)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": "Bearer ep-9"}
    assert httpx.post(f"{proxy.v1}/chat/completions", json=chat, headers=headers).status_code == 200
    httpx.post(f"{proxy.url}/admin/sessions/ep-9/end", json={"status": "ok"}).raise_for_status()
    refused = httpx.post(f"{proxy.v1}/chat/completions", json=chat, headers=headers)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "session_ended"
    messages = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    anthropic_shape = httpx.post(f"{proxy.v1}/messages", json=messages, headers=headers)
    assert anthropic_shape.status_code == 409 and anthropic_shape.json()["type"] == "error"
    assert httpx.get(f"{proxy.url}/admin/sessions/ep-9").json()["calls"] == 1  # what was recorded stays


def test_a_session_ended_through_another_proxy_takes_no_more_calls_through_this_one(
    make_proxy: Any, stub: str, tmp_path: Path
) -> None:
    """Two proxies on one store (behind a balancer): the one that served the session still holds
    it as active in its cache after the other ended it, and the store refuses the call."""
    db = str(tmp_path / "shared.db")
    serving, ending = make_proxy(stub, db=db), make_proxy(stub, db=db)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": "Bearer ep-10"}
    assert httpx.post(f"{serving.v1}/chat/completions", json=chat, headers=headers).status_code == 200
    httpx.post(f"{ending.url}/admin/sessions/ep-10/end", json={"status": "ok"}).raise_for_status()
    for where in ("is not recorded", "has ended (ok)"):  # refused at commit, then at the look-up (read again)
        refused = httpx.post(f"{serving.v1}/chat/completions", json=chat, headers=headers)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "session_ended"
        assert where in refused.json()["error"]["message"]
    assert httpx.get(f"{ending.url}/admin/sessions/ep-10").json()["calls"] == 1
    assert httpx.get(f"{serving.url}/healthz").json()["record_failures"] == 0


def test_upstream_credentials_are_never_shown(make_proxy: Any, stub: str) -> None:
    with_credentials = stub.replace("http://", "http://user:pa55@")
    proxy = make_proxy(with_credentials)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{proxy.v1}/chat/completions", json=chat).status_code == 200
    health = httpx.get(f"{proxy.url}/healthz").text
    assert "pa55" not in health and stub in health
    down = make_proxy("http://user:pa55@127.0.0.1:9/v1")
    failed = httpx.post(f"{down.v1}/chat/completions", json=chat)
    assert failed.status_code >= 500 and "pa55" not in failed.text and "127.0.0.1:9" in failed.text
    with sqlite3.connect(proxy.db) as conn:
        assert conn.execute("select upstream from calls").fetchall() == [(stub,)]


def test_key_labels_are_the_clients_and_never_set_an_episodes_fields(make_proxy: Any, stub: str) -> None:
    """`outcome` and `sampling` in a key (or in a client's metadata) stay the client's labels: the
    proxy forces no sampling from them (a key with `sampling=hot` made every call of its session a
    500 that was never recorded) and the session has no episode outcome (a key with `outcome=1`
    stopped the trainer on its group)."""
    proxy = make_proxy(stub)
    key = "run=r,task=t,group=r/t/x,id=intruder,outcome=1,sampling=hot"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    answer = httpx.post(f"{proxy.v1}/chat/completions", json=chat, headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 200, answer.text
    [call] = proxy.calls("intruder")
    assert call.ok and "temperature" not in call.rewrites
    shown = httpx.get(f"{proxy.url}/admin/sessions/intruder").json()
    assert shown["metadata"] == {"outcome": "1", "sampling": "hot"}
    assert (shown["outcome"], shown["sampling"], shown["group_id"]) == (None, None, "r/t/x")
    sent = {"metadata": {"outcome": {"harness": "ok", "reward": 1.0}, "sampling": {"temperature": 9}}}
    created = httpx.post(f"{proxy.url}/admin/sessions", json=sent).json()
    assert created["metadata"] == sent["metadata"] and created["outcome"] is None and created["sampling"] is None


def test_an_episode_ends_with_a_typed_outcome_and_refuses_another_shape(make_proxy: Any, stub: str) -> None:
    proxy = make_proxy(stub)
    sid = httpx.post(f"{proxy.url}/admin/sessions", json={"sampling": {"temperature": 0}}).json()["id"]
    wrong = httpx.post(f"{proxy.url}/admin/sessions/{sid}/end", json={"status": "ok", "outcome": {"status": "ok"}})
    assert wrong.status_code == 400 and "harness" in wrong.json()["error"]["message"]
    odd = httpx.post(f"{proxy.url}/admin/sessions/{sid}/end", json={"status": "exploded"})
    assert odd.status_code == 400 and "status" in odd.json()["error"]["message"]
    huge = httpx.post(f"{proxy.url}/admin/sessions/{sid}/end", json={"outcome": {"harness": "ok", "exit_code": 2**64}})
    assert huge.status_code == 400 and "exit_code" in huge.json()["error"]["message"], huge.text
    outcome = {"harness": "ok", "reward": 0.5, "parts": [{"source": "python", "value": 0.5}]}
    ended = httpx.post(f"{proxy.url}/admin/sessions/{sid}/end", json={"status": "ok", "outcome": outcome}).json()
    assert ended["status"] == "ok" and ended["outcome"]["parts"] == outcome["parts"]
    assert ended["sampling"] == {"temperature": 0.0, "top_p": None, "top_k": None, "seed": None, "tool_choice": None}


def test_rewards_whose_sum_a_store_cannot_hold_are_a_400_and_the_sessions_still_list(
    make_proxy: Any, stub: str, db: str
) -> None:
    """Two rewards of 1.8e308 summed past a double's range: PostgreSQL then refused every listing
    of the sessions with "value out of range" (503), for good (`make soak`'s fuzz found it)."""
    proxy = make_proxy(stub, db=db)
    sid = httpx.post(f"{proxy.url}/admin/sessions", json={}).json()["id"]
    assert httpx.post(f"{proxy.url}/admin/sessions/{sid}/reward", json={"value": 1e15}).status_code == 200
    for value in (1.7976931348623157e308, -1e16):
        refused = httpx.post(f"{proxy.url}/admin/sessions/{sid}/reward", json={"value": value})
        assert refused.status_code == 400 and "value" in refused.json()["error"]["message"]
    assert httpx.get(f"{proxy.url}/admin/sessions/{sid}").json()["reward"] == 1e15
    assert httpx.get(f"{proxy.url}/admin/sessions").status_code == 200
