"""OpenAI Responses: `POST /v1/responses` and `GET /v1/responses/{id}`, recorded at token level.

Like Messages (anthropic.py), a Responses request is translated to Chat Completions in process
by litellm, sent upstream as a chat call (prompt ids, sampled ids and logprobs captured), and the
answer translated back: one response object by litellm, or the event stream (response.created,
response.in_progress, output_item/content_part/output_text or function_call_arguments events,
response.completed), written chunk by chunk by `_ResponseEvents` (litellm's stream iterator
built several pydantic objects per chunk: 8x the cost of a chat stream). The call is
recorded with the request and the response as the client sent and saw them, and the response's id.

`previous_response_id` is resolved from the store, so it survives a restart: the conversation
is the earlier request's input and its response's output, back along the chain, then the new
input. As with OpenAI, `instructions` are not carried over. A session can only continue its
own responses. The most recently used answers are also kept in memory (`RecentResponses`), so
that a chain of n turns costs n lookups rather than n queries.
"""

from __future__ import annotations

import time
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
from proxy.errors import BadRequest, NotFound, json_response
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
from recorder import SessionInfo

API = "openai.responses"
router = APIRouter()

TOOL_TYPES = ("function", "custom", "namespace")  # the rest (web_search, file_search, computer, ...) are hosted
INPUT_PARTS = ("input_text", "output_text", "text", "refusal")
UNSUPPORTED = ("background", "conversation", "prompt")
ECHOED = ("instructions", "max_output_tokens", "previous_response_id", "reasoning", "temperature", "text", "top_p")
MAX_CHAIN = 10_000  # previous_response_id links followed before giving up
FINAL = ("response.completed", "response.incomplete")  # the events that end a stream
FINAL_EVENTS = tuple(f"event: {name}\n".encode() for name in FINAL)


