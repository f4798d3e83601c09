"""Scale-out with stub upstreams (NOT vLLM): several servers behind one proxy, sessions pinned
and moved off a dead server; two proxy processes writing one PostgreSQL database."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from fastapi import FastAPI

from benchmarks.support.load import Load, reply, request, verify
from benchmarks.support.stack import process, read_calls
from benchmarks.support.stub_upstream import MODEL, stub_app
from proxy.server import AppThread
from proxy.vllm import free_port


def ask(proxy: Any, session: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": session}]}
    return httpx.post(f"{proxy.v1}/chat/completions", json=body, headers={"x-api-key": session}, timeout=30)


def served_by(proxy: Any) -> dict[str, set[str]]:
    """Each session's upstreams, as recorded."""
    out: dict[str, set[str]] = {}
    for call in proxy.calls():
        out.setdefault(call.session_id, set()).add(call.upstream)
    return out


def test_sessions_are_pinned_and_moved_off_a_dead_upstream(make_proxy: Any) -> None:
    ports = [free_port() for _ in range(3)]
    servers = [AppThread(stub_app(), port).__enter__() for port in ports]
    urls = [f"{s.url}/v1" for s in servers]
    proxy = make_proxy(",".join(urls), version_poll_interval=0.2)
    sessions = [f"pin-{i}" for i in range(24)]
    for _ in range(3):
        assert all(ask(proxy, s).status_code == 200 for s in sessions)
    before = served_by(proxy)
    assert all(len(ups) == 1 for ups in before.values())  # pinned: every call of a session on one server
    home = {s: next(iter(before[s])) for s in sessions}
    # Spread over all three (the ports are new each run, so is the spread: that 24 sessions leave
    # one server with fewer than 3 happened 1.5% of the time, and is no fault).
    assert set(home.values()) == set(urls)

    servers[0].__exit__(None, None, None)  # the first server dies
    assert all(ask(proxy, s).status_code == 200 for s in sessions)  # no call fails
    health = httpx.get(f"{proxy.url}/healthz").json()["upstreams"]
    assert [u["alive"] for u in health] == [False, True, True]
    calls = proxy.calls()
    assert all(c.ok for c in calls)
    last = {c.session_id: c.upstream for c in calls}
    for s in sessions:  # the dead server's sessions moved; the others stayed
        assert last[s] != urls[0]
        if home[s] != urls[0]:
            assert last[s] == home[s]

    servers[0] = AppThread(stub_app(), ports[0]).__enter__()  # it comes back
    deadline = time.monotonic() + 10
    while not httpx.get(f"{proxy.url}/healthz").json()["upstreams"][0]["alive"]:
        assert time.monotonic() < deadline, "the server that came back was never probed back in"
        time.sleep(0.2)
    assert all(ask(proxy, s).status_code == 200 for s in sessions)
    back = {c.session_id: c.upstream for c in proxy.calls()}
    assert back == home  # and its sessions return to it
    for server in servers:
        server.__exit__(None, None, None)


def test_all_upstreams_down_is_a_502_recorded(make_proxy: Any) -> None:
    proxy = make_proxy(f"http://127.0.0.1:{free_port()}/v1,http://127.0.0.1:{free_port()}/v1")
    refused = ask(proxy, "nowhere")
    assert refused.status_code == 502 and refused.json()["error"]["code"] == "upstream_unreachable"
    [call] = proxy.calls("nowhere")
    assert not call.ok and call.http_status == 502


async def round_robin(bases: list[str], sessions: int, turns: int) -> Load:
    """Each session's turns alternate between the proxies, as behind a round-robin balancer."""
    load = Load()

    async def converse(http: aiohttp.ClientSession, session: str) -> None:
        history: list[Any] = []
        for turn in range(1, turns + 1):
            path, body = request("chat", f"{session} turn {turn}", history, None)
            async with http.post(f"{bases[turn % 2]}/{path}", json=body, headers={"x-api-key": session}) as resp:
                raw = await resp.read()
            if resp.status != 200:
                load.errors.append(f"{session} turn {turn}: {resp.status} {raw[:200]!r}")
                return
            reply_id, text = reply("chat", raw)
            history.append({"role": "assistant", "content": text})
            load.answered.append((session, turn, "chat", reply_id))

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(converse(http, f"rr-{i}") for i in range(sessions)))
    return load


