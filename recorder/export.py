"""Dataset export. For now `calls`: one JSON object per recorded call (fuller kinds: issue 4)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from recorder.records import CallRecord
from recorder.store import Store


def call_json(call: CallRecord) -> dict[str, Any]:
    """A call as an export row; the first choice's tokens are also at the top level."""
    first = call.completions[0] if call.completions else None
    return {
        "session_id": call.session_id,
        "seq": call.seq,
        "api": call.api,
        "model": call.model,
        "upstream": call.upstream,
        "stream": call.stream,
        "ok": call.ok,
        "http_status": call.http_status,
        "error": call.error,
        "policy_version": call.policy_version,
        "policy_version_end": call.policy_version_end,
        "started_at": call.started_at.isoformat(),
        "latency_ms": round(call.latency_ms, 3),
        "prompt_token_ids": call.prompt_token_ids,
        "completion_token_ids": first.token_ids if first else [],
        "logprobs": first.logprobs if first else [],
        "finish_reason": first.finish_reason if first else None,
        "completions": [
            {
                "index": c.index,
                "token_ids": c.token_ids,
                "logprobs": c.logprobs,
                "finish_reason": c.finish_reason,
            }
            for c in call.completions
        ],
        "request": call.request,
        "response": call.response,
    }


async def export_calls_jsonl(store: Store, out: Path, on_row: Callable[[], None] | None = None) -> int:
    """Write every call to `out` as JSON lines, streaming from the store; return the count."""
    count = 0
    tmp = out.with_name(out.name + ".partial")
    with open(tmp, "wb") as f:
        async for call in store.iter_calls():
            f.write(orjson.dumps(call_json(call)) + b"\n")
            count += 1
            if on_row is not None:
                on_row()
    tmp.replace(out)
    return count
