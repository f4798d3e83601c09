"""Security with a stub upstream (NOT vLLM): sessions cannot reach each other's data, and no
credential a client or the operator sends ends up in the store. vLLM's development routes are
tested against the real server in test_dev_routes.py; the admin token in test_admin.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI
from sqlalchemy import create_engine, inspect, text

from benchmarks.support.stub_upstream import MODEL, render, stub_app
from proxy.server import AppThread
from proxy.settings import Settings
from recorder.store import sync_url

HI = [{"role": "user", "content": "hi"}]


def test_a_session_cannot_read_or_write_another_sessions_data(make_proxy: Any, stub: str) -> None:
    proxy = make_proxy(stub)
    owner = httpx.post(f"{proxy.url}/admin/sessions", json={"id": "victim"}).json()
    mine = OpenAI(base_url=proxy.v1, api_key=owner["key"], max_retries=0)
    answer = mine.responses.create(model=MODEL, input="a secret plan")
    assert mine.responses.retrieve(answer.id).id == answer.id  # its own session can

    intruder = {"x-api-key": "intruder"}
    got = httpx.get(f"{proxy.v1}/responses/{answer.id}", headers=intruder)
    assert got.status_code == 404 and "a secret plan" not in got.text
    chained = httpx.post(
        f"{proxy.v1}/responses",
        headers=intruder,
        json={"model": MODEL, "input": "go on", "previous_response_id": answer.id},
    )
    assert chained.status_code == 400 and "not found" in chained.json()["error"]["message"]
    # Naming the victim's id in a key, a header or the path is a different key: refused.
    chat = {"model": MODEL, "messages": HI, "max_tokens": 4}
    for attempt in (
        httpx.post(f"{proxy.v1}/chat/completions", headers={"x-api-key": "id=victim"}, json=chat),
        httpx.post(f"{proxy.v1}/chat/completions", headers={"x-session-id": "victim"}, json=chat),
        httpx.post(f"{proxy.url}/s/victim/v1/chat/completions", json=chat),
        httpx.post(f"{proxy.url}/s/victim/v1/messages", json=chat),
    ):
        assert attempt.status_code == 403 and "Traceback" not in attempt.text
        assert "another key" in attempt.text

    def intrude(i: int) -> httpx.Response:
        return httpx.post(f"{proxy.v1}/chat/completions", json=chat, headers={"x-api-key": f"id=victim,n={i % 2}"})

    with ThreadPoolExecutor(8) as pool:  # at once, so that all race the first one's failed insert
        raced = list(pool.map(intrude, range(16)))
    assert [r.status_code for r in raced] == [403] * 16
    assert [c.seq for c in proxy.calls("victim")] == [1]  # nothing was added to it
    # Sessions only the admin API creates: an unknown key is refused outright.
    closed = make_proxy(stub, create_sessions=False)
    refused = httpx.post(f"{closed.v1}/chat/completions", headers=intruder, json={"model": MODEL, "messages": HI})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"


def test_admin_keys_are_unguessable(make_proxy: Any, stub: str) -> None:
    proxy = make_proxy(stub)
    keys = [httpx.post(f"{proxy.url}/admin/sessions", json={"id": f"s{i}"}).json()["key"] for i in range(50)]
    assert len(set(keys)) == 50
    for key in keys:  # "rlp-" and 24 random bytes (192 bits) from the secrets module
        assert key.startswith("rlp-") and len(key) == 4 + 32
    assert len({key[4:8] for key in keys}) > 40  # no shared prefix or counter


def dump(db: str) -> str:
    """Every row of every table, as text, and for SQLite the raw bytes of the files too."""
    engine = create_engine(sync_url(db))
    with engine.connect() as conn:
        rows = [repr(conn.execute(text(f"SELECT * FROM {t}")).all()) for t in inspect(conn).get_table_names()]
    engine.dispose()
    raw = b"".join(p.read_bytes() for p in Path(db).parent.glob(Path(db).name + "*")) if "://" not in db else b""
    return "\n".join(rows) + raw.decode("latin-1")


def test_credentials_in_headers_are_never_stored(make_proxy: Any, db: str) -> None:
    """The API key a harness sends (often a real provider key) and the upstream's own key: the
    store keeps neither, in SQLite (rows and raw file) and in PostgreSQL."""
    openai_key = "sk-proj-" + "A1b2C3d4" * 12
    anthropic_key = "sk-ant-api03-" + "Z9y8X7w6" * 11
    upstream_key = "sk-upstream-" + "Q5r6S7t8" * 6
    with AppThread(stub_app(provider_key=upstream_key)) as provider:
        proxy = make_proxy(f"{provider.url}/v1", db=db, upstream_token_ids=False, upstream_api_key=upstream_key)
        OpenAI(base_url=proxy.v1, api_key=openai_key, max_retries=0).chat.completions.create(model=MODEL, messages=HI)
        messages = httpx.post(
            f"{proxy.v1}/messages",
            headers={"x-api-key": anthropic_key},
            json={"model": MODEL, "messages": HI, "max_tokens": 4},
        )
        assert messages.status_code == 200
        again = httpx.post(
            f"{proxy.v1}/chat/completions",
            headers={"Authorization": f"Bearer {openai_key}"},
            json={"model": MODEL, "messages": HI},
        )
        assert again.status_code == 200
    sessions = proxy.sessions()
    assert len(sessions) == 2 and sorted(s.calls for s in sessions) == [1, 2]  # one key, one session
    stored = dump(db)
    assert "chat.completions" in stored and "anthropic.messages" in stored  # the dump does see the calls
    for secret in (openai_key, anthropic_key, upstream_key):
        assert secret not in stored and secret[-24:] not in stored


def test_an_upstreams_cookie_does_not_pass_from_one_session_to_the_next(make_proxy: Any) -> None:
    """One HTTP client carries every session's calls upstream: a cookie an upstream (or a load
    balancer before it) set on one session's answer went with the next session's calls."""
    inner = stub_app()
    cookies: list[bytes | None] = []

    async def setting_cookies(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await inner(scope, receive, send)
        cookies.append(dict(scope["headers"]).get(b"cookie"))

        async def with_cookie(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message["headers"], (b"set-cookie", b"route=victim; Path=/")]}
            await send(message)

        return await inner(scope, receive, with_cookie)

    with AppThread(setting_cookies) as upstream:  # type: ignore[arg-type]
        # By name: aiohttp's jar keeps no cookie of an IP address.
        proxy = make_proxy(f"http://localhost:{upstream.port}/v1")
        for key in ("victim", "next"):
            chat = {"model": MODEL, "messages": HI, "max_tokens": 4}
            assert httpx.post(f"{proxy.v1}/chat/completions", json=chat, headers={"x-api-key": key}).status_code == 200
    assert len(cookies) >= 2 and cookies == [None] * len(cookies)


def test_settings_default_to_loopback_and_a_body_limit() -> None:
    settings = Settings(upstream="http://127.0.0.1:1/v1")
    assert settings.host == "127.0.0.1" and settings.admin_open
    assert settings.max_body_bytes == 32 * 1024 * 1024
    assert not Settings(upstream="http://x/v1", host="0.0.0.0").admin_open


def test_web_pages_cannot_drive_a_loopback_proxy(make_proxy: Any, stub: str) -> None:
    """A "simple" cross-site request (no preflight: text/plain, no custom header) ended sessions
    through the admin API and recorded calls into any session named in the URL: the body was read
    as JSON whatever its content type."""
    proxy = make_proxy(stub)
    sid = httpx.post(f"{proxy.url}/admin/sessions", json={"id": "ep3"}).json()["id"]
    page = {"Content-Type": "text/plain", "Origin": "http://evil.example"}
    ended = httpx.post(f"{proxy.url}/admin/sessions/{sid}/end", headers=page, content=b'{"status": "ok"}')
    assert ended.status_code == 403 and "another origin" in ended.json()["error"]["message"]
    same_host_other_port = {"Origin": "http://127.0.0.1:1", "Sec-Fetch-Site": "same-site"}
    assert httpx.post(f"{proxy.url}/admin/sessions/{sid}/end", headers=same_host_other_port).status_code == 403
    assert (
        httpx.post(f"{proxy.url}/admin/sessions/{sid}/end", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
    )
    form = httpx.post(f"{proxy.url}/admin/sessions", headers={"Content-Type": "text/plain"}, content=b'{"id": "x"}')
    assert form.status_code == 415
    assert httpx.get(f"{proxy.url}/admin/sessions/{sid}").json()["status"] == "active"
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]}' % MODEL.encode()
    for route, shape in (("chat/completions", "error"), ("messages", "type")):
        sent = httpx.post(f"{proxy.url}/s/victim/v1/{route}", headers={"Content-Type": "text/plain"}, content=body)
        assert sent.status_code == 415 and shape in sent.json(), sent.text
        assert "Content-Type: application/json" in sent.text
    bare = httpx.post(f"{proxy.url}/s/victim/v1/chat/completions", content=body)  # a blob: no content type
    assert bare.status_code == 415 and proxy.calls() == []
    # What every SDK sends still goes through, and so does an admin request from the proxy's own origin.
    assert (
        httpx.post(
            f"{proxy.url}/s/victim/v1/chat/completions",
            content=body,
            headers={"Content-Type": "application/json; charset=utf-8"},
        ).status_code
        == 200
    )
    own = {"Origin": proxy.url, "Sec-Fetch-Site": "same-origin"}
    assert httpx.post(f"{proxy.url}/admin/sessions/{sid}/end", headers=own).json()["status"] == "ended"


def test_a_loopback_proxy_answers_only_requests_addressed_to_a_loopback_name(make_proxy: Any, stub: str) -> None:
    """DNS rebinding: a web page whose name resolves to 127.0.0.1 sends JSON to the model routes
    (a preflight it passes with its own origin); its requests carry its own name as Host. They
    were answered and recorded; now refused, in each API's error shape."""
    proxy = make_proxy(stub)
    chat = {"model": MODEL, "messages": HI, "max_tokens": 4}
    rebound = {"Host": "evil.example:80", "x-api-key": "rebound"}
    sent = httpx.post(f"{proxy.v1}/chat/completions", json=chat, headers=rebound)
    assert sent.status_code == 403 and "loopback name" in sent.json()["error"]["message"], sent.text
    messages = httpx.post(f"{proxy.v1}/messages", json=chat, headers=rebound)
    assert messages.status_code == 403 and messages.json()["type"] == "error", messages.text
    assert proxy.calls("rebound") == []
    for own in ("localhost", "127.0.0.1", "[::1]"):
        answered = httpx.post(f"{proxy.v1}/chat/completions", json=chat, headers={"Host": own, "x-api-key": "own"})
        assert answered.status_code == 200, (own, answered.text)


