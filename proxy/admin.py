"""The admin API (sessions, rewards) behind a bearer token, and /healthz and /metrics.

The token is required unless the proxy listens on loopback only, none was set, and the request
comes from this machine unforwarded (no `Forwarded` / `X-Forwarded-For` / `X-Real-IP`).
"""

from __future__ import annotations

import base64
import ipaddress
import math
import os
import secrets
import uuid
from functools import lru_cache
from typing import Annotated, Any
from urllib.parse import urlsplit

import orjson
from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import AfterValidator, BaseModel, Field, TypeAdapter, field_validator

from proxy.errors import Forbidden, NotFound, ProxyError, Unauthorized, require_json
from proxy.settings import Settings
from proxy.state import ProxyState
from recorder import SessionInfo
from recorder.episodes import EndStatus, EpisodeOutcome, Sampling
from recorder.store import SessionConflict


def _storable(value: dict[str, Any]) -> dict[str, Any]:
    try:  # the store's own JSON encoder: integers past 64 bits, for one, it cannot write
        orjson.dumps(value)
    except TypeError as exc:
        raise ValueError(f"cannot be stored as JSON: {exc}") from exc
    return value


# What the store's columns hold: 256 characters, and no NUL (PostgreSQL text refuses it).
Label = Annotated[str, Field(max_length=256, pattern=r"^[^\x00]*$")]
JsonObject = Annotated[dict[str, Any], AfterValidator(_storable)]


class SessionCreate(BaseModel, extra="forbid"):
    id: Label | None = None
    run: Label | None = None
    task_id: Label | None = None
    group_id: Label | None = None
    policy_model: Label | None = None
    metadata: JsonObject = Field(default_factory=dict)
    sampling: Sampling | None = None


MAX_REWARD = 1e15


class RewardIn(BaseModel):
    value: float
    source: str = Field("admin", max_length=64, pattern=r"^[^\x00]*$")
    seq: int | None = Field(None, ge=1, le=2**31 - 1, description="reward one call (its number in the session) only")
    id: str | None = Field(
        None,
        max_length=64,
        pattern=r"^[^\x00]*$",
        description="the reward's own id: posted again, it counts once",
    )

    @field_validator("value")
    @classmethod
    def finite(cls, v: float) -> float:
        # Bounded so that any number of them sums to a double: PostgreSQL refuses a sum past its
        # range, and every listing of the sessions (their rewards summed) failed for good.
        if not (math.isfinite(v) and abs(v) <= MAX_REWARD):
            raise ValueError(f"reward must be a finite number between -{MAX_REWARD:g} and {MAX_REWARD:g}")
        return v


