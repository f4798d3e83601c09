"""Dataset export. For now `calls`: one JSON object per recorded call (fuller kinds: issue 4)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

from recorder.records import CallRecord, Completion
from recorder.store import Store


def call_json(call: CallRecord) -> dict[str, Any]:
    """A call as an export row; the first choice's tokens are also at the top level."""
    first = call.completions[0] if call.completions else Completion(0, [], [], None)
    return {
        **call.flat(),
        "started_at": call.started_at.isoformat(),
        "finished_at": call.finished_at.isoformat(),
        "completion_token_ids": first.token_ids,
        "logprobs": first.logprobs,
        "finish_reason": first.finish_reason,
        "completions": [asdict(c) for c in call.completions],
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
