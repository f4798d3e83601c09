"""The app factory: wires settings, store and upstreams into one FastAPI app."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.admin import admin, names_loopback, ops
from proxy.anthropic import router as anthropic_router
from proxy.errors import BadRequest, Forbidden, ProxyError, install_handlers, refusal
from proxy.metrics import Metrics
from proxy.openai_api import router
from proxy.responses import router as responses_router
from proxy.settings import LOOPBACK, Settings
from proxy.state import ProxyState, RecentResponses
from proxy.threads import Threads
from proxy.upstream import Upstreams
from proxy.workers import Marks
from recorder import Store


def create_app(settings: Settings, store: Store | None = None, marks: Marks | None = None) -> FastAPI:
    """The proxy app. The store and upstreams are opened and closed with the app's lifespan;
    `marks` are shared with the other workers of `serve --workers N` (proxy/workers.py)."""
    if not settings.upstream:
        raise ValueError("create_app needs an upstream URL (settings.upstream)")
    store = store or Store(settings.db)
    upstreams = Upstreams.from_urls(
        settings.upstream,
        timeout=settings.upstream_timeout,
        connect_timeout=settings.upstream_connect_timeout,
        api_key=settings.upstream_api_key,
        marks=marks,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await store.open()
        await upstreams.start(settings.version_poll_interval)
        try:
            yield
        finally:
            await upstreams.close()
            await store.close()
            app.state.rlp.metrics.close()

    app = FastAPI(title="rl-proxy", lifespan=lifespan)
    app.add_middleware(Guard, loopback_only=settings.host in LOOPBACK)
    mib = 2**20
    app.state.rlp = ProxyState(
        settings,
        store,
        upstreams,
        marks=marks,
        metrics=Metrics(shared=marks is not None),
        threads=Threads(int(settings.thread_cache_mb * mib)),
        recent_responses=RecentResponses(int(settings.response_cache_mb * mib)),
    )
    install_handlers(app)
    for prefix in ("/v1", "/s/{session}/v1"):
        app.include_router(router, prefix=prefix)
        app.include_router(anthropic_router, prefix=prefix)
        app.include_router(responses_router, prefix=prefix)
    app.include_router(admin)
    app.include_router(ops)
    return app


class Guard:
    """What every request is refused for before its route, in the API's error shape. A plain ASGI
    middleware: as FastAPI dependencies of the app the two checks cost every model call
    0.08-0.16 ms of the event loop's thread (py-spy, docs/benchmarks.md).

    - A NUL in the URL: ids, keys and labels from it end up in text columns, and PostgreSQL's
      refuse NUL.
    - A proxy bound to a loopback address answers requests addressed to a loopback name only: a
      web page whose name rebinds to 127.0.0.1 could otherwise POST JSON to its model routes (DNS
      rebinding; the admin routes check the same). Bound elsewhere, any name may reach it."""

    def __init__(self, app: ASGIApp, loopback_only: bool) -> None:
        self.app = app
        self.loopback_only = loopback_only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = self.refused(scope)
            if refused is not None:
                await refusal(scope["path"], refused)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refused(self, scope: Scope) -> ProxyError | None:
        if "\x00" in scope["path"] or b"%00" in scope["query_string"]:
            return BadRequest("the URL contains a NUL character")
        if not self.loopback_only:
            return None
        host = Headers(scope=scope).get("host", "")
        if names_loopback(host):
            return None
        return Forbidden(
            f"this proxy listens on a loopback address and answers requests addressed to it by a "
            f"loopback name only, not {host[:64]!r} (bind it with --host to be reached by other names)"
        )
