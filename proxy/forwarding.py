"""The forwarding core shared by every API surface: reading the body, finding the session,
opening the upstream call, reading its stream, and recording the call however it ends.

Each API module (openai_api.py, anthropic.py, responses.py) translates its own request and
answer shapes around these pieces.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any
from uuid import uuid4

import aiohttp
import anyio
import orjson
from fastapi import Request

from proxy.capture import Capture, Sent, as_chunks, parse_answer
from proxy.errors import (
    Forbidden,
    ProxyError,
    SessionEnded,
    StoreUnavailable,
    Unauthorized,
    UpstreamUnreachable,
    client_gone,
    error_body,
)
from proxy.sessions import force_sampling, parse_key, request_key
from proxy.state import ProxyState
from proxy.threads import NOT_BRIDGED, NOT_TAKEN, THREADS_PER_SESSION, Answer, Keys, Plan, thread_state, took
from proxy.upstream import Upstream, UpstreamDown
from recorder import CallRecord, SessionInfo
from recorder.errors import SessionClosed, StoreError
from recorder.records import ThreadRecord
from recorder.store import SessionConflict, utcnow

log = logging.getLogger("rl_proxy.proxy")


class Untranslatable(ProxyError):
    """The upstream's answer could not be put in the client's API shape (it was recorded)."""

    status = 502
    type = "upstream_error"


class UpstreamError(ProxyError):
    """The upstream answered with an error of its own; `body` is its (OpenAI-shaped) answer."""

    def __init__(self, status: int, body: Any, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


async def session_for(request: Request, state: ProxyState) -> SessionInfo:
    key = request_key(request)
    state.forget_ended()
    try:
        found = await state.store.session_by_key(key)
        if found is None and not state.settings.create_sessions:
            raise Unauthorized(f"unknown session key {key[:8]!r}...: create it through the admin API")
        found = found or await state.store.resolve_session(parse_key(key))
    except SessionConflict as exc:
        raise Forbidden(f"{exc}: the session belongs to another key") from exc
    if found.status != "active":  # its episode is over (and maybe scored): it takes no more calls
        raise SessionEnded(f"session {found.id!r} has ended ({found.status}); start a new one with a new key")
    return found


@dataclass
class Call:
    """What is known of a call before its answer: enough to record it however it ends."""

    state: ProxyState
    api: str
    session: SessionInfo
    seq: int
    request: dict[str, Any]
    stream: bool

    def __post_init__(self) -> None:
        self.started = utcnow()
        self.rewrites: dict[str, Any] = {}
        self.response_id: str | None = None
        self.on_recorded: Callable[[CallRecord], None] | None = None  # called once it is committed
        self.chat_body: dict[str, Any] | None = None  # the upstream chat body, with token-in
        self.keys: Keys | None = None  # its messages' digests, made once for the plan and the record
        self.prompt_ids: array[int] | None = None  # the prompt token-in built (its start, when `bridged`)
        self.bridged = False  # the upstream was sent the thread to bridge (proxy/bridge.py)
        self.sent: Sent | None = None  # the prompt's ids as sent, which the answer's are read against
        self.thread_start: str | None = None
        self.continues: dict[str, Any] | None = None  # the call and choice token-in continues
        self.model: str | None = None  # the served model the upstream was asked for (open_upstream)
        self.call_id = uuid4().hex  # CallRecord.call_id: token-in names the call by it before it is recorded
        self.pin(self.state.upstreams.for_session(self.session.id))

    @classmethod
    async def start(
        cls, state: ProxyState, api: str, session: SessionInfo, request: dict[str, Any], stream: bool
    ) -> Call:
        """The session's next call, on the policy version last announced to any worker."""
        seq = await state.numbers.next(state.store, session.id)
        await state.upstreams.heard()
        return cls(state, api, session, seq, request, stream)

    async def plan_prompt(self, body: dict[str, Any]) -> None:
        """Token-in for an upstream chat body (proxy/threads.py): when the call continues a
        thread of its session, its prompt is built from that thread's tokens."""
        settings = self.state.settings
        if settings.messages_mode or not settings.upstream_token_ids:
            return
        self.chat_body, start = body, time.perf_counter()
        try:
            # A session's first call has nothing recorded to continue: no read on its hot path.
            recorded = self.recorded_threads if self.seq > 1 else None
            self.keys = keys = self.state.threads.keys(self.session.id, body)
            plan = await self.state.threads.plan(self.upstream, self.session.id, body, self.call_id, recorded, keys)
        except Exception as exc:  # messages of a shape it cannot read, say: the call goes as messages
            log.warning("token-in could not plan call %s/%d: %r", self.session.id, self.seq, exc)
            plan = Plan(None, f"token-in could not read the request: {exc!r}")
        outcome = "new_thread" if plan.prompt_ids is None else "continued"
        self.state.metrics.token_in.labels(outcome).observe(time.perf_counter() - start)
        context = self.upstream.models.get(str(body.get("model")))
        if plan.prompt_ids is not None and context and len(plan.prompt_ids) >= context:
            plan = Plan(None, f"the token-in prompt ({len(plan.prompt_ids)} tokens) fills the context")
        why = plan.why or plan.fork
        self.prompt_ids, self.thread_start = plan.prompt_ids, why and why[:256]  # the column's width
        self.continues, self.bridged = plan.continues, plan.thread is not None
        if plan.prompt_ids is not None:
            body["kv_transfer_params"] = plan.kv_transfer_params()
            self.sent = plan.ids_json[1:-1], plan.prompt_ids

    async def recorded_threads(self) -> list[ThreadRecord]:
        """The session's recorded threads. A read that fails (a connection cut, the database
        restarting) is tried again for up to about 4 s before the call goes without token-in."""
        for wait in (0.25, 0.5, 1.0, 2.0, None):
            try:
                return await self.state.store.recent_threads(self.session.id, THREADS_PER_SESSION)
            except StoreError:
                if wait is None:
                    raise
                await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    def pin(self, upstream: Upstream) -> None:
        """Send the call to `upstream` (the session's; another if that one is down)."""
        self.upstream = upstream
        self.version = upstream.version
        self.upstream_stream = self.stream and not upstream.streams_whole()

    def version_end(self) -> str | None:
        """The version serving when the call ended. When that version is a LoRA adapter the
        base weights did not change, and a call keeps the adapter it started with: so its own."""
        now = self.upstream.version
        lora = self.model is not None and self.upstream.serving(self.model, now) != self.model
        return self.version if lora else now

    def record(
        self, capture: Capture, response: dict[str, Any] | None, status: int, error: str | None = None
    ) -> CallRecord:
        state = self.state
        if error is None and capture.choices:
            error = capture.incomplete()  # answered, but never trained on as if complete
            if error and capture.text_without_ids:
                self.upstream.note_stream_gap(error)
        token_in = took(self.prompt_ids, capture.prompt_token_ids, self.bridged)
        if self.prompt_ids is not None and capture.prompt_token_ids and not token_in:
            self.thread_start = NOT_BRIDGED if self.bridged else NOT_TAKEN
        thread: dict[str, Any] | None = None
        answers: list[Answer] = []
        if error is None and self.chat_body is not None and capture.prompt_token_ids:
            messages = capture.messages()
            chosen = sorted(capture.choices.items())
            answers = [Answer(messages[i], array("i", c.token_ids), c.finish_reason) for i, c in chosen]
            thread = thread_state(self.chat_body, answers, self.continues if token_in else None, self.keys)
        call = CallRecord(
            session_id=self.session.id,
            seq=self.seq,
            api=self.api,
            model=str(self.request.get("model")),
            upstream=self.upstream.base_url,
            stream=self.stream,
            request=self.request,
            response=response,
            ok=error is None,
            http_status=status,
            error=None if error is None else error.replace("\x00", "\\0"),  # an upstream may echo input
            prompt_token_ids=capture.prompt_token_ids,
            completions=capture.completions(),
            policy_version=self.version,
            policy_version_end=self.version_end(),
            started_at=self.started,
            finished_at=utcnow(),
            rewrites=self.rewrites,
            response_id=self.response_id,
            token_in=token_in,
            thread_start=None if self.chat_body is None else self.thread_start,
            thread=thread,
            call_id=self.call_id,
        )
        if thread is not None:
            whole = self.keys.whole if self.keys else None
            state.threads.add(self.session.id, call.call_id, thread, capture.prompt_token_ids, answers, whole)
        state.observe(call)
        return call

    async def settle(
        self,
        resp: aiohttp.ClientResponse,
        capture: Capture,
        answer: Callable[[], dict[str, Any] | None],
        status: int,
        error: str | None,
    ) -> tuple[dict[str, Any] | None, str | None, ProxyError | None]:
        """Record a relayed stream however it ended: (its answer, its error, the failure to
        record it, if any). Shielded: a client that goes away cancels the relay, and the call
        must still be recorded with the tokens received so far. The answer is built here, so
        that one that cannot be translated is recorded without it, its tokens kept."""
        with anyio.CancelScope(shield=True):
            resp.release()
            try:
                body = answer()
            except Exception as exc:
                body, error = None, error or f"the answer could not be translated: {exc!r}"
            try:
                await self.commit(self.record(capture, body, status, error))
            except ProxyError as exc:
                return body, error, exc
        return body, error, None

    async def finish(
        self,
        data: dict[str, Any],
        status: int,
        translate: Callable[[dict[str, Any]], Any],
        request: Request,
    ) -> Any:
        """Record a whole (not streamed) answer and return it as the client gets it: answered 502
        if it cannot be translated (its tokens and the error recorded), recorded as 499 with its
        tokens if its client hung up while it waited (never delivered: not trained, not continued)."""
        capture = Capture()
        try:
            capture.add_response(data)
            answer = translate(data)
        except Exception as exc:  # an answer of an unexpected shape too: recorded, answered 502
            log.exception("answer of call %s/%d could not be translated", self.session.id, self.seq)
            error = f"the answer could not be translated: {exc!r}"
            await self.commit(self.record(capture, None, 502, error))
            raise Untranslatable(error) from exc
        if client_gone(request):
            await self.commit(self.record(capture, answer, 499, "client disconnected before the answer"))
            return answer
        await self.commit(self.record(capture, answer, status))
        return answer

    async def commit(self, call: CallRecord) -> None:
        try:  # another worker took the trainer's announce since: the version the call ended on
            if await self.state.upstreams.heard():
                call = replace(call, policy_version_end=self.version_end())
        except ProxyError as exc:  # recorded as this worker knows it
            log.warning("call %s/%d: the announced policy version was not read: %s", self.session.id, self.seq, exc)
        try:
            with self.state.metrics.commit.time():
                call = await self.state.store.record(call)
        except SessionClosed as exc:  # it ended since this call began, here or through another proxy
            raise SessionEnded(f"{exc}: the call is not recorded; start a new session with a new key") from exc
        except Exception as exc:  # a StoreError in the database's own words, or anything else: never lost silently
            raise StoreUnavailable(f"the call could not be recorded, so it is not answered: {exc}") from exc
        self.state.numbers.recorded(call)
        if self.on_recorded is not None:
            self.on_recorded(call)


