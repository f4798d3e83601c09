"""Token capture from upstream answers: what vLLM returned, taken apart and put back together.

Pure functions over response bodies and stream chunks, shared by every API route:
`Capture` collects prompt token ids, sampled token ids and per-token logprobs from a whole
response or chunk by chunk, and assembles a streamed answer into the non-streamed shape for the
record. `client_view` removes the fields the proxy asked for on the client's behalf.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from recorder import Completion

REASONING = ("reasoning_content", "reasoning")  # litellm's name and vLLM's (0.32)
PROMPT_IDS = b'"prompt_token_ids":['  # as vLLM writes it: in a JSON string, its quotes would be escaped
MAX_ID = 2**31 - 1  # what the store's packed ids hold
# A chat answer's fields that no translated answer (Messages, Responses) carries: left out of
# what litellm translates, which had turned an agent's 100k prompt ids into JSON and back.
LEFT_TO_CHAT = ("assembled_from_stream", "prompt_token_ids")


Sent = tuple[bytes, "array[int]"]  # the prompt's ids token-in sent: as JSON (without brackets), as an array


def parse_answer(raw: bytes, sent: Sent | None = None) -> Any:
    """An upstream's answer or stream chunk: `orjson.loads(raw)`, except that a `prompt_token_ids`
    of the answer or of one of its choices comes back as an array of ids, read from its bytes by
    numpy; those that repeat `sent` byte for byte are taken from it, unread. An agent's prompt
    holds tens of thousands of ids, and a Python int made for each, then packed again, was the
    largest part of the proxy's work on a long call (docs/benchmarks.md, "Agent-sized calls").
    Ids found anywhere else, or not plain non-negative integers, leave the answer parsed as
    plain JSON."""
    if PROMPT_IDS not in raw:
        return orjson.loads(raw)
    pieces: list[bytes] = []
    found: list[array[int]] = []
    start = 0
    while (at := raw.find(PROMPT_IDS, start)) >= 0:
        begin = at + len(PROMPT_IDS)
        end = raw.find(b"]", begin)
        ids = _ids(raw, begin, end, sent) if end >= 0 else None
        if ids is None:
            return orjson.loads(raw)
        pieces += [raw[start:begin], str(len(found)).encode()]  # a placeholder: the ids' index
        found.append(ids)
        start = end
    data = orjson.loads(b"".join([*pieces, raw[start:]]))
    choices = data.get("choices") if isinstance(data, dict) else None
    holders = [data, *(choices if isinstance(choices, list) else [])]
    placed = 0
    for holder in holders:
        value = holder.get("prompt_token_ids") if isinstance(holder, dict) else None
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], int) and value[0] < len(found):
            holder["prompt_token_ids"], placed = found[value[0]], placed + 1
    return data if placed == len(found) else orjson.loads(raw)


TOKENS = b'"tokens":['  # a /tokenize answer's ids, as vLLM writes them


def parse_rendering(raw: bytes) -> Any:
    """A `/tokenize` answer: `orjson.loads(raw)`, its `tokens` an array read by numpy as
    `parse_answer` reads prompt ids (token-in's bridge cut by the proxy, docs/benchmarks.md)."""
    at = raw.find(TOKENS)
    end = raw.find(b"]", at) if at >= 0 else -1
    ids = _ids(raw, at + len(TOKENS), end, None) if end >= 0 else None
    if ids is None:
        return orjson.loads(raw)
    data = orjson.loads(raw[: at + len(TOKENS)] + b"-1" + raw[end:])  # a placeholder no id can be
    if not isinstance(data, dict) or data.get("tokens") != [-1]:
        return orjson.loads(raw)
    data["tokens"] = ids
    return data


def _ids(raw: bytes, begin: int, end: int, sent: Sent | None) -> array[int] | None:
    """The comma-separated token ids of `raw[begin:end]` as an array, or None if they are not all
    plain ids. When they start with `sent`'s, whole, those are copied from its array."""
    ids = array("i")
    if sent is not None and sent[0] and raw.startswith(sent[0], begin) and raw[begin + len(sent[0])] in b",]":
        ids, begin = array("i", sent[1]), begin + len(sent[0]) + 1
    text = raw[begin:end]
    if not text.strip():
        return ids
    if text.translate(None, b"0123456789, "):  # numpy would read 1.5 as 1, and -1 as an id
        return None
    try:  # numpy stops at a value it cannot read (a warning, or an error under -W error)
        values = np.fromstring(text, dtype=np.int64, sep=",")
    except ValueError:
        return None
    if len(values) != text.count(b",") + 1 or values.max() > MAX_ID:
        return None
    ids.frombytes(values.astype(np.intc).tobytes())
    return ids


def _logprobs(choice: dict[str, Any]) -> list[float]:
    lp = choice.get("logprobs")
    if not lp:
        return []
    if lp.get("content") is not None:  # chat completions
        return [float(t["logprob"]) for t in lp["content"]]
    return [float(x) for x in lp.get("token_logprobs") or []]  # text completions


@dataclass
class _Choice:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    role: str = "assistant"
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    message: dict[str, Any] | None = None  # a whole (not streamed) chat answer's

    def add_tool_call_delta(self, delta: dict[str, Any]) -> None:
        call = self.tool_calls.setdefault(
            int(delta.get("index", len(self.tool_calls))),
            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
        )
        if delta.get("id"):
            call["id"] = delta["id"]
        if delta.get("type"):
            call["type"] = delta["type"]
        fn = delta.get("function") or {}
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""


@dataclass
class Capture:
    """Tokens of one call, from a whole response (`add_response`) or its stream chunks. The prompt's
    ids are made an array once, here: the record packs it as it is and token-in keeps it, so that
    an agent's tens of thousands of ids are not copied an int at a time again (docs/benchmarks.md)."""

    prompt_token_ids: array[int] = field(default_factory=lambda: array("i"))
    choices: dict[int, _Choice] = field(default_factory=dict)
    head: dict[str, Any] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    text_without_ids: bool = False  # a stream chunk sampled text but carried no token ids

    def _prompt(self, obj: dict[str, Any]) -> None:
        ids = obj.get("prompt_token_ids")
        if not self.prompt_token_ids and ids:
            self.prompt_token_ids = ids if isinstance(ids, array) else array("i", ids)  # parse_answer's, or not

    def add_response(self, body: dict[str, Any]) -> None:
        self._prompt(body)
        self.usage = body.get("usage")
        for raw in body.get("choices") or []:
            self._prompt(raw)
            choice = self.choices.setdefault(int(raw.get("index", 0)), _Choice())
            choice.token_ids = list(raw.get("token_ids") or [])
            choice.logprobs = _logprobs(raw)
            choice.finish_reason = raw.get("finish_reason")
            choice.message = raw.get("message") if isinstance(raw.get("message"), dict) else None

    def add_chunk(self, chunk: dict[str, Any]) -> None:
        if not self.head:
            self.head = {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        self._prompt(chunk)
        for raw in chunk.get("choices") or []:
            self._prompt(raw)
            choice = self.choices.setdefault(int(raw.get("index", 0)), _Choice())
            delta = raw.get("delta") or {}
            if not raw.get("token_ids") and (
                raw.get("text") or any(delta.get(k) for k in ("content", "tool_calls", *REASONING))
            ):
                self.text_without_ids = True
            choice.token_ids.extend(raw.get("token_ids") or [])
            choice.logprobs.extend(_logprobs(raw))
            if raw.get("finish_reason"):
                choice.finish_reason = raw["finish_reason"]
            if "text" in raw:  # text completions
                choice.text.append(raw["text"] or "")
            choice.role = delta.get("role") or choice.role
            choice.text.append(delta.get("content") or "")
            choice.reasoning.append(next((delta[k] for k in REASONING if delta.get(k)), ""))
            for call in delta.get("tool_calls") or []:
                choice.add_tool_call_delta(call)

    def incomplete(self) -> str | None:
        """Why the captured tokens cannot be trusted, if they cannot: the upstream's own count of
        prompt and completion tokens disagrees with the ids it sent (a stream chunk without
        ids, as vLLM's tool-call parsing has been known to send)."""
        sampled = sum(len(c.token_ids) for c in self.choices.values())
        if not self.usage or (sampled == 0 and not self.prompt_token_ids):
            return None  # no count to check, or an upstream that returns no ids (recorded as text)
        expected = self.usage.get("completion_tokens")
        if isinstance(expected, int) and sampled != expected:
            return f"token capture incomplete: {sampled} token ids for {expected} completion tokens"
        for c in self.choices.values():
            if len(c.logprobs) != len(c.token_ids):
                return f"token capture incomplete: {len(c.logprobs)} logprobs for {len(c.token_ids)} token ids"
        prompt = self.usage.get("prompt_tokens")
        if isinstance(prompt, int) and prompt != len(self.prompt_token_ids):
            return f"token capture incomplete: {len(self.prompt_token_ids)} prompt ids for {prompt} prompt tokens"
        return None

    def messages(self) -> dict[int, dict[str, Any]]:
        """Each choice's chat answer message, whole or assembled from the stream."""
        if all(c.message is not None for c in self.choices.values()):  # a whole answer: nothing to assemble
            return {i: c.message for i, c in self.choices.items() if c.message is not None}
        return {c["index"]: c.get("message") or {} for c in self.assembled(True)["choices"]}

    def completions(self) -> list[Completion]:
        return [Completion(i, c.token_ids, c.logprobs, c.finish_reason) for i, c in sorted(self.choices.items())]

    def assembled(self, chat: bool) -> dict[str, Any]:
        """A streamed answer in the shape the same call would have had without streaming."""
        choices = []
        for i, c in sorted(self.choices.items()):
            text = "".join(c.text)
            if not chat:
                choices.append({"index": i, "text": text, "finish_reason": c.finish_reason})
                continue
            message: dict[str, Any] = {"role": c.role, "content": text or None}
            if any(c.reasoning):
                message["reasoning_content"] = "".join(c.reasoning)
            if c.tool_calls:
                message["tool_calls"] = [c.tool_calls[k] for k in sorted(c.tool_calls)]
            choices.append({"index": i, "message": message, "finish_reason": c.finish_reason})
        # A stream that broke before the upstream's usage chunk: counted from the captured ids.
        counted = sum(len(c.token_ids) for c in self.choices.values())
        usage = self.usage or {"prompt_tokens": len(self.prompt_token_ids), "completion_tokens": counted}
        return {
            **self.head,
            "object": "chat.completion" if chat else "text_completion",
            "choices": choices,
            "usage": usage,
            "assembled_from_stream": True,
        }


def as_chunks(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole answer as the stream chunks that carry it: one per choice (its text or message as
    one delta, with all its token ids and logprobs), then the usage."""
    head: dict[str, Any] = {k: body[k] for k in ("id", "created", "model") if k in body}
    head["object"] = "chat.completion.chunk" if body.get("object") == "chat.completion" else body.get("object")
    chunks: list[dict[str, Any]] = []
    for choice in body.get("choices") or []:
        raw: dict[str, Any] = {k: v for k, v in choice.items() if k != "message"}
        if "message" in choice:
            message = choice["message"] or {}
            raw["delta"] = {k: v for k, v in message.items() if v is not None}
            for i, call in enumerate(raw["delta"].get("tool_calls") or []):
                call.setdefault("index", i)
        chunks.append({**head, "choices": [raw]})
    if chunks and body.get("prompt_token_ids") is not None:
        chunks[0]["prompt_token_ids"] = body["prompt_token_ids"]
    if body.get("usage"):
        chunks.append({**head, "choices": [], "usage": body["usage"]})
    return chunks


def reasoning_for_litellm(body: dict[str, Any]) -> dict[str, Any]:
    """Rename (in place) vLLM's `reasoning` to the `reasoning_content` that litellm's
    translators read, in a chunk's deltas or an answer's messages; return the body."""
    for choice in body.get("choices") or []:
        for part in (choice.get("delta"), choice.get("message")):
            if isinstance(part, dict) and part.get("reasoning") and not part.get("reasoning_content"):
                part["reasoning_content"] = part.pop("reasoning")
    return body


def client_view(body: dict[str, Any], keep_tokens: bool, keep_logprobs: bool) -> dict[str, Any]:
    """Null (in place) the token fields the client did not ask for; return the body. Prompt ids
    that `parse_answer` made an array go to a client that asked for them as a list again.

    vLLM itself answers such a client with these fields present and null, so the client sees
    exactly what it would have seen without the proxy.
    """
    for holder in [body, *(body.get("choices") or [])]:
        ids = holder.get("prompt_token_ids")
        if ids is not None:
            holder["prompt_token_ids"] = (ids.tolist() if isinstance(ids, array) else ids) if keep_tokens else None
    for choice in body.get("choices") or []:
        if not keep_tokens and choice.get("token_ids") is not None:
            choice["token_ids"] = None
        if not keep_logprobs and choice.get("logprobs") is not None:
            choice["logprobs"] = None
    return body
