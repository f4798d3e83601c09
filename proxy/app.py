"""The app factory: wires settings, store and upstreams into one FastAPI app."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request

from proxy.admin import addressed_to_loopback, admin, ops
from proxy.anthropic import router as anthropic_router
from proxy.errors import BadRequest, Forbidden, install_handlers
from proxy.openai_api import router
from proxy.responses import router as responses_router
from proxy.settings import LOOPBACK, Settings
from proxy.state import ProxyState, RecentResponses
from proxy.threads import Threads
from proxy.upstream import Upstreams
from recorder import Store


def create_app(settings: Settings, store: Store | None = None) -> FastAPI:
    """The proxy app. The store and upstreams are opened and closed with the app's lifespan."""
    if not settings.upstream:
        raise ValueError("create_app needs an upstream URL (settings.upstream)")
    store = store or Store(settings.db)
    upstreams = Upstreams.from_urls(
        settings.upstream,
        timeout=settings.upstream_timeout,
        connect_timeout=settings.upstream_connect_timeout,
        api_key=settings.upstream_api_key,
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

    app = FastAPI(title="rl-proxy", lifespan=lifespan, dependencies=[Depends(no_nul), Depends(own_host)])
    mib = 2**20
    app.state.rlp = ProxyState(
        settings,
        store,
        upstreams,
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


async def no_nul(request: Request) -> None:
    """Ids, keys and labels from the URL end up in text columns, and PostgreSQL's refuse NUL."""
    if "\x00" in request.url.path or b"%00" in request.scope["query_string"]:
        raise BadRequest("the URL contains a NUL character")


async def own_host(request: Request) -> None:
    """A proxy bound to a loopback address answers requests addressed to a loopback name only:
    a web page whose name rebinds to 127.0.0.1 could otherwise POST JSON to its model routes
    (DNS rebinding; the admin routes check the same). Bound elsewhere, any name may reach it."""
    if request.app.state.rlp.settings.host not in LOOPBACK:
        return
    if not addressed_to_loopback(request):
        raise Forbidden(
            f"this proxy listens on a loopback address and answers requests addressed to it by a "
            f"loopback name only, not {request.headers.get('host', '')[:64]!r} (bind it with --host "
            "to be reached by other names)"
        )