class Conflict(ProxyError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


def _state(request: Request) -> ProxyState:
    state: ProxyState = request.app.state.rlp
    return state


FORWARDING_HEADERS = ("forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "x-real-ip", "via")


async def require_admin(request: Request) -> None:
    check_admin(request, _state(request).settings)
    if request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers:
        require_json(request)


def check_admin(request: Request, settings: Settings, basic: bool = False) -> None:
    """Without a token, only a request from this machine itself gets in: a loopback peer that no
    reverse proxy forwarded (a proxy on this machine forwarding the world is a loopback peer),
    addressed to a loopback name (a web page that rebinds its own name to 127.0.0.1 is not).
    A best effort: a forwarder that adds none of these headers is not told apart. The token comes
    as a bearer token or, with `basic` (the viewer: what a browser can send), as the password of
    HTTP basic auth. A request that changes something and comes from a web page of another
    origin (its `Origin`, or `Sec-Fetch-Site`) is refused whatever it carries: a page can send a
    simple POST to a loopback address without a preflight."""
    if request.method not in ("GET", "HEAD", "OPTIONS"):
        origin, site = request.headers.get("origin"), request.headers.get("sec-fetch-site")
        own = f"{request.url.scheme}://{request.headers.get('host', '')}"
        if (origin is not None and origin != own) or site in ("cross-site", "same-site"):
            raise Forbidden(
                f"admin requests from a web page of another origin are refused (Origin {origin!r}, "
                f"Sec-Fetch-Site {site!r})"
            )
    forwarded = any(name in request.headers for name in FORWARDING_HEADERS)
    addressed = names_loopback(request.headers.get("host", ""))
    local = request.client is not None and is_loopback(request.client.host) and addressed
    if settings.admin_open and local and not forwarded:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if basic and scheme.lower() == "basic":
        try:
            token = base64.b64decode(token.strip(), validate=True).decode("latin-1").partition(":")[2]
        except ValueError:
            token = ""
    elif scheme.lower() != "bearer":
        token = ""
    if not token or not settings.admin_token:
        why = "a forwarded request or one from another machine" if settings.admin_open else "this"
        raise Unauthorized(
            f"{why} needs the admin token (--admin-token): 'Authorization: Bearer <token>'"
            + (", or the token as the password of basic auth" if basic else "")
        )
    # As bytes: a header is read as latin-1, and compare_digest refuses non-ASCII text (a 500).
    if not secrets.compare_digest(token.strip().encode("latin-1"), settings.admin_token.encode()):
        raise Unauthorized("wrong admin token")


@lru_cache(maxsize=256)  # asked on every model call, of the few Host values clients send
def names_loopback(host_header: str) -> bool:
    """Whether a Host header names this machine's loopback: `localhost` or a loopback address
    (a web page whose own name rebinds to 127.0.0.1 names itself)."""
    host = urlsplit("//" + host_header).hostname or ""
    return host == "localhost" or is_loopback(host)


def is_loopback(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None  # ::ffff:127.0.0.1
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


SESSION = TypeAdapter(SessionInfo)


def session_json(info: SessionInfo, request: Request | None = None) -> dict[str, Any]:
    """A session as the admin API shows it: with its key and base URL only to its creator."""
    out: dict[str, Any] = SESSION.dump_python(info, mode="json", exclude={"key"})
    if request is not None:
        out["key"] = info.key
        out["base_url"] = f"{str(request.base_url).rstrip('/')}/v1"
    return out


admin = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


@admin.post("/sessions", status_code=201)
async def create_session(body: SessionCreate, request: Request) -> dict[str, Any]:
    """A new session; its key (unguessable) is the API key the harness should use."""
    info = SessionInfo(
        id=body.id or uuid.uuid4().hex,
        key=f"rlp-{secrets.token_urlsafe(24)}",
        run=body.run,
        task_id=body.task_id,
        group_id=body.group_id,
        policy_model=body.policy_model,
        metadata=body.metadata,
        sampling=body.sampling,
    )
    try:
        created = await _state(request).store.create_session(info)
    except SessionConflict as exc:
        raise Conflict(str(exc)) from exc
    return session_json(created, request)


@admin.get("/sessions")
async def list_sessions(
    request: Request, run: str | None = None, limit: Annotated[int, Query(ge=1, le=100_000)] = 1000
) -> dict[str, Any]:
    sessions = await _state(request).store.list_sessions(run=run, limit=limit)
    return {"object": "list", "data": [session_json(s) for s in sessions]}


async def _existing(request: Request, session_id: str) -> SessionInfo:
    info = await _state(request).store.get_session(session_id)
    if info is None:
        raise NotFound(f"no session {session_id!r}")
    return info


@admin.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> dict[str, Any]:
    return session_json(await _existing(request, session_id))


@admin.post("/sessions/{session_id}/reward")
async def post_reward(session_id: str, body: RewardIn, request: Request) -> dict[str, Any]:
    await _existing(request, session_id)
    await _state(request).store.add_reward(session_id, body.value, body.source, body.seq, body.id)
    return session_json(await _existing(request, session_id))


class SessionEnd(BaseModel, extra="forbid"):
    status: EndStatus = "ended"
    outcome: EpisodeOutcome | None = Field(None, description="how the episode went (harness runners)")


@admin.post("/sessions/{session_id}/end")
async def end_session(session_id: str, request: Request, body: SessionEnd | None = None) -> dict[str, Any]:
    await _existing(request, session_id)
    body = body or SessionEnd()
    _state(request).ended(await _state(request).store.end_session(session_id, body.status, body.outcome))
    return session_json(await _existing(request, session_id))


@admin.post("/policy_version/refresh")
async def refresh_version(request: Request) -> dict[str, Any]:
    """Read the upstream's weight version now: the trainer calls this during a hot swap, before
    resuming vLLM, so that no call starting after the swap is stamped with the old version."""
    upstreams = _state(request).upstreams
    await upstreams.refresh_versions()
    return {"policy_version": upstreams.first.version, "versions": {u.base_url: u.version for u in upstreams.members}}


ops = APIRouter()


@ops.get("/healthz")
async def healthz(request: Request) -> dict[str, Any]:
    state = _state(request)
    await state.upstreams.heard()
    return {
        "status": "ok",
        "pid": os.getpid(),  # which worker of `serve --workers N` answered
        "upstream": state.upstreams.first.base_url,
        "policy_version": state.upstreams.first.version,
        # why streams are asked for whole, if they are
        "stream_gap": state.upstreams.first.stream_gap if state.upstreams.first.streams_whole() else None,
        "upstreams": [
            {"url": u.base_url, "alive": u.alive, "policy_version": u.version, "bridges": u.bridges}
            for u in state.upstreams.members
        ],
        "recorder_queue": state.store.queue_depth,
        "record_failures": state.store.write_failures,
        "caches": state.caches(),  # each per-process cache's entries, bytes and budget
    }


@ops.get("/metrics")
async def metrics(request: Request) -> Response:
    state = _state(request)
    state.gauge()
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")
