"""OpenAI Chat Completions and (text) Completions, recorded at token level; GET /models.

Every upstream call asks for `return_token_ids` and logprobs; the client gets back only what it
asked for. A call is committed to the store before its answer (or a stream's final `[DONE]`) is
released. Responses API and Anthropic Messages come with issue 3, in modules of their own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from proxy.capture import Capture, client_view
from proxy.errors import (
    BadRequest,
    BodyTooLarge,
    ProxyError,
    Unauthorized,
    UpstreamUnreachable,
    error_body,
    json_response,
)
from proxy.sessions import parse_key, request_key
from proxy.state import ProxyState
from recorder import CallRecord, SessionInfo
from recorder.store import utcnow

log = logging.getLogger("rl_proxy.proxy")

router = APIRouter()


@dataclass(frozen=True)
class Api:
    name: str
    path: str
    input_field: str
    chat: bool


CHAT = Api("chat.completions", "/chat/completions", "messages", chat=True)
COMPLETIONS = Api("completions", "/completions", "prompt", chat=False)


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await forward(request, CHAT)


@router.post("/completions")
async def completions(request: Request) -> Response:
    return await forward(request, COMPLETIONS)


@router.get("/models")
async def models(request: Request) -> Response:
    upstream = request.app.state.rlp.upstream
    resp = await upstream.send("GET", "/models")
    return Response(await upstream.read(resp), resp.status, media_type="application/json")


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object, or a 400/413 in the OpenAI error shape."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body of {declared} bytes is over the limit of {limit} bytes")
    raw = b""
    async for part in request.stream():
        raw += part
        if len(raw) > limit:
            raise BodyTooLarge(f"request body is over the limit of {limit} bytes")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, not {type(body).__name__}")
    return body


def validate(body: dict[str, Any], api: Api) -> None:
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    value = body.get(api.input_field)
    valid = isinstance(value, list) and value if api.chat else isinstance(value, (str, list)) and value
    if not valid:
        kind = "a non-empty list" if api.chat else "a non-empty string or list"
        raise BadRequest(f"'{api.input_field}' is required and must be {kind}", param=api.input_field)
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be a boolean", param="stream")


async def session_for(request: Request, state: ProxyState) -> SessionInfo:
    key = request_key(request)
    found = await state.store.session_by_key(key)
    if found is not None:
        return found
    if not state.settings.create_sessions:
        raise Unauthorized(f"unknown session key {key[:8]!r}...: create it through the admin API")
    return await state.store.resolve_session(parse_key(key))


@dataclass
class Call:
    """What is known of a call before its answer: enough to record it however it ends."""

    state: ProxyState
    api: Api
    session: SessionInfo
    seq: int
    request: dict[str, Any]
    stream: bool
    version: str | None

    def __post_init__(self) -> None:
        self.started = utcnow()

    def record(
        self, capture: Capture, response: dict[str, Any] | None, status: int, error: str | None = None
    ) -> CallRecord:
        state = self.state
        call = CallRecord(
            session_id=self.session.id,
            seq=self.seq,
            api=self.api.name,
            model=str(self.request.get("model")),
            upstream=state.upstream.base_url,
            stream=self.stream,
            request=self.request,
            response=response,
            ok=error is None,
            http_status=status,
            error=error,
            prompt_token_ids=capture.prompt_token_ids,
            completions=capture.completions(),
            policy_version=self.version,
            policy_version_end=state.upstream.version,
            started_at=self.started,
            finished_at=utcnow(),
        )
        state.observe(call)
        return call

    async def commit(self, call: CallRecord) -> None:
        try:
            await self.state.store.record(call)
        except Exception as exc:
            raise ProxyError(f"the call could not be recorded, so it is not answered: {exc}") from exc


async def forward(request: Request, api: Api) -> Response:
    state: ProxyState = request.app.state.rlp
    body = await read_json(request, state.settings.max_body_bytes)
    validate(body, api)
    session = await session_for(request, state)
    stream = bool(body.get("stream"))
    call = Call(state, api, session, state.store.next_seq(session.id), body, stream, state.upstream.version)
    keep_tokens = bool(body.get("return_token_ids"))
    keep_logprobs = bool(body.get("logprobs")) if api.chat else body.get("logprobs") is not None
    upstream_body = {**body, "return_token_ids": True}
    if api.chat:
        upstream_body["logprobs"] = True
    elif body.get("logprobs") is None:
        upstream_body["logprobs"] = 0
    try:
        resp = await state.upstream.send("POST", api.path, upstream_body)
        raw = b"" if stream and resp.ok else await state.upstream.read(resp)
    except ProxyError as exc:
        await call.commit(call.record(Capture(), None, exc.status, exc.message))
        raise
    if not resp.ok:
        return await _upstream_error(call, resp.status, raw)
    if stream:
        return StreamingResponse(_relay(call, resp, keep_tokens, keep_logprobs), media_type="text/event-stream")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        await call.commit(call.record(Capture(), None, 502, "upstream answered with invalid JSON"))
        raise UpstreamUnreachable(f"upstream answered with invalid JSON: {exc}") from exc
    capture = Capture()
    capture.add_response(data)
    client_view(data, keep_tokens, keep_logprobs)
    await call.commit(call.record(capture, data, resp.status))
    return json_response(data, resp.status)


async def _upstream_error(call: Call, status: int, raw: bytes) -> Response:
    """Pass the upstream's own error through (it is already in the OpenAI shape) and record it."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        data = error_body(raw.decode(errors="replace")[:2000], "upstream_error", status)
    message = str((data.get("error") or {}).get("message", data)) if isinstance(data, dict) else str(data)
    await call.commit(call.record(Capture(), data, status, message))
    return json_response(data, status)


async def _relay(
    call: Call, resp: aiohttp.ClientResponse, keep_tokens: bool, keep_logprobs: bool
) -> AsyncIterator[bytes]:
    """Relay the upstream's SSE chunk by chunk; record before the final `[DONE]`."""
    capture = Capture()
    status: int = 499  # what stands if the client goes away mid-stream
    error: str | None = "client disconnected"
    unrecorded: ProxyError | None = None
    try:
        upstream_error = None
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            chunk = orjson.loads(payload)
            if "error" in chunk:
                upstream_error = str(chunk["error"].get("message", chunk["error"]))
            else:
                capture.add_chunk(chunk)
                client_view(chunk, keep_tokens, keep_logprobs)
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        else:
            upstream_error = upstream_error or "upstream closed the stream before [DONE]"
        status, error = (200, None) if upstream_error is None else (502, upstream_error)
    except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError) as exc:
        status, error = 502, f"upstream stream failed: {exc!r}"
        yield b"data: " + orjson.dumps(error_body(error, "upstream_error", 502)) + b"\n\n"
    finally:
        # Shielded: a client that goes away cancels this generator, and the call must still be
        # recorded with the tokens received so far.
        with anyio.CancelScope(shield=True):
            resp.release()
            try:
                await call.commit(call.record(capture, capture.assembled(call.api.chat), status, error))
            except ProxyError as exc:
                unrecorded = exc
    if unrecorded is not None:
        yield b"data: " + orjson.dumps(error_body(unrecorded.message, unrecorded.type)) + b"\n\n"
    elif error is None:
        yield b"data: [DONE]\n\n"
