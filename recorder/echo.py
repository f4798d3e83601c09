"""What of a sampled answer a harness echoes back as its next message, and whether a message is
that echo: the proxy's token-in (proxy/threads.py) continues a thread on it, and the session
graph (recorder/graph.py) finds by it which of a call's choices an episode went on with."""

from __future__ import annotations

import re
from typing import Any

import orjson

THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts
        content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return content.strip() if isinstance(content, str) else ""


def _arguments(value: Any) -> Any:
    try:
        return orjson.loads(value) if isinstance(value, str) else value
    except orjson.JSONDecodeError:
        return value


def norm(message: dict[str, Any]) -> tuple[Any, ...]:
    """What of the model's own answer a harness echoes back and `echoes` compares: role, text
    (trimmed), tool calls (name and arguments, ids aside). Only that echo is compared so loosely;
    every earlier message is compared `exact`."""
    calls = tuple(
        (str(fn.get("name")), orjson.dumps(_arguments(fn.get("arguments")), option=orjson.OPT_SORT_KEYS))
        for fn in ((c.get("function") or {}) for c in message.get("tool_calls") or [] if isinstance(c, dict))
    )
    return message.get("role"), _text(message.get("content")), calls


def echoes(echoed: tuple[Any, ...], sampled: tuple[Any, ...]) -> bool:
    """Whether a message is a sampled answer as the harness sends it back: as it was, or with its
    `<think>` blocks stripped."""
    role, text, calls = sampled
    return echoed in (sampled, (role, THINK.sub("", text).strip(), calls))
