"""Is a chat template append-only? `rl-proxy doctor` renders multi-turn conversations (plain,
with tool calls, with reasoning) through a tokenizer's chat template and reports every place
where the next turn's prompt does not start with the previous prompt plus the assistant's
turn, because each such place breaks prefix merging for every session that goes through it.

What it finds is about the template, not a model: it assumes the model wrote exactly what the
template renders for its turn. Works with any Hugging Face tokenizer that has a chat template.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date
from typing import Any

WINDOW = 12

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "plain": (
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another?"},
            {"role": "assistant", "content": "Red."},
        ],
        None,
    ),
    "tools": (
        [
            {"role": "system", "content": "You use tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
            {"role": "assistant", "content": "Sunny and 21 C."},
            {"role": "user", "content": "Thanks."},
            {"role": "assistant", "content": "You are welcome."},
        ],
        [TOOL],
    ),
    "reasoning": (
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
            {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": "6", "reasoning_content": "Three plus three is six."},
        ],
        None,
    ),
}


@dataclass(frozen=True)
class Finding:
    conversation: str
    turn: int  # index of the assistant message whose turn the next prompt does not extend
    problem: str
    detail: str = ""


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, generation: bool) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=generation, tokenize=True, return_dict=False
    )
    ids = out["input_ids"] if isinstance(out, dict) else out
    return list(ids)


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def check_conversation(tokenizer: Any, name: str, messages: list[dict[str, Any]], tools: Any) -> list[Finding]:
    findings = []
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for k, i in enumerate(turns):
        prompt = _render(tokenizer, messages[:i], tools, True)
        full = _render(tokenizer, messages[: i + 1], tools, False)
        text = tokenizer.decode(full[len(prompt) :])
        if full[: len(prompt)] != prompt:
            findings.append(Finding(name, i, "rendering the assistant's turn changes the prompt before it"))
            continue
        message = messages[i]
        for call in message.get("tool_calls") or []:
            if call["function"]["name"] not in text:
                findings.append(Finding(name, i, "drops tool calls from the assistant's turn", repr(text)))
        if message.get("reasoning_content") and message["reasoning_content"] not in text:
            findings.append(Finding(name, i, "does not render the assistant's reasoning", repr(text)))
        if k + 1 == len(turns):
            continue
        turn_ids = full[len(prompt) :]
        eos = tokenizer.eos_token_id
        sampled = turn_ids[: turn_ids.index(eos) + 1] if eos in turn_ids else turn_ids
        expected = prompt + sampled
        following = _render(tokenizer, messages[: turns[k + 1]], tools, True)
        if following[: len(expected)] != expected:
            at = _first_difference(expected, following)
            window = slice(max(0, at - WINDOW), at + WINDOW)
            problem = (
                "drops earlier reasoning"
                if message.get("reasoning_content") and message["reasoning_content"] not in tokenizer.decode(following)
                else "the next prompt does not extend this turn"
            )
            detail = f"at token {at}: turn had {tokenizer.decode(expected[window])!r}, next prompt has {tokenizer.decode(following[window])!r}"  # noqa: E501
            findings.append(Finding(name, i, problem, detail))
    rendered = tokenizer.decode(_render(tokenizer, messages, tools, False))
    today = date.today()
    if any(d in rendered for d in (today.isoformat(), today.strftime("%d %b %Y"), today.strftime("%B %d, %Y"))):
        findings.append(Finding(name, 0, "adds the current date: sessions that cross midnight will not merge"))
    return findings


def check_template(tokenizer: Any) -> list[Finding]:
    """Every finding over the built-in conversations (empty: the template is append-only)."""
    if not getattr(tokenizer, "chat_template", None):
        return [Finding("-", 0, "the tokenizer has no chat template")]
    findings = []
    for name, (messages, tools) in CONVERSATIONS.items():
        try:
            findings += check_conversation(tokenizer, name, messages, tools)
        except Exception as exc:  # a template that cannot render a conversation is a finding
            findings.append(Finding(name, 0, "the template fails on this conversation", f"{type(exc).__name__}: {exc}"))
    return findings