def test_a_nul_in_the_url_is_refused_in_each_apis_shape(make_proxy: Any, stub: str) -> None:
    """Ids, keys and labels from the URL reach text columns, which PostgreSQL keeps free of NUL."""
    proxy = make_proxy(stub)
    chat = {"model": MODEL, "messages": HI, "max_tokens": 4}
    sent = httpx.post(f"{proxy.url}/s/a%00b/v1/chat/completions", json=chat)
    assert sent.status_code == 400 and "NUL" in sent.json()["error"]["message"], sent.text
    messages = httpx.post(f"{proxy.url}/s/a%00b/v1/messages", json=chat)
    assert messages.status_code == 400 and messages.json()["type"] == "error", messages.text
    assert httpx.get(f"{proxy.url}/admin/sessions?run=%00").status_code == 400
    assert proxy.calls() == []


def test_a_client_cannot_hand_the_upstream_a_prompt_of_its_own(make_proxy: Any, stub: str) -> None:
    """`kv_transfer_params` is how the proxy gives vLLM token-in's prompt (proxy/threads.py): one a
    client sent would make the recorded prompt tokens other than its messages', so it is dropped."""
    proxy = make_proxy(stub)
    forged = {"prompt_token_ids": [7, 7, 7], "rl_proxy_thread": {"prefix": [7], "eot": 2, "n": 0}}
    body = {"model": MODEL, "messages": HI, "kv_transfer_params": forged}
    httpx.post(f"{proxy.v1}/chat/completions", json=body, headers={"x-api-key": "forger"}).raise_for_status()
    [call] = proxy.calls("forger")
    assert call.prompt_token_ids == render(HI)
    assert call.rewrites["kv_transfer_params"] == ["dropped", None]