async def relay(
    call: Call,
    resp: aiohttp.ClientResponse,
    capture: Capture,
    events: AsyncIterator[bytes],
    *,
    held: Callable[[bytes], bool],
    answer: Callable[[], dict[str, Any] | None],
    failed: Callable[[str, str, dict[str, Any] | None], bytes],
    ended: Callable[[], str | None] = lambda: None,
    done: bytes = b"",
) -> AsyncIterator[bytes]:
    """Relay one API's stream events and record the call however the stream ends. The parts
    each API brings: `events` (its own, translated from the upstream's chunks as they arrive
    into `capture`), `held` (the events that end its stream, held back until the call is
    recorded), `answer` (the whole answer to record), `failed(message, type, answer)` (its error
    event), `ended` (why a stream that ran out is incomplete, if it is) and `done` (a
    terminator sent last). A client that goes away leaves the call recorded as 499."""
    status: int = 499  # what stands if the client goes away mid-stream
    error: str | None = "client disconnected"
    kind = "upstream_error"
    held_back: list[bytes] = []
    try:
        async for event in events:
            if held(event):
                held_back.append(event)
            else:
                yield event
        error = ended()
        status = 200 if error is None else 502
    except StreamBroken as exc:
        status, error = 502, str(exc)
    except Exception as exc:  # a stream the translation cannot follow: an error event, never a reset
        log.exception("stream of call %s/%d failed", call.session.id, call.seq)
        status, error, kind = 502, f"the stream could not be relayed: {exc!r}", "internal_error"
    finally:
        body, error, unrecorded = await call.settle(resp, capture, answer, status, error)
    if unrecorded is not None:
        yield failed(unrecorded.message, unrecorded.type, body)
    elif error is not None:
        yield failed(error, kind, body)
    else:
        yield b"".join(held_back) + done


