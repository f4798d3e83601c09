"""The floor under rl-proxy's cost (NOT a proxy anyone should run): the same stack, uvicorn on
uvloop, FastAPI and one aiohttp session to the upstream, forwarding a chat call's body and answer
as bytes, recording nothing, translating nothing. benchmarks/profile_proxy.py times it beside
rl-proxy: what rl-proxy adds above it is its own work.

With `--db`, the recording floor: the same, and each call recorded through the recorder's own
Store (the writer, its batches and its durable commit) before the answer is sent, with the least
a recording needs: the upstream asked for token ids and logprobs, its answer parsed, one
CallRecord of the prompt and sampled ids. No validation, sessions held in a dict, no token-in,
no translation: what any proxy of this stack that records each call durably costs at least
(`python -m benchmarks.soak --bench`). With `--render` too, the token-in floor: each call's
messages also rendered by the upstream (`POST /tokenize`, its ids parsed) before it is forwarded,
the one round trip that token-in adds to a call, and nothing of token-in's own work.
`GET /waits` answers what the renderings and the commits took so far (seconds and count).
Run alone: python -m benchmarks.support.passthrough --port 9001 --upstream http://127.0.0.1:9000/v1
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvicorn
from fastapi import FastAPI, Request, Response

from benchmarks.support.stack import process
from proxy import heap
from proxy.vllm import free_port
from recorder import CallRecord, SessionInfo, Store
from recorder.records import Completion
from recorder.store import utcnow


def passthrough_app(upstream: str, db: str | None = None, render: bool = False) -> FastAPI:
    store = Store(db) if db else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if store is not None:
            await store.open()
        async with aiohttp.ClientSession() as app.state.session:
            yield
        if store is not None:
            await store.close()

    app = FastAPI(lifespan=lifespan)
    waits = {"render": [0.0, 0], "commit": [0.0, 0]}  # seconds and count of each wait, for GET /waits
    numbers: dict[str, int] = {}  # a session (named by its key, as its id): its last call's number
    opened: dict[str, asyncio.Future[Any]] = {}  # a session: its creation, which its concurrent calls await

    async def record(store: Store, key: str, body: dict[str, Any], answer: dict[str, Any], started: datetime) -> None:
        if key not in opened:
            opened[key] = asyncio.ensure_future(store.resolve_session(SessionInfo(id=key, key=key)))
        await opened[key]
        numbers[key] = numbers.get(key, 0) + 1
        completions = [
            Completion(c["index"], c["token_ids"], [t["logprob"] for t in c["logprobs"]["content"]], c["finish_reason"])
            for c in answer["choices"]
        ]
        call = CallRecord(
            session_id=key, seq=numbers[key], api="chat.completions", model=body["model"],
            upstream=upstream, stream=False, request=body, response=answer, ok=True, http_status=200, error=None,
            prompt_token_ids=answer["prompt_token_ids"], completions=completions, policy_version=None,
            policy_version_end=None, started_at=started, finished_at=utcnow(),
        )  # fmt: skip
        start = time.perf_counter()
        await store.record(call)
        waited(waits["commit"], start)

    @app.get("/waits")
    async def waits_route() -> dict[str, Any]:
        return {name: {"seconds": total, "count": n} for name, (total, n) in waits.items()}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        async with request.app.state.session.get(f"{upstream}/models") as resp:
            return Response(await resp.read(), resp.status, media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        started, body = utcnow(), await request.body()
        if store is not None:
            asked = orjson.loads(body)
            body = orjson.dumps(asked | {"return_token_ids": True, "logprobs": True})
        headers = {"Content-Type": "application/json"}
        session = request.app.state.session
        if render and any(m.get("role") == "assistant" for m in asked["messages"]):  # as token-in renders
            start = time.perf_counter()
            rendering = orjson.dumps({"model": asked["model"], "messages": asked["messages"]})
            async with session.post(
                f"{upstream.removesuffix('/v1')}/tokenize", data=rendering, headers=headers
            ) as resp:
                assert isinstance(orjson.loads(await resp.read())["tokens"], list)
            waited(waits["render"], start)
        async with session.post(f"{upstream}/chat/completions", data=body, headers=headers) as resp:
            answer = await resp.read()
        if store is not None and resp.status == 200:
            key = request.headers.get("x-api-key") or request.headers["authorization"]  # the client's key: its session
            await record(store, key, asked, orjson.loads(answer), started)
        return Response(answer, resp.status, media_type="application/json")

    return app


def waited(wait: list[Any], start: float) -> None:
    wait[0] += time.perf_counter() - start
    wait[1] += 1


@contextmanager
def floor(upstream: str, log: Path, db: str | None = None, render: bool = False) -> Iterator[tuple[str, int]]:
    """The floor (recording into `db`, if given; rendering each call first, if `render`) in a
    process of its own in front of `upstream`: its …/v1 URL and its process id; stopped afterwards."""
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.support.passthrough", "--port", str(port), "--upstream", upstream]
    cmd += (["--db", db] if db else []) + (["--render"] if render else [])
    with process(cmd, f"http://127.0.0.1:{port}/v1/models", log) as proc:
        yield f"http://127.0.0.1:{port}/v1", proc.pid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the upstream's …/v1 URL")
    parser.add_argument("--db", help="record each call into this store (the recording floor)")
    parser.add_argument("--render", action="store_true", help="and render it on the upstream first (with --db)")
    args = parser.parse_args()
    heap.settle()  # the collector as `rl-proxy serve` sets it
    app = passthrough_app(args.upstream, args.db, args.render)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", loop="uvloop")


if __name__ == "__main__":
    main()
