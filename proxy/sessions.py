"""Which session a request belongs to, without any change to the harness.

In order of precedence: a `/s/{session}/v1/...` path prefix, an `X-Session-Id` header, the API
key (`Authorization: Bearer KEY` or `x-api-key: KEY`). A key may carry the session's labels as
comma-separated `name=value` pairs, for example `run=exp1,task=t7,group=t7-a,id=ep3`: `id` names
the session (the whole key does when it is absent), `run`, `task` and `group` label it, other
names go to its metadata. Keys issued by the admin API are opaque and map to their session.
"""

from __future__ import annotations

from urllib.parse import unquote

from starlette.requests import Request

from recorder import SessionInfo

DEFAULT_SESSION = "default"
LABELS = {"run": "run", "task": "task_id", "group": "group_id"}


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
    if "=" not in key:
        return SessionInfo(id=key, key=key)
    fields: dict[str, str] = {}
    metadata: dict[str, str] = {}
    for part in key.split(","):
        name, sep, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name:
            return SessionInfo(id=key, key=key)
        if name == "id":
            fields["id"] = value
        elif name in LABELS:
            fields[LABELS[name]] = value
        else:
            metadata[name] = value
    return SessionInfo(
        id=fields.pop("id", key),
        key=key,
        run=fields.get("run"),
        task_id=fields.get("task_id"),
        group_id=fields.get("group_id"),
        metadata=metadata,
    )
