"""Which session a request belongs to, without any change to the harness.

In order of precedence: a `/s/{session}/v1/...` path prefix, an `X-Session-Id` header, the API
key (`Authorization: Bearer KEY` or `x-api-key: KEY`). A key may carry the session's labels as
comma-separated `name=value` pairs, for example `run=exp1,task=t7,group=t7-a,id=ep3`: `id` names
the session, `run`, `task` and `group` label it, `model` names its policy model (the name its
harness's own work asks for: recorder/graph.py), other names go to its metadata. Keys issued by
the admin API are opaque and map to their session.

A key is a credential, and harnesses often send a real provider key: the store keeps only its
digest, and a key without `id=` names its session only when it is a short plain name (`ep-3`,
`run=exp1,task=t7`); a long key or one shaped like an API key (`sk-...`) gets the session id
`key-<16 hex of its SHA-256>` instead.
"""

from __future__ import annotations

import hashlib
from typing import Any
from urllib.parse import unquote

from starlette.requests import Request

from proxy.errors import BadRequest
from recorder import SessionInfo

DEFAULT_SESSION = "default"
LABELS = {"run": "run", "task": "task_id", "group": "group_id", "model": "policy_model"}
SECRET_PREFIXES = ("sk-", "sk_", "rlp-", "rk-", "pk-", "xai-", "gsk_", "hf_", "AIza", "ghp_", "github_pat_")
MAX_NAMING_KEY = 48  # provider keys are longer (OpenAI's 51 and more, Anthropic's about 108)
MAX_LABEL = 256  # the store's column width


def request_key(request: Request) -> str:
    """The session key a request carries; DEFAULT_SESSION if it carries none."""
    in_path = request.path_params.get("session")
    if in_path:
        return unquote(in_path)
    header = request.headers.get("x-session-id")
    if header:
        return header.strip()
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    api_key = request.headers.get("x-api-key", "").strip()
    return api_key or DEFAULT_SESSION


def parse_key(key: str) -> SessionInfo:
    """A new session's id and labels as encoded in its key (see the module docstring)."""
    if "\x00" in key:
        raise BadRequest("the session key contains a NUL character")
    opaque = SessionInfo(id=session_id_of(key), key=key)
    if "=" not in key:
        return opaque
    fields: dict[str, str] = {}
    metadata: dict[str, str] = {}
    for part in key.split(","):
        name, sep, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name:
            return opaque
        if len(value) > MAX_LABEL:
            raise BadRequest(f"session key label {name[:32]!r} is over {MAX_LABEL} characters")
        if name == "id":
            fields["id"] = value
        elif name in LABELS:
            fields[LABELS[name]] = value
        else:
            metadata[name] = value
    return SessionInfo(
        id=fields.get("id") or opaque.id,
        key=key,
        run=fields.get("run"),
        task_id=fields.get("task_id"),
        group_id=fields.get("group_id"),
        policy_model=fields.get("policy_model"),
        metadata=metadata,
    )


def session_id_of(key: str) -> str:
    """The id of a session named by its whole key: the key itself only if it is safe to keep."""
    if len(key) <= MAX_NAMING_KEY and not key.startswith(SECRET_PREFIXES):
        return key
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def forced_tool_choice(choice: str, body: dict[str, Any]) -> str | dict[str, Any] | None:
    """The session's tool choice for the upstream `body`; None leaves the call's own. A named
    tool is forced only where offered (forcing one a call lacks would be refused), and marked
    `strict` in the body's own copy of the tools: vLLM's hermes parser constrains only a forced
    call's envelope, and `strict` pins its arguments to the tool's schema as well."""
    tools = body.get("tools")
    if not tools or not isinstance(tools, list):
        return None
    if choice in ("auto", "required", "none"):
        return choice
    functions = [tool.get("function") if isinstance(tool, dict) else None for tool in tools]
    names = [function.get("name") if isinstance(function, dict) else None for function in functions]
    if choice not in names:
        return None
    at = names.index(choice)
    body["tools"] = [
        *tools[:at],
        {**tools[at], "function": {**tools[at]["function"], "strict": True}},
        *tools[at + 1 :],
    ]
    return {"type": "function", "function": {"name": choice}}


def force_sampling(session: SessionInfo | None, body: dict[str, Any]) -> dict[str, Any]:
    """Set the session's own sampling settings (admin API) in the upstream `body`; return the
    changes made, {name: [was, now]}."""
    rewrites: dict[str, Any] = {}
    forced = session.sampling.model_dump(exclude_none=True) if session and session.sampling else {}
    if "tool_choice" in forced:
        forced["tool_choice"] = forced_tool_choice(forced["tool_choice"], body)
        if isinstance(forced["tool_choice"], dict):  # the forced tool went strict (a template may render it)
            rewrites["strict"] = [None, forced["tool_choice"]["function"]["name"]]
    for name, value in forced.items():
        if value is not None and body.get(name) != value:
            rewrites[name] = [body.get(name), value]
            body[name] = value
    return rewrites