async def stored_response(
    request: Request, session_id: str, response_id: str
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The request and answer of this session's answered response `response_id`."""
    state: ProxyState = request.app.state.rlp
    return state.recent_responses.get(session_id, response_id) or await state.store.stored_response(
        session_id, response_id
    )


@cache
def _config() -> Any:
    litellm()
    from litellm.responses.litellm_completion_transformation.transformation import LiteLLMCompletionResponsesConfig

    return LiteLLMCompletionResponsesConfig


def validate(body: dict[str, Any]) -> None:
    check_types(body)
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    given, previous = body.get("input"), body.get("previous_response_id")
    if not (isinstance(given, str) and given) and not (isinstance(given, list) and (given or previous)):
        raise BadRequest("'input' is required and must be a non-empty string or list of items", param="input")
    if previous is not None and (not isinstance(previous, str) or "\x00" in previous):  # PostgreSQL refuses NUL
        raise BadRequest("'previous_response_id' must be a string without NUL", param="previous_response_id")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    for name in UNSUPPORTED:
        if body.get(name) is not None:
            raise BadRequest(f"'{name}' is not supported by this proxy", param=name)
    for tool in body.get("tools") or []:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in TOOL_TYPES:
            raise BadRequest(f"hosted tool type {kind!r} cannot run on this backend: only function tools", "tools")
    items = given if isinstance(given, list) else []
    for item in items:
        if not isinstance(item, dict):
            raise BadRequest("every 'input' item must be an object", param="input")
        content = item.get("content")
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in INPUT_PARTS:
                raise BadRequest(f"input content of type {kind!r} is not supported by this backend", param="input")


def _as_items(given: Any) -> list[Any]:
    return [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else list(given or [])


async def conversation(request: Request, session: SessionInfo, body: dict[str, Any]) -> list[Any]:
    """The whole input: the chain of earlier responses, then this input."""
    parts = [_as_items(body.get("input"))]
    previous = body.get("previous_response_id")
    while previous is not None and len(parts) <= MAX_CHAIN:
        found = await stored_response(request, session.id, previous)
        if found is None:
            raise BadRequest(f"previous response with id {previous!r} not found", param="previous_response_id")
        asked, answered = found
        parts.append(_as_items(asked.get("input")) + list(answered.get("output") or []))
        previous = asked.get("previous_response_id")
    return [item for part in reversed(parts) for item in part]


def _params(body: dict[str, Any]) -> dict[str, Any]:
    """The request's options, as litellm's translators take them (apart from model and input)."""
    return {k: v for k, v in body.items() if k not in ("model", "input", "stream")}


def to_chat(body: dict[str, Any], items: list[Any], stream: bool) -> dict[str, Any]:
    params = _params(body)
    try:
        chat = _config().transform_responses_api_request_to_chat_completion_request(
            model=body["model"], input=items, responses_api_request=params, stream=stream
        )
    except refusals() as exc:
        raise BadRequest(f"cannot translate this Responses request: {exc}") from exc
    return dict(jsonable(chat))


def to_response(chat_response: dict[str, Any], body: dict[str, Any], response_id: str) -> dict[str, Any]:
    params = _params(body)
    fields = {k: v for k, v in reasoning_for_litellm(chat_response).items() if k not in LEFT_TO_CHAT}
    response = _config().transform_chat_completion_response_to_responses_api_response(
        request_input=body.get("input"), responses_api_request=params, chat_completion_response=fields
    )
    answer = {**jsonable(response), "id": response_id}
    # vLLM answers a tool call with content "", which litellm turns into an empty message item
    # (its stream leaves it out): dropped, so both agree and a replay adds no empty turn.
    answer["output"] = [item for item in answer.get("output") or [] if not _empty_message(item)]
    return answer


def _empty_message(item: dict[str, Any]) -> bool:
    parts = item.get("content") if item.get("type") == "message" else None
    return isinstance(parts, list) and all(p.get("type") == "output_text" and not p.get("text") for p in parts)


@router.post("/responses", openapi_extra=openapi.RESPONSES)
async def responses(request: Request) -> Response:
    state: ProxyState = request.app.state.rlp
    body = await read_json(request, state.settings)
    validate(body)
    await imported()
    session = await session_for(request, state)
    stream = bool(body.get("stream"))
    chat = to_chat(body, await conversation(request, session, body), stream)
    ask_for_tokens(state, chat)
    call = await Call.start(state, API, session, body, stream)
    call.response_id = f"resp_{uuid.uuid4().hex}"
    call.on_recorded = state.recent_responses.remember
    call.rewrites = await fit_to_backend(state, chat, session)
    await call.plan_prompt(chat)
    try:
        resp, data = await open_upstream(call, "/chat/completions", chat)
    except UpstreamError as exc:  # already in the OpenAI shape: passed through as is
        return json_response(exc.body, exc.status)
    if stream:
        return StreamingResponse(_relay(call, resp, data), media_type="text/event-stream")
    return json_response(
        await call.finish(data, resp.status, lambda d: to_response(d, body, str(call.response_id)), request)
    )


def _event(data: dict[str, Any]) -> bytes:
    return b"event: " + data["type"].encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class _ResponseEvents:
    """The Responses stream events for a streamed chat answer, written straight from its chunks:
    response.created and response.in_progress; an output item for each run of reasoning (its
    summary text), of text (one output_text part) and for each function call, added, its deltas,
    done; then response.completed (or response.incomplete) with the whole response, as the same
    call unstreamed would answer it, under the streamed items' ids."""

    def __init__(self, body: dict[str, Any], response_id: str) -> None:
        self.body, self.response_id = body, response_id
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # output items so far, the newest open until `_close`
        self.open = False
        self.calls: dict[int, dict[str, Any]] = {}  # function call items by their index in the stream

    def event(self, kind: str, **data: Any) -> bytes:
        self.sequence += 1
        return _event({"type": kind, **data, "sequence_number": self.sequence - 1})

    def start(self) -> list[bytes]:
        body = self.body
        response = {
            "id": self.response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "model": body["model"],
            "output": [],
            "error": None,
            "incomplete_details": None,
            "metadata": body.get("metadata") or {},
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "truncation": None,
            "usage": None,
            "user": None,
            "store": True,
            **{name: body.get(name) for name in ECHOED},
        }
        return [self.event(kind, response=response) for kind in ("response.created", "response.in_progress")]

    def add(self, chunk: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        for choice in chunk.get("choices") or []:  # a Responses answer has one
            delta = choice.get("delta") or {}
            reasoning = next((delta[k] for k in REASONING if delta.get(k)), None)
            if reasoning:
                if not self._opened("reasoning"):
                    out += self._item({"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": []})
                out.append(self._delta("response.reasoning_summary_text.delta", reasoning, summary_index=0))
            if delta.get("content"):
                if not self._opened("message"):
                    out += self._item(
                        {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "content": []}
                    )
                out.append(self._delta("response.output_text.delta", delta["content"], content_index=0, logprobs=[]))
            for call in delta.get("tool_calls") or []:
                i, function = call.get("index", 0), call.get("function") or {}
                if i not in self.calls:
                    call_id = call.get("id") or f"call_{i}"
                    item = {
                        "id": f"fc_{call_id}",
                        "type": "function_call",
                        "call_id": call_id,
                        "name": function.get("name") or "",
                        "arguments": "",
                    }
                    out += self._item(item)
                    self.calls[i] = item
                if function.get("arguments"):
                    self.calls[i]["arguments"] += function["arguments"]
                    if self.items[-1] is self.calls[i]:
                        out.append(self._delta("response.function_call_arguments.delta", function["arguments"]))
        return out

    def end(self, response: dict[str, Any]) -> list[bytes]:
        """The events that close the stream, with the whole `response` (its items take the streamed ids)."""
        out = self._close()
        for kind in ("reasoning", "message", "function_call"):
            streamed = [item for item in self.items if item["type"] == kind]
            wholes = [item for item in response["output"] if item.get("type") == kind]
            for item, whole in zip(streamed, wholes, strict=False):  # the whole answer drops an empty message
                whole["id"] = item["id"]
        final = "response.incomplete" if response.get("status") == "incomplete" else "response.completed"
        return [*out, self.event(final, response=response)]

    def _opened(self, kind: str) -> bool:
        """Whether the newest item is open and of `kind`, so that a delta of that kind goes on in it
        (an item's id, a uuid4, is made only when it opens: made for every delta, and thrown away,
        it cost about 0.03 ms of CPU a streamed call of 7 tokens)."""
        return self.open and self.items[-1]["type"] == kind

    def _item(self, item: dict[str, Any]) -> list[bytes]:
        """Open `item`, closing the one before."""
        out = self._close()
        self.items.append(item)
        self.open = True
        at, kind = len(self.items) - 1, item["type"]
        out.append(self.event("response.output_item.added", output_index=at, item={**item, "status": "in_progress"}))
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            out.append(self.event("response.content_part.added", **self._at(), content_index=0, part=part))
        elif kind == "reasoning":
            part = {"type": "summary_text", "text": ""}
            out.append(self.event("response.reasoning_summary_part.added", **self._at(), summary_index=0, part=part))
        return out

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _delta(self, kind: str, text: str, **where: Any) -> bytes:
        item = self.items[-1]
        item["text"] = item.get("text", "") + text
        return self.event(kind, **self._at(), **where, delta=text)

    def _close(self) -> list[bytes]:
        if not self.open:
            return []
        self.open = False
        item, at = self.items[-1], self._at()
        if item["type"] == "message":
            text = item.pop("text", "")
            part = {"type": "output_text", "text": text, "annotations": []}
            item["content"] = [part]
            out = [
                self.event("response.output_text.done", **at, content_index=0, text=text),
                self.event("response.content_part.done", **at, content_index=0, part=part),
            ]
        elif item["type"] == "reasoning":
            text = item.pop("text", "")
            part = {"type": "summary_text", "text": text}
            item["summary"] = [part]
            out = [
                self.event("response.reasoning_summary_text.done", **at, summary_index=0, text=text),
                self.event("response.reasoning_summary_part.done", **at, summary_index=0, part=part),
            ]
        else:
            item.pop("text", None)
            out = [self.event("response.function_call_arguments.done", **at, arguments=item["arguments"])]
        done = {**item, "status": "completed"}
        return [*out, self.event("response.output_item.done", output_index=at["output_index"], item=done)]


def _relay(call: Call, resp: aiohttp.ClientResponse, data: Any) -> AsyncIterator[bytes]:
    """Responses events from the upstream's chunks; the final response.completed (or
    response.incomplete) reaches the client once the call is recorded."""
    body, response_id = call.request, str(call.response_id)
    capture = Capture()
    events = _ResponseEvents(body, response_id)
    final: list[dict[str, Any]] = []  # the whole response, once the stream has ended

    async def translated() -> AsyncIterator[bytes]:
        for event in events.start():
            yield event
        async for chunk in upstream_chunks(call, resp, data):
            capture.add_chunk(chunk)
            for event in events.add(chunk):
                yield event
        final.append(to_response(capture.assembled(True), body, response_id))
        for event in events.end(final[0]):
            yield event

    def whole() -> dict[str, Any]:
        return final[0] if final else to_response(capture.assembled(True), body, response_id)

    def failed(message: str, kind: str, answer: dict[str, Any] | None) -> bytes:
        response = {
            **(answer or {"id": response_id, "object": "response", "output": []}),
            "status": "failed",
            "error": {"code": "server_error", "message": message},
        }
        return _event({"type": "response.failed", "response": response, "sequence_number": events.sequence})

    return relay(
        call,
        resp,
        capture,
        translated(),
        held=lambda event: event.startswith(FINAL_EVENTS),
        answer=whole,
        failed=failed,
    )


@router.get("/responses/{response_id}")
async def retrieve(request: Request, response_id: str) -> Response:
    """A stored response of this session."""
    state: ProxyState = request.app.state.rlp
    session = await session_for(request, state)
    found = await stored_response(request, session.id, response_id)
    if found is None:
        raise NotFound(f"response with id {response_id!r} not found")
    return json_response(found[1])