def ask_for_tokens(state: ProxyState, body: dict[str, Any], chat: bool = True) -> None:
    """Ask a vLLM upstream, in the upstream body, for what the record needs: token ids and one
    logprob per sampled token. Nothing for an upstream that has neither."""
    if not state.settings.upstream_token_ids:
        return
    body["return_token_ids"] = True
    if chat:
        body["logprobs"] = True
    elif body.get("logprobs") is None:
        body["logprobs"] = 0


async def fit_to_backend(state: ProxyState, body: dict[str, Any], session: SessionInfo | None = None) -> dict[str, Any]:
    """Map the requested model to a served one, cap the completion length and set the session's
    own sampling settings (admin API), in the upstream body (the recorded request stays as the
    client sent it), and drop a prompt of the client's own; return the changes made."""
    settings = state.settings
    rewrites = force_sampling(session, body)
    if body.pop("kv_transfer_params", None) is not None:  # token-in's prompt (proxy/threads.py): the proxy's alone
        rewrites["kv_transfer_params"] = ["dropped", None]
    served = await state.upstreams.first.served_models()
    model = body.get("model")
    policy = settings.policy_model or next(iter(served), None)
    target = settings.model_aliases.get(str(model))
    if target is None and settings.route_unknown_models and model not in served.keys() | state.upstreams.first.adapters:
        target = policy
    if target is not None and target != model:
        body["model"] = target
        rewrites["model"] = [model, target]
    # vLLM itself shortens a limit that the prompt leaves no room for, but refuses one longer
    # than the whole context: so the cap is the smaller of the setting and the context length.
    caps = [c for c in (settings.max_completion_tokens, served.get(str(body.get("model")))) if c]
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = body.get(field)
    if caps and (not isinstance(asked, int) or asked > min(caps)):
        body[field] = min(caps)
        rewrites[field] = [asked, min(caps)]
    return rewrites


