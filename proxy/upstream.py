"""The upstreams: a pooled HTTP client per OpenAI-compatible server, and its policy version.

Several servers of one model (vLLM replicas) can stand behind one proxy: each session is pinned
to one of them by rendezvous hashing of its id over the live ones (its prefix cache stays warm,
and every proxy of a deployment pins it to the same server without sharing any state). A server
that refuses connections is taken out of rotation, its sessions move (each to where the hash
puts it next), and it is probed every second until it answers again.

aiohttp rather than httpx: under 16+ concurrent calls httpx's connection pool cost about 3 ms of
CPU per request (measured with cProfile while running `make bench`), more than the whole
budget of the proxy. The version is vLLM's `GET /weight_info` (at the server root, beside
`/v1`), polled in the background so that no request waits for it; an upstream without that
route (any other provider) has version None.

With LoRA the trainer loads each new version into vLLM as an adapter named `adapter_name(model,
version)` and sets the weight version to match; a call for the base model is then sent to the
adapter of the version it is stamped with (`Upstream.serving`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import aiohttp
import orjson

from proxy.bridge import CARD
from proxy.errors import ProxyError, UpstreamTimeout, UpstreamUnreachable
from proxy.workers import Marks

log = logging.getLogger("rl_proxy.upstream")

# Stream chunks carry token ids (a first chunk holds the whole prompt's), so lines can be long.
MAX_LINE = 64 * 1024 * 1024
MODELS_RETRY = 10.0
STREAM_GAP_SECONDS = 600.0  # how long a stream that lost token ids makes streams be asked for whole
VERSION_PATIENCE = 30  # version reads in a row that fail before it is worth a warning
VERSION_READ_TIMEOUT = 5.0  # seconds for one read of the version
ANNOUNCE_PATIENCE = 30.0  # seconds the trainer's announce reads again before it is an error


def adapter_name(model: str, version: str) -> str:
    """The name under which the trainer loads a LoRA version of `model` into vLLM."""
    return f"{model}-v{version}"


class UpstreamDown(UpstreamUnreachable):
    """The connection was refused: the request never reached the server, so another may take it."""


class Upstream:
    """An OpenAI-compatible base URL (`http://host:port/v1`) and what the proxy knows of it."""

    def __init__(self, base_url: str, *, timeout: float, connect_timeout: float, api_key: str | None = None) -> None:
        # A user:password@ in the URL is sent as Basic auth and kept out of the URL itself, so
        # that no error, log line, /healthz or record shows it.
        parts = urlsplit(base_url.rstrip("/"))
        userinfo, _, host = parts.netloc.rpartition("@")
        self.base_url = urlunsplit(parts._replace(netloc=host))
        self.root = self.base_url.removesuffix("/v1")
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=timeout)
        self.version: str | None = None
        self.models: dict[str, int | None] = {}  # served model -> its context length, if known
        self.adapters: set[str] = set()  # the LoRA adapters it serves
        self.bridges = False  # whether it makes token-in's bridges itself (proxy/bridge.py): its model cards say
        # Why streamed calls are asked for whole and replayed to the client as a stream
        # (forwarding.open_upstream), if they are: one of its streams sent text without token ids.
        self.stream_gap: str | None = None
        self._gap_until = 0.0
        self._gap_version: str | None = None
        self._models_read_at = -MODELS_RETRY
        self._session: aiohttp.ClientSession | None = None
        # The upstream's own key, if it needs one; a client's key names its session and stays here.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if userinfo and not api_key:
            user, _, password = userinfo.partition(":")
            self._headers["Authorization"] = aiohttp.BasicAuth(unquote(user), unquote(password)).encode()
        self._poller: asyncio.Task[None] | None = None
        self._version_misses = 0
        # Reads of the version in the order they were sent: an older read answered late (the
        # poll's, sent just before a swap) must not undo a newer one (the trainer's announce).
        self._version_reads_sent = self._version_read_applied = 0
        self._no_version_said = False  # a /weight_info without a version is said once
        self.alive = True

    def note_stream_gap(self, why: str) -> None:
        """One of its streams sent text without token ids: streams are asked for whole until
        the policy version changes or STREAM_GAP_SECONDS pass, whichever comes first."""
        if self.stream_gap is None:
            log.warning(
                "upstream %s: a stream lost token ids (%s); streams are asked for whole for now", self.base_url, why
            )
        self.stream_gap, self._gap_version = why, self.version
        self._gap_until = time.monotonic() + STREAM_GAP_SECONDS

    def streams_whole(self) -> bool:
        if self.stream_gap is not None and (time.monotonic() > self._gap_until or self.version != self._gap_version):
            log.warning("upstream %s: streams are streamed again", self.base_url)
            self.stream_gap = None
        return self.stream_gap is not None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # created inside the running loop, as aiohttp requires
            self._session = aiohttp.ClientSession(
                timeout=self.timeout,
                headers=self._headers,
                # Below uvicorn's 5 s (vLLM's server): an idle connection is dropped here before
                # the server closes it under a request being sent.
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4),
                # No cookies: one session carries every rl-proxy session's calls, so an upstream's
                # cookie would pass from one to the next; and filtering a jar costs each request.
                cookie_jar=aiohttp.DummyCookieJar(),
                read_bufsize=MAX_LINE,
                max_line_size=MAX_LINE,
                max_field_size=MAX_LINE,
            )
        return self._session

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self._session is not None:
            await self._session.close()

    def start_version_polling(self, interval: float) -> None:
        self._poller = asyncio.create_task(self._poll_version(interval), name="weight-version")

    async def served_models(self) -> dict[str, int | None]:
        """The served models; while none are known, asked again at most every MODELS_RETRY
        seconds, so that an upstream without /models costs no extra request per call."""
        now = time.monotonic()
        if not self.models and now - self._models_read_at > MODELS_RETRY:
            self._models_read_at = now
            await self.refresh_models()
        return self.models

    async def refresh_models(self) -> bool:
        """Learn the served models and their context lengths (vLLM's `max_model_len`), and the
        LoRA adapters; False (and what was known kept) if they could not be read."""
        try:
            resp = await self.send("GET", "/models")
            body = await self.read(resp)
            if not resp.ok and resp.status != 404:  # 404: no such route, so no models to know of
                raise ProxyError(f"HTTP {resp.status}")
            data = orjson.loads(body) if resp.ok else {}
        except (ProxyError, ValueError) as exc:
            log.warning("served models not read from %s: %s", self.base_url, exc)
            return False
        cards = [m for m in data.get("data") or [] if isinstance(m, dict)]
        self.models = {m["id"]: m.get("max_model_len") for m in cards if not m.get("parent")}
        self.adapters = {m["id"] for m in cards if m.get("parent")}
        self.bridges = any(m.get(CARD) is True for m in cards)
        return True

    def serving(self, model: str, version: str | None) -> str:
        """The name to ask for `model` at `version`: its LoRA adapter, if one is loaded."""
        adapter = adapter_name(model, version) if version is not None else None
        return adapter if adapter in self.adapters else model

    async def refresh_version(self, patient: bool = True) -> bool:
        """Read the weight version; False if the upstream has no such route. `patient` (the poll):
        a failed read is a warning only once VERSION_PATIENCE failed in a row. Not patient (the
        trainer's announce, vLLM paused): a failed read is sent again for ANNOUNCE_PATIENCE
        seconds, then UpstreamUnreachable says so (kept quiet, the old version stamped the calls
        that ended after the swap)."""
        deadline = time.monotonic() + ANNOUNCE_PATIENCE
        while True:
            self._version_reads_sent += 1
            read = self._version_reads_sent
            try:
                timeout = aiohttp.ClientTimeout(total=VERSION_READ_TIMEOUT)
                async with self.session.get(f"{self.root}/weight_info", timeout=timeout) as resp:
                    if resp.status == 404:
                        return False
                    answer = await resp.json(loads=orjson.loads) if resp.ok else None
                break
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                # A busy vLLM (starting, or a long prefill on CPU) answers late: normal, unless it lasts.
                self._version_misses += 1
                if not patient:
                    if time.monotonic() >= deadline:
                        raise UpstreamUnreachable(f"weight version not read from {self.root}: {exc!r}") from exc
                    log.warning("weight version not read from %s (%s): reading again", self.base_url, exc)
                    await asyncio.sleep(0.1)
                    continue
                loud = self._version_misses == VERSION_PATIENCE
                why = "weight version not read from %s (%d times in a row): %s"
                log.log(logging.WARNING if loud else logging.DEBUG, why, self.base_url, self._version_misses, exc)
                return True
        found = answer.get("weight_version") if isinstance(answer, dict) else None
        version = None if found is None else str(found)
        if answer is not None and version is None and not self._no_version_said:
            # Not the string "None": calls are recorded with no version, which training treats as
            # unknown, and this is said once.
            self._no_version_said = True
            log.warning("%s/weight_info names no weight_version: calls are recorded without one", self.root)
        fresh = version is not None and read > self._version_read_applied
        # A new version may be a LoRA adapter: known before calls are stamped with it (else they
        # would go to the base model stamped as the adapter); if not, read again next time.
        if fresh and version != self.version and not await self.refresh_models():
            return True
        if fresh and read > self._version_read_applied:
            self.version, self._version_read_applied = version, read
        if self._version_misses >= VERSION_PATIENCE:
            log.warning("weight version read from %s again", self.base_url)
        self._version_misses = 0
        return True

    async def _poll_version(self, interval: float) -> None:
        while await self.refresh_version():
            await asyncio.sleep(interval)
        log.info("upstream %s has no /weight_info: calls get no policy version", self.base_url)

    async def send(
        self, method: str, path: str, body: dict[str, Any] | None = None, at_root: bool = False
    ) -> aiohttp.ClientResponse:
        """Start one request (to `/v1{path}`, or `{path}` at the server root); the caller reads (or
        streams) and releases the response. Connection trouble becomes a named proxy error."""
        data = None if body is None else orjson.dumps(body)
        headers = {"Content-Type": "application/json"} if body is not None else None
        url = f"{self.root if at_root else self.base_url}{path}"
        try:
            try:
                return await self.session.request(method, url, data=data, headers=headers)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if isinstance(exc, aiohttp.ClientConnectorError):  # no connection at all: below
                    raise
                # A pooled connection the server had closed, found closed before the request was
                # answered or reset under it (the soak saw "Can not write request body"): once more.
                return await self.session.request(method, url, data=data, headers=headers)
        except TimeoutError as exc:
            raise UpstreamTimeout(f"upstream {self.base_url} timed out") from exc
        except aiohttp.ClientConnectorError as exc:  # nothing was sent: the server is not there
            if self.alive:
                log.error("upstream %s is down (%s): out of rotation until it answers", self.base_url, exc)
            self.alive = False
            raise UpstreamDown(f"upstream {self.base_url} unreachable: {exc!r}") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamUnreachable(f"upstream {self.base_url} unreachable: {exc!r}") from exc

    async def read(self, resp: aiohttp.ClientResponse) -> bytes:
        """A whole response body; a read that stalls or breaks becomes a named proxy error."""
        try:
            return await resp.read()
        except TimeoutError as exc:
            raise UpstreamTimeout(f"upstream {self.base_url} timed out while answering") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamUnreachable(f"upstream {self.base_url} broke off its answer: {exc!r}") from exc
        finally:
            resp.release()


class Upstreams:
    """The servers behind the proxy (see the module docstring); one, most of the time."""

    def __init__(self, members: list[Upstream], marks: Marks | None = None) -> None:
        self.members = members
        self._prober: asyncio.Task[None] | None = None
        self.marks = marks  # shared by the workers of `serve --workers N` (proxy/workers.py), if any
        self._heard = b""  # a worker (re)started after an announce reads the version before its first call
        self._hearing = asyncio.Lock()

    @staticmethod
    def urls(value: str) -> list[str]:
        """The base URLs in `--upstream`: comma-separated."""
        return [url.strip() for url in value.split(",") if url.strip()]

    @classmethod
    def from_urls(
        cls,
        urls: str,
        *,
        timeout: float,
        connect_timeout: float,
        api_key: str | None,
        marks: Marks | None = None,
    ) -> Upstreams:
        members = [
            Upstream(url, timeout=timeout, connect_timeout=connect_timeout, api_key=api_key) for url in cls.urls(urls)
        ]
        return cls(members, marks)

    def live(self) -> list[Upstream]:
        """The members in rotation; all of them when none is (a call then fails on its own)."""
        return [u for u in self.members if u.alive] or self.members

    def for_session(self, session_id: str) -> Upstream:
        """The session's server: the highest hash of (server, session) among the live ones."""
        live = self.live()
        if len(live) == 1:
            return live[0]
        return max(live, key=lambda u: hashlib.sha256(f"{u.base_url}|{session_id}".encode()).digest())

    @property
    def first(self) -> Upstream:
        return self.live()[0]

    async def start(self, interval: float) -> None:
        for member in self.members:
            await member.refresh_models()
            member.start_version_polling(interval)
        self._prober = asyncio.create_task(self._probe(interval), name="upstream-probe")

    async def _probe(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            for member in [u for u in self.members if not u.alive]:
                try:
                    resp = await member.send("GET", "/models")
                    resp.release()
                except ProxyError:
                    continue
                if resp.ok:
                    member.alive = True
                    log.warning("upstream %s answers again: back in rotation", member.base_url)

    async def refresh_versions(self) -> None:
        """Read every member's version now (the trainer's announce, taken while vLLM is paused),
        and mark it for the other workers, if any: each reads the version again before it stamps
        its next call, so no call that starts after the announce is answered carries the old
        version, whichever worker serves it."""
        await self._read_versions()
        if self.marks is not None:
            self._heard = self.marks.announce()

    async def heard(self) -> bool:
        """Before a call is stamped, and before it is recorded: if another worker took an
        announce since, read the versions again first (True). The calls meanwhile wait for the
        same read; one that fails raises, and the next call reads again."""
        if self.marks is None or self.marks.announced() == self._heard:
            return False
        async with self._hearing:
            said = self.marks.announced()
            if said == self._heard:
                return True
            await self._read_versions()
            self._heard = said
            return True

    async def _read_versions(self) -> None:
        await asyncio.gather(*(u.refresh_version(patient=False) for u in self.members))

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
        for member in self.members:
            await member.close()
