"""Hand-built data the tests share: a recorded call, and the `add` tool a request can force."""

from __future__ import annotations

from datetime import timedelta

from recorder import CallRecord, Completion
from recorder.store import utcnow

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
FORCE_ADD = {"type": "function", "function": {"name": "add"}}


def call(session: str, seq: int, tokens: list[int], ok: bool = True) -> CallRecord:
    now = utcnow()
    return CallRecord(
        session_id=session,
        seq=seq,
        api="chat.completions",
        model="m",
        upstream="http://u/v1",
        stream=False,
        request={"messages": [{"role": "user", "content": f"{session}/{seq}"}]},
        response={"id": f"r{seq}"},
        ok=ok,
        http_status=200 if ok else 502,
        error=None if ok else "down",
        prompt_token_ids=[1, 2, 3, seq],
        completions=[Completion(0, tokens, [-0.5] * len(tokens), "stop")],
        policy_version="v1",
        policy_version_end="v2",
        started_at=now,
        finished_at=now + timedelta(milliseconds=5),
    )
