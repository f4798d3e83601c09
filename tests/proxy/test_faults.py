"""Faults the recording must survive: the proxy killed with SIGKILL under load; a store that is
locked by another writer, held open by a long reader, on a disk that fills up, or (PostgreSQL)
crashed and restarted; slow clients. The upstream is the stub (NOT vLLM): these tests are
about the proxy and the store, and a fixed, fast upstream makes the load heavy.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from openai import APIConnectionError, APIStatusError, OpenAI

from benchmarks.support.postgres import temp_postgres
from benchmarks.support.stack import new_database, read_store
from benchmarks.support.stub_upstream import COMPLETION, MODEL, stub_app
from proxy.app import create_app
from proxy.server import AppThread
from proxy.settings import Settings
from proxy.vllm import free_port
from recorder import Store


def start_proxy(upstream: str, db: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    """`rl-proxy serve` as its own process, so that it can be killed for real."""
    cmd = [sys.executable, "-m", "proxy.cli", "serve", "--upstream", upstream, "--db", db, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180  # 2 s here when idle; CI's niced worker once took over 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the proxy did not start: {log.read_text()[-2000:]}")


def converse(
    base_url: str, session: str, answered: list[tuple[str, int, str]], stopped: list[str], stop: threading.Event
) -> None:
    """Multi-turn calls until the proxy goes away; each answer is noted as (session, turn, id),
    and why the client stopped in `stopped`."""
    client = OpenAI(base_url=base_url, api_key=session, max_retries=0, timeout=120)
    messages: list[Any] = [{"role": "user", "content": f"{session}: start"}]
    turn = 0
    while not stop.is_set():
        try:
            reply = client.chat.completions.create(model=MODEL, messages=messages)
        except (APIConnectionError, APIStatusError) as exc:
            stopped.append(f"{session}: {exc!r}")
            return
        turn += 1
        answered.append((session, turn, reply.id))
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": f"turn {turn}"},
        ]


@pytest.mark.timeout(600)
def test_sigkill_under_load_loses_no_answered_call_and_sessions_go_on(db: str, tmp_path: Path) -> None:
    with AppThread(stub_app(latency=0.02)) as stub:
        port, log = free_port(), tmp_path / "proxy.log"
        proc = start_proxy(f"{stub.url}/v1", db, port, log)
        answered: list[tuple[str, int, str]] = []
        stopped: list[str] = []
        stop = threading.Event()
        sessions = [f"kill-{i}" for i in range(16)]
        url = f"http://127.0.0.1:{port}/v1"
        clients = [threading.Thread(target=converse, args=(url, s, answered, stopped, stop)) for s in sessions]
        for client in clients:
            client.start()
        while len(answered) < 150 and proc.poll() is None and any(c.is_alive() for c in clients):
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # mid-run: 16 calls in flight
        proc.wait()
        stop.set()
        for client in clients:
            client.join(20)
        killed_at = len(answered)
        assert killed_at >= 150, (stopped[:3], log.read_text()[-3000:])  # why the clients stopped early

        proc = start_proxy(f"{stub.url}/v1", db, port, log)  # restarted on the same store
        try:
            after = {
                s: OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=s, max_retries=0)
                .chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "again"}])
                .id
                for s in sessions
            }
        finally:
            proc.terminate()
            proc.wait(30)

    calls = read_store(db, lambda s: _all_calls(s))
    by_id = {c.response["id"]: c for c in calls if c.response}
    for session, turn, reply_id in answered:  # every answered call is there, whole
        call = by_id[reply_id]
        assert (call.session_id, call.seq, call.ok) == (session, turn, True)
        assert call.completions[0].token_ids == COMPLETION and len(call.completions[0].logprobs) == 8
        assert call.prompt_token_ids and call.request["messages"][-1]["content"] == (
            f"{session}: start" if turn == 1 else f"turn {turn - 1}"
        )
    assert len(calls) <= len(answered) + len(sessions) * 2  # at most the calls in flight besides
    for session in sessions:  # numbering goes on after the last recorded call
        mine = sorted(c.seq for c in calls if c.session_id == session)
        assert mine == list(range(1, len(mine) + 1))
        assert by_id[after[session]].seq == mine[-1]
    if not db.startswith("postgresql"):
        assert sqlite3.connect(db).execute("PRAGMA integrity_check").fetchone() == ("ok",)


FIRST_CALLS = """
import sys
import anthropic, openai
from benchmarks.support.stub_upstream import MODEL, stub_app
from proxy.app import create_app
from proxy.server import AppThread
from proxy.settings import Settings

