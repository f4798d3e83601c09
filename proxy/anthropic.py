"""Anthropic Messages: `POST /v1/messages` and `/v1/messages/count_tokens`, recorded at token level.

vLLM's own `/v1/messages` returns no token ids, so a Messages request is translated to Chat
Completions with litellm's in-process adapter (no network), sent upstream like any chat call
(prompt ids, sampled ids and logprobs captured), and the answer translated back: one message, or
Anthropic's whole SSE event sequence (message_start, content_block_start/delta/stop,
message_delta, message_stop) for a stream. The call is recorded with the request and the answer
in Anthropic's shape. Errors answer in Anthropic's error shape (see errors.py).
Model names and completion limits are fitted to the backend in forwarding.fit_to_backend.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from functools import cache
from typing import Any

import aiohttp
import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from proxy import openapi
from proxy.capture import Capture, nothing_to_translate, reasoning_for_litellm
from proxy.errors import BadRequest, anthropic_error_body, json_response
from proxy.forwarding import (
    Call,
    StreamBroken,
    UpstreamError,
    ask_for_tokens,
    check_types,
    fit_to_backend,
    open_upstream,
    read_json,
    relay,
    session_for,
    upstream_chunks,
)
from proxy.litellm_bridge import jsonable, litellm
from proxy.state import ProxyState

API = "anthropic.messages"
router = APIRouter()


@cache
def _adapter() -> Any:
    litellm()
    from litellm.llms.anthropic.pass_through.adapters.transformation import AnthropicAdapter

    return AnthropicAdapter()


def to_chat(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """A Messages request as a Chat Completions request, and the adapter's tool-name map."""
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
    try:
        chat, tool_map = _adapter().translate_completion_input_params_with_tool_mapping(copy.deepcopy(body))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise BadRequest(f"cannot translate this Messages request: {exc}") from exc
    return jsonable(chat), tool_map


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

    fields = {k: v for k, v in reasoning_for_litellm(chat_response).items() if k != "assembled_from_stream"}
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
    chat, tool_map = to_chat(body)
    session = await session_for(request, state)
    stream = bool(body.get("stream"))
    chat["stream"] = stream
    ask_for_tokens(state, chat)
    if stream:
        chat["stream_options"] = {"include_usage": True}
    call = Call(state, API, session, await state.numbers.next(state.store, session.id), body, stream)
    call.rewrites = await fit_to_backend(state, chat)
    await call.plan_prompt(chat)
    try:
        resp, data = await open_upstream(call, "/chat/completions", chat)
    except UpstreamError as exc:
        return json_response(anthropic_error_body(exc.status, exc.message), exc.status)
    if stream:
        return StreamingResponse(_relay(call, resp, data, tool_map, body["model"]), media_type="text/event-stream")
    return json_response(await call.finish(data, resp.status, lambda d: to_message(d, tool_map)))


class _HeldArguments:
    """Tool calls of a streamed Messages answer, made whole for the client. vLLM names a call's id
    in its first delta only, and litellm gives every later delta without one a fresh id (a new,
    nameless tool_use block): every delta gets its call's id. A call's arguments are held back and
    sent whole, as a JSON object (`object_arguments`), before anything else follows it (the next
    call, text, the finish): a client parses the partial JSON as it comes and fails on arguments
    that are not an object, and litellm closes a call's block when the next one starts."""

    def __init__(self) -> None:
        self.ids: dict[int, str] = {}
        self.held: dict[int, str] = {}  # the open call's arguments so far

    def pieces(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks to translate for one upstream chunk (a Messages answer has one choice)."""
        if not chunk.get("choices"):
            return [chunk]  # usage
        [choice] = chunk["choices"]
        head = {k: v for k, v in chunk.items() if k not in ("choices", "usage")}
        delta = dict(choice.get("delta") or {})
        calls = delta.pop("tool_calls", None) or []
        out: list[dict[str, Any]] = []

        def piece(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {**head, "choices": [{"index": choice.get("index", 0), "delta": delta, "finish_reason": finish}]}

        for call in calls:
            i, function = call.get("index", 0), call.get("function") or {}
            if i not in self.ids:  # a new call: the one before it is complete
                out += [piece(d) for d in self._flush()]
                self.ids[i] = call.get("id") or f"toolu_{i}"
                opened = {"index": i, "id": self.ids[i], "type": "function", "function": {"name": function.get("name")}}
                out.append(piece({"tool_calls": [opened]}))
            self.held[i] = self.held.get(i, "") + (function.get("arguments") or "")
        finish = choice.get("finish_reason")
        if finish and self.ids and finish == "stop":  # as in to_message: vLLM says "stop" after a forced call
            finish = "tool_calls"
        if finish or any(delta.get(k) for k in ("content", "reasoning_content")) or (delta and not calls):
            out += [piece(d) for d in self._flush()]
            out.append(piece(delta, finish))
        if chunk.get("usage"):
            out.append({**head, "choices": [], "usage": chunk["usage"]})
        return out

    def _flush(self) -> list[dict[str, Any]]:
        done = [{"tool_calls": [{"index": i, "id": self.ids[i], "function": {"arguments": object_arguments(args)}}]}
                for i, args in self.held.items()]  # fmt: skip
        self.held.clear()
        return done


def _relay(
    call: Call, resp: aiohttp.ClientResponse, data: Any, tool_map: dict[str, str], model: str
) -> AsyncIterator[bytes]:
    """Anthropic SSE events translated from the upstream's chunks; message_stop reaches the
    client once the call is recorded."""
    from litellm.types.utils import ModelResponseStream

    capture = Capture()
    broken: list[str] = []  # litellm's translator ends the stream on an error instead of raising it
    calls = _HeldArguments()

    async def chunks() -> AsyncIterator[Any]:
        try:
            async for chunk in upstream_chunks(resp, data):
                capture.add_chunk(chunk)
                if nothing_to_translate(capture, chunk):
                    continue  # recorded, but nothing for the client
                for piece in calls.pieces(reasoning_for_litellm(chunk)):
                    yield ModelResponseStream(**piece)
        except StreamBroken as exc:
            broken.append(str(exc))
            raise
        except Exception as exc:  # litellm's translator would turn it into its own event, unrecorded
            broken.append(f"the stream could not be relayed: {exc!r}")
            raise

    def failed(message: str, kind: str, _answer: Any) -> bytes:
        return b"event: error\ndata: " + orjson.dumps(anthropic_error_body(502, message)) + b"\n\n"

    events = _adapter().translate_completion_output_params_streaming(chunks(), model=model, tool_name_mapping=tool_map)
    return relay(
        call, resp, capture, events, held=lambda event: event.startswith(b"event: message_stop\n"),
        answer=lambda: to_message(capture.assembled(True), tool_map), failed=failed,
        ended=lambda: broken[0] if broken else None,
    )  # fmt: skip


@router.post("/messages/count_tokens", openapi_extra=openapi.MESSAGES)
async def count_tokens(request: Request) -> Response:
    """Input tokens of a Messages request, as the upstream's chat template renders them."""
    state: ProxyState = request.app.state.rlp
    body = await read_json(request, state.settings)
    chat, _ = to_chat({"max_tokens": 1, **body})
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