def test_two_proxy_processes_write_one_postgres_database(postgres: str, tmp_path: Path) -> None:
    from benchmarks.support.stack import new_database

    db = new_database(postgres)
    port = free_port()
    stub = [sys.executable, "-m", "benchmarks.support.stub_upstream", "--port", str(port), "--latency", "0.01"]
    upstream = f"http://127.0.0.1:{port}/v1"
    ports = [free_port(), free_port()]
    serve = [
        [sys.executable, "-m", "proxy.cli", "serve", "--upstream", upstream, "--db", db, "--port", str(p)]
        for p in ports
    ]
    with (
        process(stub, f"{upstream}/models", tmp_path / "stub.log"),
        process(serve[0], f"http://127.0.0.1:{ports[0]}/healthz", tmp_path / "a.log"),
        process(serve[1], f"http://127.0.0.1:{ports[1]}/healthz", tmp_path / "b.log"),
    ):
        load = asyncio.run(round_robin([f"http://127.0.0.1:{p}/v1" for p in ports], sessions=16, turns=8))
    assert not load.errors, load.errors[:3]
    assert len(load.answered) == 16 * 8
    assert verify(db, load) == []  # every turn recorded once, in order, whole


def versioned_stub() -> tuple[FastAPI, dict[str, str]]:
    """The stub upstream with vLLM's `GET /weight_info`, and the weights it reports (to change)."""
    upstream = stub_app()
    weights = {"weight_version": "1"}

    @upstream.get("/weight_info")
    async def weight_info() -> dict[str, str]:
        return weights

    return upstream, weights


def two_workers(upstream: str, db: str, port: int) -> list[str]:
    """`rl-proxy serve --workers 2`'s command line."""
    serve = [sys.executable, "-m", "proxy.cli", "serve", "--upstream", upstream, "--db", db]
    return [*serve, "--port", str(port), "--workers", "2"]