ASK = [{"role": "user", "content": "hi"}]
with AppThread(stub_app()) as stub, AppThread(create_app(Settings(upstream=f"{stub.url}/v1", db=sys.argv[1]))) as proxy:
    openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="s").chat.completions.create(model=MODEL, messages=ASK)
    after_chat = "litellm" in sys.modules
    claude = anthropic.Anthropic(base_url=proxy.url, api_key="s")
    reply = claude.messages.create(model=MODEL, max_tokens=8, messages=ASK)
    print(after_chat, "litellm" in sys.modules, reply.content[0].text)
"""


def test_litellm_is_imported_by_the_first_translating_call_not_at_start(tmp_path: Path) -> None:
    """A start or restart does not wait for litellm's import (6 s of a 10 s start here): it waits
    for a Messages or Responses call, which most proxies never receive."""
    run = subprocess.run([sys.executable, "-c", FIRST_CALLS, str(tmp_path / "s.db")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["False", "True", "stub", "answer"]


async def _all_calls(store: Store) -> list[Any]:
    return [c async for c in store.iter_calls()]


def lock_sqlite(path: str, held: threading.Event, release: threading.Event, seconds: float) -> None:
    """A second writer: another connection takes SQLite's write lock and keeps it until `release`
    is set, `seconds` at most."""
    conn = sqlite3.connect(path, timeout=60, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    held.set()
    release.wait(seconds)
    conn.execute("ROLLBACK")
    conn.close()


@contextmanager
def proxy_with(tmp_path: Path, busy_timeout: float) -> Iterator[tuple[AppThread, str]]:
    """A proxy on a SQLite file with this busy timeout, in front of a stub upstream."""
    db = str(tmp_path / "locked.db")
    with AppThread(stub_app()) as stub:
        app = create_app(Settings(upstream=f"{stub.url}/v1", db=db), store=Store(db, busy_timeout=busy_timeout))
        with AppThread(app) as proxy:
            yield proxy, db


def test_calls_wait_for_a_second_writer_and_all_are_recorded(tmp_path: Path) -> None:
    with proxy_with(tmp_path, busy_timeout=30) as (proxy, db):
        client = OpenAI(base_url=f"{proxy.url}/v1", api_key="locked", max_retries=0)
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "before"}])
        held = threading.Event()
        locker = threading.Thread(target=lock_sqlite, args=(db, held, threading.Event(), 2.0))
        locker.start()
        assert held.wait(60)
        started = time.monotonic()
        replies: list[str] = []
        workers = [
            threading.Thread(
                target=lambda i=i: replies.append(
                    client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"during {i}"}]
                    ).id
                )
            )
            for i in range(8)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
        waited = time.monotonic() - started
        locker.join()
    assert len(replies) == 8 and waited >= 1.5  # they waited for the lock, then were answered
    calls = read_store(db, lambda s: _all_calls(s))
    assert sorted(c.response["id"] for c in calls[1:]) == sorted(replies)
    assert sorted(c.seq for c in calls) == list(range(1, 10))


def test_a_lock_held_too_long_answers_503_in_the_api_shape_and_loses_nothing(tmp_path: Path) -> None:
    with proxy_with(tmp_path, busy_timeout=0.5) as (proxy, db):
        client = OpenAI(base_url=f"{proxy.url}/v1", api_key="stuck", max_retries=0)
        first = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "before"}])
        held, release = threading.Event(), threading.Event()
        locker = threading.Thread(target=lock_sqlite, args=(db, held, release, 120.0))
        locker.start()
        assert held.wait(60)
        during = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "during"}]}
        try:  # the lock is held for as long as the two calls take, however slow the machine
            headers = {"x-api-key": "stuck"}
            refused = httpx.post(f"{proxy.url}/v1/chat/completions", headers=headers, json=during, timeout=60)
            anthropic = httpx.post(f"{proxy.url}/v1/messages", headers=headers, json=during, timeout=60)
        finally:
            release.set()
            locker.join()
        # The SDK retries a 503 by itself: with its default retries the harness never notices.
        retried = OpenAI(base_url=f"{proxy.url}/v1", api_key="stuck").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "after"}]
        )
    assert refused.status_code == 503 and "Traceback" not in refused.text
    assert refused.json()["error"]["code"] == "store_unavailable"
    assert "could not be recorded" in refused.json()["error"]["message"]
    assert anthropic.status_code == 503 and anthropic.json()["type"] == "error"
    calls = read_store(db, lambda s: _all_calls(s))
    assert [c.response["id"] for c in calls] == [first.id, retried.id]  # nothing unanswered, nothing lost


def test_a_long_reader_does_not_hold_up_calls(tmp_path: Path) -> None:
    with proxy_with(tmp_path, busy_timeout=0.5) as (proxy, db):
        client = OpenAI(base_url=f"{proxy.url}/v1", api_key="read", max_retries=0)
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "before"}])
        reader = sqlite3.connect(db, isolation_level=None)  # an export or trainer mid-read
        reader.execute("BEGIN")
        assert reader.execute("SELECT count(*) FROM calls").fetchone() == (1,)
        for i in range(5):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"{i}"}])
        assert reader.execute("SELECT count(*) FROM calls").fetchone() == (1,)  # its snapshot
        reader.execute("COMMIT")
        reader.close()
    assert len(read_store(db, lambda s: _all_calls(s))) == 6


def test_postgres_going_away_answers_503_then_recovers_by_itself(postgres: str, tmp_path: Path) -> None:
    """A server of its own (the shared one is not stopped), crashed (immediate stop) mid-run."""
    with temp_postgres() as server, AppThread(stub_app()) as stub:
        db = new_database(server.url)
        proxy = AppThread(create_app(Settings(upstream=f"{stub.url}/v1", db=db))).__enter__()
        try:
            client = OpenAI(base_url=f"{proxy.url}/v1", api_key="pg-down", max_retries=0)
            ask = [{"role": "user", "content": "hi"}]
            before = [client.chat.completions.create(model=MODEL, messages=ask).id for _ in range(3)]
            server.ctl("stop")
            body = {"model": MODEL, "messages": ask, "max_tokens": 8}
            during = [
                httpx.post(f"{proxy.url}/v1/{path}", json=body, headers={"x-api-key": key})
                for path in ("chat/completions", "messages")
                for key in ("pg-down", "pg-new")
            ]
            server.ctl("start")
            after = [client.chat.completions.create(model=MODEL, messages=ask).id for _ in range(3)]
            mid = OpenAI(base_url=f"{proxy.url}/v1", api_key="pg-mid", max_retries=0)  # a read: pooled
            after.append(mid.chat.completions.create(model=MODEL, messages=ask).id)
            server.ctl("stop")  # and again, with no call while it is away: the pooled
            server.ctl("start")  # connections are dead, and found so before use
            for key in ("pg-after", "pg-down"):
                again = OpenAI(base_url=f"{proxy.url}/v1", api_key=key, max_retries=0)
                after.append(again.chat.completions.create(model=MODEL, messages=ask).id)
        finally:
            proxy.__exit__(None, None, None)
        calls = read_store(db, lambda s: _all_calls(s))
    for resp in during:  # no answer goes out unrecorded, and no traceback
        assert resp.status_code == 503 and "Traceback" not in resp.text, resp.text
        assert "could not be recorded" in resp.text or "store is unavailable" in resp.text
    assert [c.response["id"] for c in calls] == before + after and all(c.ok for c in calls)


@contextmanager
def small_disk(size: str) -> Iterator[Path]:
    """A tmpfs of its own, to fill up; unmounted lazily (the proxy may still hold files). Not in
    pytest's tmp_path, which PostgreSQL's user cannot enter."""
    where = Path(tempfile.mkdtemp(prefix="rlp-disk-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)
        where.rmdir()


@contextmanager
def store_on(disk: Path, kind: str) -> Iterator[str]:
    """A store URL whose files are all on `disk`: a SQLite file, or a PostgreSQL cluster."""
    if kind == "sqlite":
        yield str(disk / "calls.db")
        return
    with temp_postgres(disk) as server:
        yield new_database(server.url)


def fill(disk: Path) -> Path:
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as out:
        try:
            while True:
                out.write(b"\0" * 4096)
        except OSError:  # ENOSPC: the disk is full
            pass
    return filler


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_full_disk_answers_503_and_loses_nothing(kind: str, request: pytest.FixtureRequest) -> None:
    """The store on a disk that fills up: calls are refused with 503 (the SDKs retry), what was
    recorded before stays intact, and once there is room again calls are recorded as before,
    with neither the proxy nor the database restarted."""
    if kind == "postgresql":
        request.getfixturevalue("postgres")  # skipped (or, in CI, failed) without PostgreSQL
    size = "3m" if kind == "sqlite" else "96m"  # a new cluster takes about 40 MB
    with (
        small_disk(size) as disk,
        store_on(disk, kind) as db,
        AppThread(stub_app()) as stub,
        AppThread(create_app(Settings(upstream=f"{stub.url}/v1", db=db))) as proxy,
    ):
        client = OpenAI(base_url=f"{proxy.url}/v1", api_key="full", max_retries=0)
        # 20 KB the store must add per call; random, as PostgreSQL would compress a repeated one.
        ask = [{"role": "user", "content": secrets.token_hex(10_000)}]
        before = [client.chat.completions.create(model=MODEL, messages=ask).id for _ in range(3)]
        filler = fill(disk)
        during = [
            httpx.post(
                f"{proxy.url}/v1/chat/completions",
                headers={"x-api-key": "full"},
                timeout=60,
                json={"model": MODEL, "messages": ask},
            )
            for _ in range(10)
        ]
        filler.unlink()
        after = [client.chat.completions.create(model=MODEL, messages=ask).id for _ in range(3)]
        health = httpx.get(f"{proxy.url}/healthz").json()
        calls = read_store(db, lambda s: _all_calls(s))
    refused = [r for r in during if r.status_code != 200]
    assert refused, "no call was refused on a full disk"
    for resp in refused:
        assert resp.status_code == 503 and "Traceback" not in resp.text, resp.text
        error = resp.json()["error"]
        assert error["code"] == "store_unavailable" and re.search("disk is full|No space left", error["message"]), error
    answered = [r.json()["id"] for r in during if r.status_code == 200]  # while the store still had room
    assert [c.response["id"] for c in calls] == before + answered + after
    assert all(c.ok and c.request["messages"] == ask for c in calls)
    assert health["status"] == "ok"


def test_slow_clients_hold_up_neither_others_nor_the_store(make_proxy: Any, stub: str) -> None:
    """200 slow-loris connections, each sending half a request body and then nothing: other
    clients are answered meanwhile; one that ends its body in time is answered and recorded; the
    rest are answered 408 and closed at the body timeout, and leave nothing behind."""
    proxy = make_proxy(stub, body_timeout=10)
    host, port = proxy.url.removeprefix("http://").split(":")
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "slow"}]})
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer slow\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    slow = [socket.create_connection((host, int(port))) for _ in range(200)]
    for conn in slow:
        conn.sendall(head + body[: len(body) // 2])
    client = OpenAI(base_url=proxy.v1, api_key="quick", max_retries=0, timeout=30)
    quick = [
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}]).id for _ in range(5)
    ]
    last = slow.pop()
    last.sendall(body[len(body) // 2 :])
    last.settimeout(30)
    answer = last.recv(65536).decode()
    last.close()
    cut_off = []
    for conn in slow:  # each is answered at its timeout, then closed by the proxy
        conn.settimeout(30)
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
        conn.close()
        cut_off.append(received.decode())
    assert answer.startswith("HTTP/1.1 200"), answer[:300]
    assert all(a.startswith("HTTP/1.1 408") and "request_timeout" in a for a in cut_off), cut_off[0][:300]
    assert [c.response["id"] for c in proxy.calls("quick")] == quick
    [late] = proxy.calls("slow")
    assert late.ok and late.request["messages"] == [{"role": "user", "content": "slow"}]


@pytest.mark.parametrize("route", ["chat/completions", "messages"])
def test_a_whole_answer_whose_client_hung_up_is_recorded_as_not_delivered(
    make_proxy: Any, route: str, tmp_path: Path
) -> None:
    """Fault injection with a slow stub upstream (NOT vLLM): a client that times out while the
    proxy waits for a whole answer never sees it. It was recorded as a 200, continued by token-in
    and trained, and the client's retry became another sequence; now it is a 499 with its tokens
    kept, as a stream's is."""
    with AppThread(stub_app(latency=1.5)) as slow:
        proxy = make_proxy(f"{slow.url}/v1")
        body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{proxy.url}/s/gone/v1/{route}", json=body, timeout=0.5)
        deadline = time.monotonic() + 10
        while not proxy.calls("gone") and time.monotonic() < deadline:
            time.sleep(0.1)
        [call] = proxy.calls("gone")
        assert (call.http_status, call.ok, call.answered) == (499, False, False), call.error
        assert call.error == "client disconnected before the answer" and call.completions[0].token_ids
        delivered = httpx.post(f"{proxy.url}/s/kept/v1/{route}", json=body, timeout=10)
        assert delivered.status_code == 200 and [c.http_status for c in proxy.calls("kept")] == [200]


