"""An episode's door to the proxy: all that an episode's container can reach.

A container episode has no network but its own loopback (`network_mode: none`). On that
loopback the runner serves the gateway: it enters the container's network namespace for as long
as it takes to make a listening socket (Linux, as root, with the engine on this machine), then
serves on it a small reverse proxy of its own process. The gateway passes the proxy's model
routes (`/v1/...`: chat completions, completions, models, messages, responses) on under the
episode's own key, whatever key or session header the request carries, and answers 404 to
anything else. So the agent reaches its model and nothing else of the host: not the proxy's
admin API (where a reward can be posted), not vLLM's routes (weights, pause), not any other
service on the host's loopback; and no session but its own. Polar tunnels its isolated sandboxes
to its proxy alike; Harbor's containers, by contrast, share a network.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import re
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

CLONE_NEWNET = 0x40000000
MODEL_ROUTE = re.compile(r"/v1/(chat/completions|completions|models|messages(/count_tokens)?|responses(/[\w-]+)?)")
# Not passed on: what names a session or the hop, and what the client's transport sets again.
DROPPED = {"authorization", "x-api-key", "x-session-id", "host", "connection", "keep-alive", "transfer-encoding"}
HOP = {"connection", "keep-alive", "transfer-encoding"}


class GatewayError(RuntimeError):
    """The container's network cannot be entered: not Linux, not root, an engine elsewhere."""


def container_pid(container: Any) -> int:
    """The PID of a running container's main process on this machine; 0 when no process here is
    it (the engine is on another machine, or this one runs in a container of its own, where the
    engine's PID names another process): its cgroups must name the container."""
    container.reload()
    pid = int(container.attrs["State"]["Pid"] or 0)
    try:
        cgroups = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return 0
    return pid if pid > 0 and container.id in cgroups else 0


def listen_in(pid: int, port: int) -> socket.socket:
    """A socket listening on 127.0.0.1:`port` in the network namespace of process `pid`. Made on
    a thread of its own, which enters the namespace and ends: no thread of ours stays there."""
    made: list[socket.socket | BaseException] = []

    def make() -> None:
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            finally:
                os.close(fd)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen(128)
            sock.setblocking(False)
            made.append(sock)
        except BaseException as exc:
            made.append(exc)

    thread = threading.Thread(target=make, name="gateway-netns")
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise GatewayError(
            f"cannot listen in the container's network (process {pid}): {made[0]}; the gateway needs the "
            "container engine on this machine and root (else `network: host`, see docs/environments.md)"
        ) from made[0]
    return made[0]


def gateway_app(proxy_url: str, key: str) -> Starlette:
    """The reverse proxy: model routes to `proxy_url` under `key`, 404 for anything else."""
    client = httpx.AsyncClient(base_url=proxy_url.rstrip("/"), timeout=httpx.Timeout(None, connect=10.0))

    async def forward(request: Request) -> Response:
        path = request.url.path
        if not MODEL_ROUTE.fullmatch(path):
            return _error(404, f"{path} is not a model route: an episode reaches the model routes only")
        headers = [(k, v) for k, v in request.headers.items() if k not in DROPPED]
        headers.append(("authorization", f"Bearer {key}"))
        target = path + (f"?{request.url.query}" if request.url.query else "")
        sent = client.build_request(request.method, target, headers=headers, content=request.stream())
        try:
            answer = await client.send(sent, stream=True)
        except httpx.HTTPError as exc:
            return _error(502, f"the proxy did not answer: {type(exc).__name__}", "upstream_error")
        kept = {k: v for k, v in answer.headers.items() if k not in HOP}
        return StreamingResponse(
            answer.aiter_raw(), answer.status_code, headers=kept, background=BackgroundTask(answer.aclose)
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with client:
            yield

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)], lifespan=lifespan)


def _error(status: int, message: str, kind: str = "not_found_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the run's own SIGTERM handling stays: an episode's gateway is no process of its own


async def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
    try:
        await server.serve(sockets=[sock])
    except SystemExit as exc:  # uvicorn's answer to a failed start: this gateway's end, not the run's
        raise GatewayError(f"the gateway did not start (uvicorn's exit {exc.code})") from None


@contextlib.asynccontextmanager
async def gateway(pid: int, proxy_url: str, key: str) -> AsyncIterator[str]:
    """Serve the gateway in the network of process `pid` (a container's) for as long as the
    context lasts; the URL at which it is reached from there: 127.0.0.1 at the proxy's port."""
    if pid <= 0:
        raise GatewayError("the container's process is not on this machine (an engine elsewhere: `network: host`)")
    port = urlsplit(proxy_url).port or 80
    sock = listen_in(pid, port)
    # log_config None: the run's logging stays as the run set it (uvicorn's would replace it)
    # An answer still streaming when the episode ends (a background job's) holds the shutdown 2 s at most.
    config = uvicorn.Config(
        gateway_app(proxy_url, key), log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=2
    )
    server = _Server(config)
    serving = asyncio.create_task(_serve(server, sock))
    try:
        while not server.started:
            if serving.done():
                serving.result()
                raise GatewayError("the gateway stopped as it started")
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.shield(serving)
        sock.close()