def test_serve_workers_share_the_trainers_version_announce_ended_sessions_and_their_metrics(
    tmp_path: Path,
) -> None:
    """`rl-proxy serve --workers 2` on a stub upstream, two sessions' calls on new connections,
    which either worker may take. The trainer's announce of a new policy version reaches one
    worker, and each call after it is stamped with the new version whichever worker serves it;
    their version polls are an hour apart, so only the announce passed between the workers can
    say it. Sessions ended through either worker are refused by both, though both held them.
    `/metrics`, whichever worker answers, counts every call."""
    upstream, weights = versioned_stub()
    served_from: set[int] = set()  # the upstream connections' ports: each worker has its own

    @upstream.middleware("http")
    async def note(request: Any, call_next: Any) -> Any:
        if request.url.path.endswith("/chat/completions"):
            served_from.add(request.client.port)
        return await call_next(request)

    def workers() -> dict[int, str]:
        """Each worker's policy version, from /healthz over new connections until both answered."""
        seen: dict[int, str] = {}
        for _ in range(100):
            health = httpx.get(f"{base}/healthz", timeout=10).json()
            seen[health["pid"]] = health["policy_version"]
            if len(seen) == 2:
                break
        return seen

    def ask(i: int) -> int:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"call {i}"}]}
        key = {"x-api-key": f"id={'wv'[i % 2]}"}
        return httpx.post(f"{base}/v1/chat/completions", json=body, headers=key, timeout=30).status_code

    db, port = tmp_path / "w.db", free_port()
    base = f"http://127.0.0.1:{port}"
    with AppThread(upstream) as stub:
        serve = two_workers(f"{stub.url}/v1", str(db), port)
        with process(serve, f"{base}/healthz", tmp_path / "serve.log", {"RLP_VERSION_POLL_INTERVAL": "3600"}) as proc:
            assert list(workers().values()) == ["1", "1"]
            weights["weight_version"] = "2"
            assert httpx.post(f"{base}/admin/policy_version/refresh", timeout=30).json()["policy_version"] == "2"
            calls = 0
            while calls < 20 or (len(served_from) < 2 and calls < 200):  # until both workers served both
                assert ask(calls) == 200
                calls += 1
            assert len(served_from) == 2
            assert list(workers().values()) == ["2", "2"]
            for _ in range(4):
                counted = f'rlp_calls_total{{api="chat.completions",status="ok"}} {calls}.0'
                assert counted in httpx.get(f"{base}/metrics").text
            for session in "wv":
                assert httpx.post(f"{base}/admin/sessions/{session}/end", timeout=30).status_code == 200
            served_from.clear()
            assert [ask(i) for i in range(20)] == [409] * 20
            assert served_from == set()
            proc.terminate()
            assert proc.wait(30) == 0
    recorded = read_calls(str(db))
    assert sorted(call.seq for call in recorded if call.session_id == "w") == list(range(1, (calls + 1) // 2 + 1))
    assert [call.policy_version for call in recorded] == ["2"] * calls


def test_a_call_in_flight_on_another_worker_across_an_announce_records_the_version_it_ended_on(
    tmp_path: Path,
) -> None:
    """A call that one worker serves while the trainer's announce reaches the other: recorded as
    started on the old version and ended on the new, as one process records it."""
    upstream, weights = versioned_stub()

    @upstream.middleware("http")
    async def slow(request: Any, call_next: Any) -> Any:
        if request.url.path.endswith("/chat/completions") and b"slow" in await request.body():
            await asyncio.sleep(3)
        return await call_next(request)

    def pid(client: httpx.Client) -> int:
        return int(client.get(f"{base}/healthz").json()["pid"])

    db, port = tmp_path / "w.db", free_port()
    base = f"http://127.0.0.1:{port}"
    with AppThread(upstream) as stub:
        serve = two_workers(f"{stub.url}/v1", str(db), port)
        env = {"RLP_VERSION_POLL_INTERVAL": "3600"}
        with process(serve, f"{base}/healthz", tmp_path / "serve.log", env), httpx.Client(timeout=30) as calling:
            serving = pid(calling)  # the worker of this client's one connection
            for _ in range(100):  # a connection to the other worker
                announcing = httpx.Client(timeout=30)
                if pid(announcing) != serving:
                    break
                announcing.close()
            body = {"model": MODEL, "messages": [{"role": "user", "content": "slow"}]}
            with ThreadPoolExecutor(1) as pool:
                call = pool.submit(calling.post, f"{base}/v1/chat/completions", json=body, headers={"x-api-key": "s"})
                time.sleep(1.5)  # the call is waiting for its answer
                weights["weight_version"] = "2"
                assert pid(announcing) != serving
                assert announcing.post(f"{base}/admin/policy_version/refresh").json()["policy_version"] == "2"
                announcing.close()
                assert call.result().status_code == 200
    [recorded] = read_calls(str(db))
    assert (recorded.policy_version, recorded.policy_version_end) == ("1", "2")


@pytest.mark.parametrize("db", ["postgresql://nobody@127.0.0.1:{port}/none", "nosuch://x"])
def test_serve_workers_that_cannot_start_exit_as_one_process_does(db: str) -> None:
    """A store it cannot reach, or cannot even name: 3, as uvicorn's one process exits (its
    supervisor exited 0 for the one, and restarted workers for ever for the other)."""
    serve = two_workers("http://127.0.0.1:9/v1", db.format(port=free_port()), free_port())
    done = subprocess.run(serve, capture_output=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]


def test_a_killed_workers_live_gauges_leave_the_sums(tmp_path: Path) -> None:
    """A worker that dies without closing (killed, crashed) leaves its gauge file behind; the next
    worker to start drops it, so `/metrics` sums the live workers' gauges only."""
    worker = (
        "import os, sys\n"
        "from proxy.metrics import Metrics\n"
        "metrics = Metrics(shared=True)\n"
        "metrics.record_failures.set(float(sys.argv[1]))\n"
        "sys.stdout.write(metrics.render().decode()); sys.stdout.flush()\n"
        "os._exit(0)  # as a killed worker: no close\n"
    )
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}

    def failures(text: str) -> float:
        return float(next(line.split()[1] for line in text.splitlines() if line.startswith("rlp_record_failures ")))

    def run(value: int) -> str:
        argv = [sys.executable, "-c", worker, str(value)]
        done = subprocess.run(argv, env=env, cwd=Path(__file__).parents[2], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert failures(run(3)) == 3  # its own, while alive
    assert len(list(tmp_path.glob("gauge_live*_*.db"))) == 1  # left behind
    assert failures(run(4)) == 4  # the dead worker's 3 not summed in