@contextmanager
def resetting_forwarder(upstream: str) -> Iterator[tuple[str, list[int]]]:
    """A TCP forwarder in front of the stub upstream (NOT vLLM) that, once, resets a kept-alive
    connection as the next chat request on it arrives, before its body is read: what a server
    does that closes an idle connection (uvicorn after 5 s) just as a client takes it from its
    pool. Yields the forwarder's /v1 URL and a list that counts the resets."""
    target = upstream.removeprefix("http://").removesuffix("/v1").split(":")
    listener = socket.create_server(("127.0.0.1", 0))
    resets: list[int] = []
    line = b"POST /v1/chat/completions "

    def pipe(src: socket.socket, dst: socket.socket, client_side: bool) -> None:
        seen = 0
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                seen += client_side and chunk.count(line)
                if client_side and seen > 1 and not resets:
                    resets.append(1)
                    src.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    break
                dst.sendall(chunk)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.close()

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = listener.accept()
                server = socket.create_connection((target[0], int(target[1])))
                threading.Thread(target=pipe, args=(client, server, True), daemon=True).start()
                threading.Thread(target=pipe, args=(server, client, False), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1", resets
    finally:
        listener.close()


def test_a_pooled_upstream_connection_reset_under_a_request_is_retried_on_a_fresh_one(
    make_proxy: Any, stub: str
) -> None:
    """The soak once answered 502 "Can not write request body": the stub upstream had closed a
    pooled connection as the proxy sent a request's body on it. Nothing of that request reached
    the upstream, so the proxy sends it once more on a fresh connection, as it does when a pooled
    connection turns out closed before the request (ServerDisconnectedError)."""
    with resetting_forwarder(stub) as (upstream, resets):
        proxy = make_proxy(upstream)
        client = OpenAI(base_url=proxy.v1, api_key="pooled", max_retries=0, timeout=30)
        big = "x" * 4_000_000  # far more than a socket buffer: the body is still being written at the reset
        answers = [
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}]).id
            for content in ("first", big)
        ]
    assert resets == [1]
    assert [c.response["id"] for c in proxy.calls("pooled")] == answers
