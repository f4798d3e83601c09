"""Anthropic Messages: `POST /v1/messages` and `/v1/messages/count_tokens`, recorded at token level.

vLLM's own `/v1/messages` returns no token ids, so a Messages request is translated to Chat
Completions with litellm's in-process adapter (no network), sent upstream like any chat call
(prompt ids, sampled ids and logprobs captured), and the answer translated back: one message by
litellm, or Anthropic's SSE event sequence (message_start, content_block_start/delta/stop,
message_delta, message_stop) for a stream, written chunk by chunk by `_MessageEvents`. The call is
recorded with the request and the answer in Anthropic's shape. Errors answer in Anthropic's error shape (see errors.py).
Model names and completion limits are fitted to the backend in forwarding.fit_to_backend.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from functools import cache
from typing import Any

import aiohttp
import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from proxy import openapi
from proxy.bodies import check_types, read_json
from proxy.capture import LEFT_TO_CHAT, REASONING, Capture, reasoning_for_litellm
from proxy.errors import BadRequest, anthropic_error_body, json_response
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
from proxy.litellm_bridge import imported, jsonable, litellm, refusals
from proxy.state import ProxyState

API = "anthropic.messages"
router = APIRouter()


@cache
def _adapter() -> Any:
    litellm()
    from litellm.llms.anthropic.pass_through.adapters.transformation import AnthropicAdapter

    return AnthropicAdapter()


# What a Messages request becomes upstream. litellm's adapter passes any other field through
# as it came (`n: 50` past the 16-choice limit, `logit_bias`, vLLM's own sampling fields): those
# are dropped, and recorded as dropped (rewrites), never sent to vLLM blindly.
CHAT_FIELDS = frozenset(
    (
        "model",
        "messages",
        "max_tokens",
        "user",
        "stop",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "reasoning_effort",
        "parallel_tool_calls",
        "response_format",
    )
)


def to_chat(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    """A Messages request as a Chat Completions request, the adapter's tool-name map, and the
    fields dropped on the way (not Messages fields, or none that this backend samples with)."""
    check_types(body)
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise BadRequest("'messages' is required and must be a non-empty list", param="messages")
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
        raise BadRequest("'max_tokens' is required and must be a positive integer", param="max_tokens")
    for tool in body.get("tools") or []:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):  # web_search, code_execution, computer, bash, ...
            raise BadRequest(f"hosted tool type {kind!r} cannot run on this backend; only custom tools", param="tools")
    contents = [m.get("content") for m in body["messages"] if isinstance(m, dict)]
    for block in [b for content in contents if isinstance(content, list) for b in content]:
        if isinstance(block, dict) and block.get("type") in ("image", "document"):
            raise BadRequest(f"content blocks of type {block['type']!r} are not supported by this backend")
    # litellm changes what it is given, and `body` is recorded: it gets a copy, made by orjson (a
    # body read as JSON is JSON): 0.42 ms at 160 turns of an agent's history, deepcopy 2.36.
    fresh = orjson.loads(orjson.dumps(body))
    try:
        chat, tool_map = _adapter().translate_completion_input_params_with_tool_mapping(fresh)
    except refusals() as exc:
        raise BadRequest(f"cannot translate this Messages request: {exc}") from exc
    dropped = {name: chat.pop(name) for name in list(chat) if name not in CHAT_FIELDS}
    return jsonable(chat), tool_map, jsonable(dropped)


def object_arguments(raw: str) -> str:
    """Anthropic's tool_use `input` must be an object, and clients refuse anything else; a small
    model may well write `"2,3"`, `[1, 2]` or broken JSON. Such arguments are passed on, unparsed,
    as `{"_raw_arguments": "<what the model wrote>"}` (the recorded tokens are untouched)."""
    try:
        parsed = orjson.loads(raw or "{}")
    except orjson.JSONDecodeError:
        parsed = None
    return (raw or "{}") if isinstance(parsed, dict) else orjson.dumps({"_raw_arguments": raw}).decode()


def _object_arguments(chat_response: dict[str, Any]) -> None:
    for choice in chat_response.get("choices") or []:
        for call in (choice.get("message") or {}).get("tool_calls") or []:
            function = call.get("function") or {}
            function["arguments"] = object_arguments(function.get("arguments") or "")


def to_message(chat_response: dict[str, Any], tool_map: dict[str, str]) -> dict[str, Any]:
    """The Anthropic message for a chat answer (which it fixes up in place)."""
    from litellm.types.utils import ModelResponse

    fields = {k: v for k, v in reasoning_for_litellm(chat_response).items() if k not in LEFT_TO_CHAT}
    _object_arguments(fields)
    for choice in fields.get("choices") or []:  # vLLM says "stop" after a forced tool call
        if (choice.get("message") or {}).get("tool_calls") and choice.get("finish_reason") == "stop":
            choice["finish_reason"] = "tool_calls"
    message = _adapter().translate_completion_output_params(ModelResponse(**fields), tool_map)
    return dict(jsonable(message))


@router.post("/messages", openapi_extra=openapi.MESSAGES)
async def messages(request: Request) -> Response:
    state: ProxyState = request.app.state.rlp
    body = await read_json(request, state.settings)
    await imported()
    chat, tool_map, dropped = to_chat(body)
    session = await session_for(request, state)
    stream = bool(body.get("stream"))
    chat["stream"] = stream
    ask_for_tokens(state, chat)
    if stream:
        chat["stream_options"] = {"include_usage": True}
    call = await Call.start(state, API, session, body, stream)
    call.rewrites = {name: [value, None] for name, value in dropped.items()} | await fit_to_backend(
        state, chat, session
    )
    await call.plan_prompt(chat)
    try:
        resp, data = await open_upstream(call, "/chat/completions", chat)
    except UpstreamError as exc:
        return json_response(anthropic_error_body(exc.status, exc.message), exc.status)
    if stream:
        return StreamingResponse(_relay(call, resp, data, tool_map, body["model"]), media_type="text/event-stream")
    return json_response(await call.finish(data, resp.status, lambda d: to_message(d, tool_map), request))


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


class _MessageEvents:
    """Anthropic's stream events for a streamed chat answer, written straight from its chunks:
    message_start; a content block for each run of thinking, of text, and for each tool call
    (content_block_start, deltas, content_block_stop); message_delta with the stop reason and
    usage; message_stop. A tool call's arguments are held back and sent whole, as a JSON object
    (`object_arguments`), when its block closes: a client parses the partial JSON as it comes
    and fails on arguments that are not an object."""

    def __init__(self, model: str, tool_map: dict[str, str]) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model, self.tool_map = model, tool_map
        self.started = False
        self.index = -1  # of the newest block
        self.open: str | None = None  # the open block: "text", "thinking" or "tool"
        self.arguments: dict[int, list[str]] = {}  # each tool call's, by its index in the stream
        self.tool = 0  # the index of the newest tool call
        self.finish: str | None = None
        self.usage: dict[str, Any] = {}

    def add(self, chunk: dict[str, Any]) -> list[bytes]:
        out = self._start()
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:  # a Messages answer has one
            delta = choice.get("delta") or {}
            thinking = next((delta[k] for k in REASONING if delta.get(k)), None)
            if thinking:
                out += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": thinking}))
            if delta.get("content"):
                out += self._block("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                i, function = call.get("index", 0), call.get("function") or {}
                if i not in self.arguments:
                    name = function.get("name") or ""
                    block: dict[str, Any] = {
                        "type": "tool_use",
                        "id": call.get("id") or f"toolu_{i}",
                        "name": self.tool_map.get(name, name),
                        "input": {},
                    }
                    out += self._block("tool", block, new=True)
                    self.arguments[i], self.tool = [], i
                self.arguments[i].append(function.get("arguments") or "")
            self.finish = choice.get("finish_reason") or self.finish
        return out

    def end(self) -> list[bytes]:
        out = self._start()
        if self.index < 0:
            out += self._block("text", {"type": "text", "text": ""})  # an empty answer: one empty text block
        out += self._close()
        stop = STOP_REASONS.get(self.finish or "stop", "end_turn")
        if self.arguments and stop == "end_turn":  # as in to_message: vLLM says "stop" after a forced call
            stop = "tool_use"
        usage = {
            "input_tokens": self.usage.get("prompt_tokens", 0),
            "output_tokens": self.usage.get("completion_tokens", 0),
        }
        out.append(_sse("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": None}, "usage": usage}))
        return [*out, _sse("message_stop", {})]

    def _start(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return [_sse("message_start", {"message": message})]

    def _block(self, kind: str, block: dict[str, Any], new: bool = False) -> list[bytes]:
        if self.open == kind and not new:
            return []
        out = self._close()
        self.index, self.open = self.index + 1, kind
        return [*out, _sse("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _sse("content_block_delta", {"index": self.index, "delta": delta})

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "tool":
            whole = object_arguments("".join(self.arguments[self.tool]))
            out.append(self._delta({"type": "input_json_delta", "partial_json": whole}))
        self.open = None
        return [*out, _sse("content_block_stop", {"index": self.index})]


def _relay(
    call: Call, resp: aiohttp.ClientResponse, data: Any, tool_map: dict[str, str], model: str
) -> AsyncIterator[bytes]:
    """Anthropic SSE events from the upstream's chunks; message_stop reaches the client once the
    call is recorded."""
    capture = Capture()
    events = _MessageEvents(model, tool_map)

    async def translated() -> AsyncIterator[bytes]:
        async for chunk in upstream_chunks(call, resp, data):
            capture.add_chunk(chunk)
            for event in events.add(chunk):
                yield event
        for event in events.end():
            yield event

    def failed(message: str, kind: str, _answer: Any) -> bytes:
        return b"event: error\ndata: " + orjson.dumps(anthropic_error_body(502, message)) + b"\n\n"

    return relay(
        call,
        resp,
        capture,
        translated(),
        held=lambda event: event.startswith(b"event: message_stop\n"),
        answer=lambda: {**to_message(capture.assembled(True), tool_map), "id": events.id},
        failed=failed,
    )


@router.post("/messages/count_tokens", openapi_extra=openapi.MESSAGES)
async def count_tokens(request: Request) -> Response:
    """Input tokens of a Messages request, as the upstream's chat template renders them."""
    state: ProxyState = request.app.state.rlp
    body = await read_json(request, state.settings)
    await imported()
    chat, _, _ = to_chat({"max_tokens": 1, **body})
    await fit_to_backend(state, chat)
    tokenize = {"model": chat["model"], "messages": chat["messages"], "add_generation_prompt": True}
    if chat.get("tools"):
        tokenize["tools"] = chat["tools"]
    upstream = state.upstreams.first
    resp = await upstream.send("POST", "/tokenize", tokenize, at_root=True)
    raw = await upstream.read(resp)
    data = orjson.loads(raw)
    if not resp.ok:
        message = str((data.get("error") or {}).get("message", data)) if isinstance(data, dict) else str(data)
        return json_response(anthropic_error_body(resp.status, message), resp.status)
    return json_response({"input_tokens": int(data["count"])})
