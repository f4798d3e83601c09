"""OpenAI Chat Completions and (text) Completions, recorded at token level; GET /models.

Every upstream call asks vLLM for `return_token_ids` and logprobs; the client gets back only what it
asked for. A call is committed to the store before its answer (or a stream's final `[DONE]`) is
released. Anthropic Messages live in anthropic.py, the Responses API in responses.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from proxy import openapi
from proxy.bodies import read_json
from proxy.capture import Capture, client_view
from proxy.errors import BadRequest, error_body, json_response
from proxy.forwarding import (
    Call,
    UpstreamError,
    ask_for_tokens,
    fit_to_backend,
    open_upstream,
    relay,
    session_for,
    upstream_chunks,
)
from proxy.state import ProxyState

router = APIRouter()


@dataclass(frozen=True)
class Api:
    name: str
    path: str
    input_field: str
    chat: bool


CHAT = Api("chat.completions", "/chat/completions", "messages", chat=True)
COMPLETIONS = Api("completions", "/completions", "prompt", chat=False)


@router.post("/chat/completions", openapi_extra=openapi.CHAT)
async def chat_completions(request: Request) -> Response:
    return await forward(request, CHAT)


@router.post("/completions", openapi_extra=openapi.COMPLETIONS)
async def completions(request: Request) -> Response:
    return await forward(request, COMPLETIONS)


@router.get("/models")
async def models(request: Request) -> Response:
    upstream = request.app.state.rlp.upstreams.first
    resp = await upstream.send("GET", "/models")
    return Response(await upstream.read(resp), resp.status, media_type="application/json")


def validate(body: dict[str, Any], api: Api, max_choices: int) -> None:
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    value = body.get(api.input_field)
    valid = isinstance(value, list) and value if api.chat else isinstance(value, (str, list)) and value
    if not valid:
        kind = "a non-empty list" if api.chat else "a non-empty string or list"
        raise BadRequest(f"'{api.input_field}' is required and must be {kind}", param=api.input_field)
    if not api.chat and isinstance(value, list) and len(value) > 1 and not all(isinstance(t, int) for t in value):
        raise BadRequest(  # a list of ints is one prompt as token ids; a list of prompts is a batch
            "'prompt' must be one prompt (a string, or a list of token ids): send one request per prompt, so that "
            "each is recorded with its own prompt token ids",
            param="prompt",
        )
    if body.get("echo"):  # on chat too (a vLLM extension): the echoed text comes without ids
        raise BadRequest("'echo' is not supported: the prompt's own tokens are in the request", param="echo")
    if body.get("include_reasoning") is False:  # vLLM then leaves the token ids out of its stream
        raise BadRequest(
            "'include_reasoning': false is not supported: the record needs every token's id", param="include_reasoning"
        )
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    # A call's recorded size is bounded by n x the completion cap, so n has a limit too.
    n = body.get("n")
    if n is not None and (type(n) is not int or not 1 <= n <= max_choices):
        raise BadRequest(f"'n' must be an integer from 1 to {max_choices} (RLP_MAX_CHOICES)", param="n")


async def forward(request: Request, api: Api) -> Response:
    state: ProxyState = request.app.state.rlp
    body = await read_json(request, state.settings)
    validate(body, api, state.settings.max_choices)
    session = await session_for(request, state)
    stream = bool(body.get("stream"))
    call = await Call.start(state, api.name, session, body, stream)
    keep_tokens = bool(body.get("return_token_ids"))
    keep_logprobs = bool(body.get("logprobs")) if api.chat else body.get("logprobs") is not None
    upstream_body = dict(body)
    ask_for_tokens(state, upstream_body, api.chat)
    given = body.get("stream_options")
    options: dict[str, Any] = given if isinstance(given, dict) else {}
    keep_usage = bool(options.get("include_usage"))
    if stream:  # the usage chunk lets the capture check its own count
        upstream_body["stream_options"] = {**options, "include_usage": True}
    call.rewrites = await fit_to_backend(state, upstream_body, session)
    if api.chat:
        await call.plan_prompt(upstream_body)
    try:
        resp, data = await open_upstream(call, api.path, upstream_body)
    except UpstreamError as exc:  # already in the OpenAI shape: passed through as is
        return json_response(exc.body, exc.status)
    if stream:
        relay = _relay(call, api, resp, data, keep_tokens, keep_logprobs, keep_usage)
        return StreamingResponse(relay, media_type="text/event-stream")
    answer = await call.finish(data, resp.status, lambda d: client_view(d, keep_tokens, keep_logprobs), request)
    return json_response(answer, resp.status)


def _relay(
    call: Call,
    api: Api,
    resp: aiohttp.ClientResponse,
    data: Any,
    keep_tokens: bool,
    keep_logprobs: bool,
    keep_usage: bool,
) -> AsyncIterator[bytes]:
    """The upstream's SSE chunk by chunk, then `[DONE]` once the call is recorded."""
    capture = Capture()

    async def events() -> AsyncIterator[bytes]:
        async for chunk in upstream_chunks(call, resp, data):
            capture.add_chunk(chunk)
            if not keep_usage:
                if not chunk.get("choices") and chunk.get("usage"):
                    continue  # the usage chunk the proxy asked for
                chunk.pop("usage", None)
            yield b"data: " + orjson.dumps(client_view(chunk, keep_tokens, keep_logprobs)) + b"\n\n"

    def failed(message: str, kind: str, _answer: Any) -> bytes:
        return b"data: " + orjson.dumps(error_body(message, kind, 502 if kind == "upstream_error" else None)) + b"\n\n"

    return relay(
        call,
        resp,
        capture,
        events(),
        held=lambda _: False,
        answer=lambda: capture.assembled(api.chat),
        failed=failed,
        done=b"data: [DONE]\n\n",
    )
