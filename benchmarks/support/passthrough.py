"""The floor under rl-proxy's cost (NOT a proxy anyone should run): the same stack, uvicorn on
uvloop, FastAPI and one aiohttp session to the upstream, forwarding a chat call's body and answer
as bytes, recording nothing, translating nothing. benchmarks/profile_proxy.py times it beside
rl-proxy: what rl-proxy adds above it is its own work.
Run alone: python -m benchmarks.support.passthrough --port 9001 --upstream http://127.0.0.1:9000/v1
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import aiohttp
import uvicorn
from fastapi import FastAPI, Request, Response

from benchmarks.support.stack import process
from proxy.vllm import free_port


def passthrough_app(upstream: str) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with aiohttp.ClientSession() as app.state.session:
            yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        async with request.app.state.session.get(f"{upstream}/models") as resp:
            return Response(await resp.read(), resp.status, media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.body()
        headers = {"Content-Type": "application/json"}
        session = request.app.state.session
        async with session.post(f"{upstream}/chat/completions", data=body, headers=headers) as resp:
            return Response(await resp.read(), resp.status, media_type="application/json")

    return app


@contextmanager
def floor(upstream: str, log: Path) -> Iterator[tuple[str, int]]:
    """The floor in a process of its own in front of `upstream`: its …/v1 URL and its process
    id; stopped afterwards."""
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.support.passthrough", "--port", str(port), "--upstream", upstream]
    with process(cmd, f"http://127.0.0.1:{port}/v1/models", log) as proc:
        yield f"http://127.0.0.1:{port}/v1", proc.pid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the upstream's …/v1 URL")
    args = parser.parse_args()
    uvicorn.run(passthrough_app(args.upstream), host="127.0.0.1", port=args.port, log_level="warning", loop="uvloop")


if __name__ == "__main__":
    main()
