"""Token capture from upstream answers: what vLLM returned, taken apart and put back together.

Pure functions over response bodies and stream chunks, shared by every API route:
`Capture` collects prompt token ids, sampled token ids and per-token logprobs from a whole
response or chunk by chunk, and assembles a streamed answer into the non-streamed shape for the
record. `client_view` removes the fields the proxy asked for on the client's behalf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from recorder import Completion

REASONING = ("reasoning_content", "reasoning")  # litellm's name and vLLM's (0.32)


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
    """Tokens of one call, from a whole response (`add_response`) or its stream chunks."""

    prompt_token_ids: list[int] = field(default_factory=list)
    choices: dict[int, _Choice] = field(default_factory=dict)
    head: dict[str, Any] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    text_without_ids: bool = False  # a stream chunk sampled text but carried no token ids

    def _prompt(self, obj: dict[str, Any]) -> None:
        if not self.prompt_token_ids and obj.get("prompt_token_ids"):
            self.prompt_token_ids = list(obj["prompt_token_ids"])

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
    """Null (in place) the token fields the client did not ask for; return the body.

    vLLM itself answers such a client with these fields present and null, so the client sees
    exactly what it would have seen without the proxy.
    """
    if not keep_tokens and body.get("prompt_token_ids") is not None:
        body["prompt_token_ids"] = None
    for choice in body.get("choices") or []:
        if not keep_tokens:
            for name in ("token_ids", "prompt_token_ids"):
                if choice.get(name) is not None:
                    choice[name] = None
        if not keep_logprobs and choice.get("logprobs") is not None:
            choice["logprobs"] = None
    return body