async def open_upstream(call: Call, path: str, body: dict[str, Any]) -> tuple[aiohttp.ClientResponse, Any]:
    """Send the upstream request: (the response, its parsed JSON body if not streamed). Every
    way it can fail is recorded as a failed call and raised as a named ProxyError."""
    upstreams = call.state.upstreams
    asked = body.get("model")
    call.model = asked if isinstance(asked, str) else None
    while True:
        if call.stream and not call.upstream_stream:
            body = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
        if call.model is not None and (adapter := call.upstream.serving(call.model, call.version)) != asked:
            body = body | {"model": adapter}  # LoRA: the adapter of the version the call is stamped with
            call.rewrites["model"] = [call.rewrites.get("model", [asked])[0], adapter]
        try:
            resp = await call.upstream.send("POST", path, body)
            raw = b"" if call.upstream_stream and resp.ok else await call.upstream.read(resp)
            break
        except UpstreamDown as exc:  # never sent: the session moves to a live server, if any
            moved = upstreams.for_session(call.session.id)
            if moved is not call.upstream:
                call.pin(moved)
                continue
            await call.commit(call.record(Capture(), None, exc.status, exc.message))
            raise
        except ProxyError as exc:
            await call.commit(call.record(Capture(), None, exc.status, exc.message))
            raise
    if not resp.ok:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            data = {"error": {"message": raw.decode(errors="replace")[:2000], "type": "upstream_error"}}
        error = data.get("error") if isinstance(data, dict) else None
        message = str(error.get("message", error)) if isinstance(error, dict) else str(data)
        if not isinstance(error, dict):  # not OpenAI's shape (a router's 404, say): made into it
            data = error_body(f"upstream answered {resp.status}: {message[:2000]}", "upstream_error")
        await call.commit(call.record(Capture(), data, resp.status, message))
        raise UpstreamError(resp.status, data, message)
    if call.upstream_stream:
        return resp, None
    try:
        return resp, parse_answer(raw, call.sent)
    except orjson.JSONDecodeError as exc:
        await call.commit(call.record(Capture(), None, 502, "upstream answered with invalid JSON"))
        raise UpstreamUnreachable(f"upstream answered with invalid JSON: {exc}") from exc


def upstream_chunks(call: Call, resp: aiohttp.ClientResponse, data: Any) -> AsyncIterator[dict[str, Any]]:
    """A streamed call's chunks: the upstream's stream, or the whole answer it was asked for
    instead (after a stream lost token ids) as the chunks that carry it."""
    return stream_chunks(resp, call.sent) if data is None else _replay(as_chunks(data))


async def _replay(chunks: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    for chunk in chunks:
        yield chunk


class StreamBroken(Exception):
    """The upstream stream failed or ended before `[DONE]`."""


async def stream_chunks(resp: aiohttp.ClientResponse, sent: Sent | None) -> AsyncIterator[dict[str, Any]]:
    """The upstream's SSE chunks as dicts, until `[DONE]`; StreamBroken if it never comes."""
    try:
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            chunk = parse_answer(payload, sent)
            if "error" in chunk:
                raise StreamBroken(str(chunk["error"].get("message", chunk["error"])))
            yield chunk
    except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError) as exc:
        raise StreamBroken(f"upstream stream failed: {exc!r}") from exc
    raise StreamBroken("upstream closed the stream before [DONE]")
