"""The upstream: one pooled HTTP client to an OpenAI-compatible server, and its policy version.

The version is vLLM's `GET /weight_info` (at the server root, beside `/v1`), polled in the
background so that no request waits for it. An upstream without that route (any other
provider) has version None.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from proxy.errors import UpstreamTimeout, UpstreamUnreachable

log = logging.getLogger("rl_proxy.upstream")


class Upstream:
    """An OpenAI-compatible base URL (`http://host:port/v1`) and what the proxy knows of it."""

    def __init__(self, base_url: str, *, timeout: float, connect_timeout: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.root = self.base_url.removesuffix("/v1")
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        )
        self.version: str | None = None
        self._poller: asyncio.Task[None] | None = None

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await self.client.aclose()

    def start_version_polling(self, interval: float) -> None:
        self._poller = asyncio.create_task(self._poll_version(interval), name="weight-version")

    async def refresh_version(self) -> bool:
        """Read the weight version once; False if the upstream has no such route."""
        try:
            resp = await self.client.get(f"{self.root}/weight_info", timeout=5.0)
        except httpx.HTTPError as exc:
            log.warning("weight version not read from %s: %s", self.root, exc)
            return True
        if resp.status_code == 404:
            return False
        if resp.is_success:
            self.version = str(resp.json().get("weight_version"))
        return True

    async def _poll_version(self, interval: float) -> None:
        while await self.refresh_version():
            await asyncio.sleep(interval)
        log.info("upstream %s has no /weight_info: calls get no policy version", self.root)

    async def send(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, stream: bool = False
    ) -> httpx.Response:
        """One request to the upstream; connection trouble becomes a named proxy error."""
        request = self.client.build_request(method, f"{self.base_url}{path}", json=body)
        try:
            return await self.client.send(request, stream=stream)
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"upstream {self.base_url} timed out ({type(exc).__name__})") from exc
        except httpx.HTTPError as exc:
            raise UpstreamUnreachable(f"upstream {self.base_url} unreachable: {exc!r}") from exc
