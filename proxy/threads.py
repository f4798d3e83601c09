"""Token-in: a continuing call's prompt is built from the tokens the model already saw and sampled.

A harness sends its whole conversation again on every call. The proxy keeps, for each session,
the token state of its recent calls (a thread: the call's messages, prompt ids and each choice's
sampled ids and answer). When a request's messages are a thread's messages, then that call's
answer as the harness echoes it back (tool calls, text, with `<think>` blocks stripped or not),
then new messages, its prompt is the thread's prompt ids + the sampled ids + the bridge: the
tokens of the new messages as the model's own template renders them. So the training sequence of
an agent episode is one token-exact sequence whatever the template does with history (drop tool
calls, strip thinking) and however a sampled text would re-tokenize.

The bridge needs no per-model code: the upstream renders the whole new request (`/tokenize`) and
the bridge is what follows the end-of-turn token that closes the echoed answer. That is the n-th
end-of-turn token of the rendering, n being how many the thread's own tokens hold (one more if
its answer was cut before sampling one). When the rendering does not hold one more for each
later message (a template that merges or drops turns), the history up to the echoed answer is
rendered too, and must hold n. The end-of-turn token is found once per model and
template, from two renderings of a short exchange that differ only in the answer's text. The ids
go to vLLM's Chat Completions as `kv_transfer_params.prompt_token_ids`, so the answer is parsed
(tool calls, reasoning) and shaped as before. A vLLM with rl-proxy's plugin (proxy/vllm_plugin.py,
its model cards say so) makes the bridge itself where its chat route renders the request, from the
thread's ids and counts sent with it (proxy/bridge.py): no `/tokenize` on the call's path, whose
round trip was most of what token-in added to a call (docs/benchmarks.md).

A call's token state is recorded with it (`CallRecord.thread`: digests of its messages and
template inputs, each choice's message; its prompt and sampled ids are in the record anyway).
A proxy that holds no thread the call continues reads the session's newest ones back from the
store, and its open ends (calls no later call continued: a main loop waiting on a long
subagent), so a thread survives a restart and spans every proxy on one store. Which answer a
call continued is recorded with it once, by call id; the cache learns it from there or from
serving the call, alike.

Anything else starts a new thread, and the call records why (`thread_start`): the first call,
edited history, a compaction, another system prompt or tools, an answer not echoed as sampled,
a rendering whose end-of-turn tokens do not line up.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sys
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import orjson
from cachetools import LRUCache

from proxy.bridge import KEY, Ids, bridge
from proxy.capture import parse_rendering
from proxy.upstream import Upstream
from recorder.caches import ByteLRU, deep_size
from recorder.echo import echoes, norm
from recorder.records import ThreadRecord

log = logging.getLogger("rl_proxy.threads")

THREADS_PER_SESSION = 16  # a harness may branch: retries, subagents, n > 1
RECENT_THREADS = 4  # never forgotten for an older one: a retry or fork continues a recent answer
END_OF_TURN_TEMPLATES = 1024  # model and template pairs whose end-of-turn token is kept
RENDER_TIMEOUT = 10.0  # seconds a rendering may take before the call goes as messages


def _canonical(value: Any) -> Any:
    """A message as JSON can compare it, without `cache_control`: a caching hint that clients
    move from message to message (Claude Code marks its latest turns) and no template renders."""
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def exact(message: dict[str, Any]) -> bytes:
    """A message of the history, whole: any edit of it (its whitespace, a `name`, a
    `tool_call_id`, an image part) means the model would see other tokens, so a new thread.
    Content of one text part is its text: vLLM renders the two alike, and Claude Code sends a
    turn as a part, then as a string in its next call. A message is dumped once unless it names
    `cache_control` or holds one part (then copied)."""
    return _exact(message, orjson.dumps(message, option=orjson.OPT_SORT_KEYS))


def _exact(message: dict[str, Any], data: bytes) -> bytes:
    """`exact` of `message`, given its JSON with sorted keys."""
    hinted, content = b'"cache_control"' in data, message.get("content")
    if hinted or (isinstance(content, list) and len(content) == 1):
        canonical = _canonical(message) if hinted else dict(message)
        match canonical.get("content"):
            case [{"type": "text", "text": str(text), **rest}] if not rest:
                canonical["content"] = text
        data = orjson.dumps(canonical, option=orjson.OPT_SORT_KEYS)
    return _digest(data)


_REPR_START = hashlib.blake2b(b"('exact', b'", digest_size=16)  # copied: cheaper than hashing it again


def _digest(data: bytes) -> bytes:
    """blake2b of `repr(("exact", data))`, the digest stores hold, without making the repr when
    `data` is ASCII with no DEL (JSON's own escapes keep control characters out): then the repr
    only escapes backslashes and quotes (single, for JSON always holds a double one)."""
    if not data.isascii() or b"\x7f" in data:
        return hashlib.blake2b(repr(("exact", data)).encode(), digest_size=16).digest()
    h = _REPR_START.copy()
    h.update(data.replace(b"\\", b"\\\\").replace(b"'", b"\\'"))
    h.update(b"')")
    return h.digest()


@dataclass(frozen=True)
class Answer:
    """One sampled choice of a thread's call."""

    message: dict[str, Any]  # the assistant message as the upstream answered it
    sampled: array[int]  # 4 bytes a token
    finish_reason: str | None


DIGEST = sys.getsizeof(bytes(16))  # a message's digest (digest_size 16), besides its place in the list


@dataclass(frozen=True)
class Thread:
    call_id: str | None  # the recorded call it is (CallRecord.call_id)
    messages: list[bytes]  # exact() of each message of the call's request
    tools: bytes  # digest of the request's tools and template inputs (tools_key)
    prompt_ids: array[int]  # 4 bytes a token
    answers: list[Answer]
    continued: dict[int, str] = field(default_factory=dict)  # answer index: the call (its id) that continued it first
    whole: bytes | None = None  # Keys.whole of its messages: None read back from the store, or hinted

    @cached_property
    def size(self) -> int:
        """The bytes it holds in this process, its objects' own sizes (once: only `continued`
        changes after, by an entry an answer). Counting the answers' messages as JSON, and not the
        objects around the arrays and digests, put the cache at half its real size."""
        objects = [self, self.__dict__, self.call_id, self.tools, self.continued, self.messages, self.prompt_ids]
        answers = sum(
            sys.getsizeof(a) + sys.getsizeof(a.__dict__) + sys.getsizeof(a.sampled) + deep_size(a.message)
            for a in self.answers
        )
        return sum(map(sys.getsizeof, objects)) + sys.getsizeof(self.answers) + answers + DIGEST * len(self.messages)


@dataclass
class Plan:
    """How a call's prompt is made: `prompt_ids` (token-in), or None with `why` a new thread. With
    `thread`, `prompt_ids` are only the prompt's start, the thread's ids: the upstream makes the
    bridge (proxy/bridge.py), sent `thread` and `prompt_ids` as its `prefix`."""

    prompt_ids: array[int] | None
    why: str | None  # why the call starts a new thread (None: it continues one)
    fork: str | None = None  # a continuing call's, when another call continued the same answer first
    continues: dict[str, Any] | None = None  # the call and choice it continues: {"call": call_id, "choice": i}
    thread: dict[str, Any] | None = None  # what the upstream makes the bridge from, if it does

    @cached_property
    def ids_json(self) -> bytes:
        """The prompt's ids as JSON, written by orjson from a numpy view, with no Python int made
        for each (an agent's prompt holds tens of thousands: docs/benchmarks.md, "Agent-sized
        calls"). Sent as they are, and the start the upstream's answer is read against
        (capture.parse_answer)."""
        assert self.prompt_ids is not None
        return orjson.dumps(np.frombuffer(self.prompt_ids, np.intc), option=orjson.OPT_SERIALIZE_NUMPY)

    def kv_transfer_params(self) -> dict[str, Any]:
        """How vLLM's Chat Completions is given the prompt: its ids, or the thread to bridge."""
        ids = orjson.Fragment(self.ids_json)
        if self.thread is None:
            return {"prompt_token_ids": ids}
        return {KEY: {**self.thread, "prefix": ids}}


# What renders a chat besides its messages (a change starts a new thread).
TEMPLATE_FIELDS = ("tools", "chat_template", "chat_template_kwargs", "documents", "reasoning_effort")


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The template's keyword arguments as vLLM's chat route makes them from a request
    (ChatCompletionRequest.build_chat_params in vLLM 0.32), for /tokenize, which takes only
    `chat_template_kwargs`: the request's own, then `documents` and `reasoning_effort` unless
    None or "auto", and `enable_thinking` from `reasoning_effort` unless the request set it."""
    given = body.get("chat_template_kwargs") or {}
    extra = {k: body.get(k) for k in ("documents", "reasoning_effort")}
    if body.get("reasoning_effort") is not None and "enable_thinking" not in given:
        extra["enable_thinking"] = body["reasoning_effort"] != "none"
    return {**given, **{k: v for k, v in extra.items() if v not in (None, "auto")}}


def tools_key(body: dict[str, Any]) -> bytes:
    fields = orjson.dumps([body.get(k) for k in TEMPLATE_FIELDS], option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(fields, digest_size=16).digest()


@dataclass(frozen=True)
class Keys:
    """What a thread is matched on and recorded with: `exact` of each message of a chat body, and
    its `tools_key`. Made once a call (`Threads.keys`), for `Threads.plan` and the record. `whole`:
    a digest of the messages' JSON as one list (sorted keys), for the next call's `Threads.keys`;
    None where a message names `cache_control` (a hint Claude Code moves, which `exact` drops)."""

    messages: list[bytes]
    tools: bytes
    whole: bytes | None = None


SORTED = orjson.OPT_SORT_KEYS
HINT = b'"cache_control"'


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in body.get("messages") or [] if isinstance(m, dict)]


def keys_of(body: dict[str, Any]) -> Keys:
    """The keys of a chat body, every message digested."""
    messages = _messages(body)
    dumped = [orjson.dumps(m, option=SORTED) for m in messages]
    digests = [_exact(m, data) for m, data in zip(messages, dumped, strict=True)]
    hinted = any(HINT in data for data in dumped)
    # orjson's compact JSON of a list is its items' joined by commas (a test holds it to that)
    whole = None if hinted else hashlib.blake2b(b"[" + b",".join(dumped) + b"]", digest_size=16).digest()
    return Keys(digests, tools_key(body), whole)


def thread_state(
    body: dict[str, Any], answers: list[Answer], continues: dict[str, Any] | None, keys: Keys | None = None
) -> dict[str, Any]:
    """What a call's record keeps (CallRecord.thread) for `Threads.restore`: its upstream
    messages' and template inputs' digests (`keys`, made from `body` unless given), and each
    choice's message as the upstream answered; for the session graph (recorder/graph.py), the
    call and choice it continues, if any."""
    keys = keys or keys_of(body)
    kept = [{"message": a.message, "finish_reason": a.finish_reason} for a in answers]
    state = {"messages": [m.hex() for m in keys.messages], "tools": keys.tools.hex(), "answers": kept}
    return state | ({"continues": continues} if continues else {})


def _size(threads: tuple[Thread, ...]) -> int:
    return sys.getsizeof(threads) + sum(t.size for t in threads)


def _joined(threads: tuple[Thread, ...], thread: Thread) -> tuple[Thread, ...]:
    """A session's threads with one more, forgetting beyond THREADS_PER_SESSION the oldest that a
    later call continued, before any branch's latest: a subagent of many calls leaves its
    parent's thread to be continued when it returns."""
    joined = [*threads, thread]
    while len(joined) > THREADS_PER_SESSION:
        older = joined[:-RECENT_THREADS]
        joined.remove(next((t for t in older if t.continued), older[0]))
    return tuple(joined)


class Threads:
    """The open threads of recent sessions, and the end-of-turn token of each served model.
    Bounded by bytes (`budget`): the sessions used least recently are forgotten, and read back
    from the store when they come back."""

    def __init__(self, budget: int = 256 * 2**20) -> None:
        self.cache: ByteLRU[str, tuple[Thread, ...]] = ByteLRU(budget, _size)
        # a model and template: its end-of-turn token (or why none)
        self.end_of_turn: LRUCache[bytes, int | str] = LRUCache(END_OF_TURN_TEMPLATES)
        self.unrendering: set[str] = set()  # upstreams without /tokenize

    def add(
        self,
        session_id: str,
        call_id: str | None,
        state: dict[str, Any],
        prompt_ids: array[int],
        answers: list[Answer],
        whole: bytes | None = None,
    ) -> None:
        """A recorded call of the session: its `thread_state` (the digests made once, for the
        record and for this), its prompt ids (kept, not copied: nothing changes them), answers,
        and its keys' `whole`."""
        messages, tools = [bytes.fromhex(m) for m in state["messages"]], bytes.fromhex(state["tools"])
        thread = Thread(call_id, messages, tools, prompt_ids, answers, whole=whole)
        self.cache[session_id] = _joined(self.cache.get(session_id, ()), thread)

    def keys(self, session_id: str, body: dict[str, Any]) -> Keys:
        """`keys_of(body)`, digesting only the messages after the session's newest thread when the
        history is, as JSON, that thread's (its `whole`): digesting every message of every call was
        half of what token-in cost a short chat call (docs/benchmarks.md, "Store throughput")."""
        threads, messages = self.cache.get(session_id, ()), _messages(body)
        held = threads[-1] if threads else None
        n = len(held.messages) if held is not None else 0
        # its last message first: a call continuing another thread (a subagent's) skips the pass
        if held is None or held.whole is None or not 0 < n < len(messages):
            return keys_of(body)
        if exact(messages[n - 1]) != held.messages[-1]:
            return keys_of(body)
        start = orjson.dumps(messages[:n], option=SORTED)
        running = hashlib.blake2b(start[:-1], digest_size=16)  # the list without its closing bracket
        check = running.copy()
        check.update(b"]")
        if check.digest() != held.whole:
            return keys_of(body)
        later = [orjson.dumps(m, option=SORTED) for m in messages[n:]]
        for data in later:
            running.update(b"," + data)
        running.update(b"]")
        digests = [_exact(m, data) for m, data in zip(messages[n:], later, strict=True)]
        whole = None if any(HINT in data for data in later) else running.digest()
        return Keys(held.messages + digests, tools_key(body), whole)

    def restore(self, session_id: str, calls: list[ThreadRecord]) -> tuple[Thread, ...]:
        """Learn the threads of recorded calls of the session (newest first) that this proxy did
        not serve, or has forgotten: another proxy's, or its own before a restart. The session's
        threads, kept or not (a session larger than the cache's budget is continued all the same),
        or none when no thread was new. Which answer each call continued is read from the records
        (by call id) before any thread is kept, so that a thread enters the cache as memory would
        hold it, and the eviction drops continued threads first whichever way the state came."""
        firsts: dict[str, dict[int, str]] = {}  # a call id: for each of its answers, the call that continued it first
        for call in reversed(calls):  # oldest first: the first continuer wins
            continues = call.thread.get("continues") if isinstance(call.thread, dict) else None
            if isinstance(continues, dict) and isinstance(continues.get("call"), str):
                firsts.setdefault(continues["call"], {}).setdefault(int(continues.get("choice") or 0), call.call_id)
        threads = self.cache.get(session_id, ())
        for thread in threads:
            for answer, first in firsts.get(str(thread.call_id), {}).items():
                thread.continued.setdefault(answer, first)
        known = {t.call_id for t in threads}
        new = False
        for call in reversed(calls):
            if call.call_id in known:
                continue
            state = call.thread
            try:
                answers = [
                    Answer(a["message"], array("i", ids), a["finish_reason"])
                    for a, ids in zip(state["answers"], call.sampled, strict=True)
                ]
                messages = [bytes.fromhex(m) for m in state["messages"]]
                thread = Thread(
                    call.call_id,
                    messages,
                    bytes.fromhex(state["tools"]),
                    array("i", call.prompt_token_ids),
                    answers,
                    dict(firsts.get(call.call_id, {})),
                )
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("call %s/%d: its token-in state cannot be read back: %r", session_id, call.seq, exc)
                continue
            threads, new = _joined(threads, thread), True
        if not new:
            return ()
        self.cache[session_id] = threads
        return threads

    def _continued(
        self, threads: tuple[Thread, ...], messages: list[dict[str, Any]], keys: Keys
    ) -> tuple[Thread, Answer] | str:
        """The thread of `threads` (and its answer) that `messages` (their `keys`) continue, or why none does."""
        if not threads:
            return "first call of the session seen by this proxy"
        why = "the conversation is not a continuation of an earlier call's"
        for thread in sorted(threads, key=lambda t: -len(t.messages)):
            n = len(thread.messages)
            if len(messages) <= n + 1 or keys.messages[:n] != thread.messages:
                continue
            if thread.tools != keys.tools:
                why = "the tools or the chat template changed"
                continue
            for answer in thread.answers:
                if echoes(norm(messages[n]), norm(answer.message)):
                    return thread, answer
            why = f"message {n + 1} is not the assistant answer sampled there"
        return why

    def _unrendered(self, upstream: Upstream, why: str) -> Plan:
        if why == NO_RENDERING and upstream.base_url not in self.unrendering:  # found out once
            log.warning("upstream %s: %s; calls are sent as messages", upstream.base_url, why)
            self.unrendering.add(upstream.base_url)
        return Plan(None, why)

    async def plan(
        self,
        upstream: Upstream,
        session_id: str,
        body: dict[str, Any],
        call_id: str = "",
        recorded: Callable[[], Awaitable[list[ThreadRecord]]] | None = None,
        keys: Keys | None = None,
    ) -> Plan:
        """Token-in for the chat body of call `call_id` bound for `upstream`: its prompt ids, or
        why it starts a thread. A second call continuing the same answer (a retry, a fork) is told so.
        When no thread in memory continues, or the one that does leaves more than one message
        after its echo, the session's recorded threads are read back (`recorded`: one query) and
        the longest continuation is taken: another proxy served them, or this one before a
        restart. `keys`: the body's, made from it unless given."""
        messages = _messages(body)
        keys = keys or keys_of(body)
        found = self._continued(self.cache.get(session_id, ()), messages, keys)
        # A thread in memory that the call continues by more than one message after its echo may
        # be an older one: another proxy may have served the calls between (round robin).
        stale = not isinstance(found, str) and len(messages) > len(found[0].messages) + 2
        # Only a call that holds an assistant answer can continue a thread: no read for the others.
        read = stale or (isinstance(found, str) and any(m.get("role") == "assistant" for m in messages[:-1]))
        if read and recorded is not None and (restored := self.restore(session_id, await recorded())):
            found = self._continued(restored, messages, keys)
        if isinstance(found, str):
            return Plan(None, found)
        thread, answer = found
        if upstream.base_url in self.unrendering:
            return Plan(None, NO_RENDERING)
        template = tools_key({**body, "tools": None}) + str(body.get("model")).encode()
        eot = self.end_of_turn.get(template)
        if eot is None:
            eot = await end_of_turn(upstream, body)
            if isinstance(eot, int) or eot == NO_END_OF_TURN:  # not a passing failure: kept
                self.end_of_turn[template] = eot
        if isinstance(eot, str):
            return self._unrendered(upstream, eot)
        if eot in answer.sampled[:-1]:
            return Plan(None, f"the answer holds the end-of-turn token {eot} before its end")
        sequence = thread.prompt_ids + answer.sampled  # arrays: no id made a Python int
        closed = bool(answer.sampled) and answer.sampled[-1] == eot
        # The answer's end of turn is the n-th: its last sampled token (checked above: no other is
        # one), or the template's when it was cut before sampling one. numpy: 5 us at 30k ids.
        n = int(np.count_nonzero(np.frombuffer(thread.prompt_ids, np.intc) == eot)) + 1
        echoed = len(thread.messages) + 1
        spec = {"eot": eot, "n": n, "later": len(messages) - echoed, "closed": closed, "echoed": echoed}
        if not upstream.bridges:
            rendered = await render(upstream, body)
            if isinstance(rendered, str):
                return self._unrendered(upstream, rendered)
            made = await bridge(
                rendered, spec, lambda: render(upstream, {**body, "messages": messages[:echoed]}, False)
            )
            if isinstance(made, str):
                return self._unrendered(upstream, made)
            sequence.extend(made)
        first = thread.continued.setdefault(thread.answers.index(answer), call_id)
        fork = None if first == call_id else f"a fork: call {first} continued this answer first"
        continues = {"call": thread.call_id, "choice": thread.answers.index(answer)}
        # An upstream that bridges (its vLLM cuts the bridge where it renders the request) is sent the thread.
        return Plan(sequence, None, fork, continues, spec if upstream.bridges else None)


NO_RENDERING = "the upstream has no /tokenize to render requests with (token-in needs it)"
NOT_TAKEN = "the upstream rendered the messages itself (it did not take kv_transfer_params)"
NOT_BRIDGED = "the upstream did not bridge the thread (its log says why)"
NO_END_OF_TURN = "the chat template closes no assistant turn with a token of its own"


def took(planned: array[int] | None, prompt: array[int], bridged: bool) -> bool:
    """Whether the upstream's prompt is the one token-in planned: the same ids, or when the
    upstream bridged, the thread's ids and more (compared as numpy views: no copy)."""
    if planned is None or (bridged and len(prompt) <= len(planned)):
        return False
    if not bridged:
        return prompt == planned
    return bool(np.array_equal(np.frombuffer(prompt, np.intc)[: len(planned)], np.frombuffer(planned, np.intc)))


async def render(upstream: Upstream, body: dict[str, Any], generation: bool = True) -> Ids | str:
    """The prompt ids of a chat body as the upstream's template renders them, or why not: with the
    generation prompt, or the last message left open (`continue_final_message`), if `generation`."""
    fields = {k: body[k] for k in ("model", "messages", "tools", "chat_template") if body.get(k) is not None}
    final = generation and bool(body.get("continue_final_message"))
    prompt = generation and not final and body.get("add_generation_prompt") is not False
    fields |= {
        "chat_template_kwargs": template_kwargs(body),
        "continue_final_message": final,
        "add_generation_prompt": prompt,
    }
    try:
        async with asyncio.timeout(RENDER_TIMEOUT):
            resp = await upstream.send("POST", "/tokenize", fields, at_root=True)
            data = parse_rendering(await upstream.read(resp))
    except Exception as exc:  # any failure only means no token-in for this call
        return f"the upstream could not render the request: {exc!r}"[:200]
    if data in ({"detail": "Not Found"}, {"detail": "Method Not Allowed"}):  # no such route (not: no such model)
        return NO_RENDERING
    tokens = data.get("tokens") if isinstance(data, dict) else None
    return tokens if resp.ok and isinstance(tokens, list | array) else f"/tokenize answered {resp.status}"


async def end_of_turn(upstream: Upstream, body: dict[str, Any]) -> int | str:
    """The token the template closes an assistant turn with, or why it was not found: two
    renderings that differ only in an answer's text ("yes", "no") agree again from that token on."""
    rendered = []
    for text in ("yes", "no"):
        messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": text}]
        tokens = await render(upstream, {**body, "messages": messages}, generation=False)
        if isinstance(tokens, str):
            return tokens
        rendered.append(tokens)
    a, b = rendered
    same = next((k for k in range(min(len(a), len(b))) if a[-1 - k] != b[-1 - k]), None)
    if not same:  # nothing after the answer, or no difference at all
        return NO_END_OF_TURN
    return a[len(a) - same]
