"""A request's body: read within the proxy's limits as a JSON object, and the JSON types of the
fields the translating routes hand to litellm, checked."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from fastapi import Request

from proxy.errors import BadRequest, BodyTimeout, BodyTooLarge, require_json
from proxy.settings import Settings


async def read_json(request: Request, settings: Settings) -> dict[str, Any]:
    """The request body as a JSON object, or a 400/408/413 in the OpenAI error shape. A client
    that takes longer than `body_timeout` to send its body (slow loris) is answered 408 and its
    connection closed, so stalled clients cannot pile up connections. A body not sent as JSON
    is a 415 (`require_json`)."""
    require_json(request)
    limit = settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body of {declared} bytes is over the limit of {limit} bytes")
    raw = bytearray()  # grown in place: `bytes +=` copied the whole body for every part
    try:
        async with asyncio.timeout(settings.body_timeout):
            async for part in request.stream():
                raw += part
                if len(raw) > limit:
                    raise BodyTooLarge(f"request body is over the limit of {limit} bytes")
    except TimeoutError as exc:
        raise BodyTimeout(f"the request body was not received within {settings.body_timeout:g} s") from exc
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, not {type(body).__name__}")
    model = body.get("model", "")  # kept in a column of its own: 256 characters, no NUL (PostgreSQL)
    if not isinstance(model, str) or len(model) > 256 or "\x00" in model:
        raise BadRequest("'model' must be a string of at most 256 characters, without NUL", param="model")
    return body


NUMBER = (int, float)
# The types of the fields that the translating routes (Messages, Responses) hand to litellm's
# translators, which assume them: any other type is a 400 here rather than a crash there.
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "stream": (bool,),
    "tools": (list,),
    "tool_choice": (str, dict),
    "metadata": (dict,),
    "temperature": NUMBER,
    "top_p": NUMBER,
    "top_k": (int,),
    "max_tokens": (int,),
    "max_output_tokens": (int,),
    "instructions": (str,),
    "system": (str, list),
    "stop_sequences": (list,),
    "parallel_tool_calls": (bool,),
    "previous_response_id": (str,),
    "text": (dict,),
    "reasoning": (dict,),
    "thinking": (dict,),
    "user": (str,),
}
KINDS = {str: "a string", bool: "a boolean", list: "a list", dict: "an object", int: "an integer", float: "a number"}


def check_types(body: dict[str, Any]) -> None:
    """A 400 for a known field of the wrong JSON type (true is not a number here)."""
    for name, types in FIELD_TYPES.items():
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            kinds = " or ".join(KINDS[t] for t in types)
            raise BadRequest(f"'{name}' must be {kinds}", param=name)
