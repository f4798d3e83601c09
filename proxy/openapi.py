"""Request bodies of the model routes as they appear in the proxy's OpenAPI document.

The routes read their bodies raw (they forward what they do not know), so FastAPI cannot derive
these; they are written here, minimal and open (other fields are allowed and forwarded), for
clients that read /openapi.json and for the schemathesis fuzz test (tests/proxy/test_fuzz.py).
"""

from __future__ import annotations

from typing import Any

STRING = {"type": "string"}
CONTENT = {"anyOf": [STRING, {"type": "array", "items": {"type": "object"}}]}
MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {"role": {"type": "string", "enum": ["system", "user", "assistant"]}, "content": CONTENT},
}
COMMON = {
    "model": STRING,
    "stream": {"type": "boolean"},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "tools": {"type": "array", "items": {"type": "object"}},
}


def body(required: list[str], **properties: Any) -> dict[str, Any]:
    schema = {"type": "object", "required": required, "properties": {**COMMON, **properties}}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


CHAT = body(["model", "messages"], messages={"type": "array", "items": MESSAGE}, max_tokens={"type": "integer"})
COMPLETIONS = body(["model", "prompt"], prompt={"anyOf": [STRING, {"type": "array"}]}, max_tokens={"type": "integer"})
MESSAGES = body(
    ["model", "messages", "max_tokens"],
    messages={"type": "array", "items": MESSAGE},
    max_tokens={"type": "integer"},
    system=CONTENT,
)
RESPONSES = body(
    ["model", "input"],
    input=CONTENT,
    instructions=STRING,
    previous_response_id=STRING,
    max_output_tokens={"type": "integer"},
)
