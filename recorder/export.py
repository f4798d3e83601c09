"""Dataset export: recorded calls, RL training sequences or SFT conversations, as JSON lines,
Parquet or a Hugging Face `datasets` directory.

Rows are produced session by session from the store and written in batches, so memory stays
bounded by one session and one batch. Parquet and HF exports have fixed schemas; the free-form
request, response and rewrites of `calls` rows become JSON strings there.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from recorder.graph import Placement, build
from recorder.records import CallRecord, Completion, SessionInfo
from recorder.store import Store
from recorder.trajectories import TrainingSequence

KINDS = ("calls", "rl", "sft")
FORMATS = ("jsonl", "parquet", "hf")
BATCH = 512


@dataclass(frozen=True)
class Filter:
    """Which sessions and calls to export; None means no condition."""

    run: str | None = None
    task_id: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    min_reward: float | None = None
    api: str | None = None

    def session(self, s: SessionInfo) -> bool:
        if self.min_reward is not None and (s.reward is None or s.reward < self.min_reward):
            return False
        return self.task_id is None or s.task_id == self.task_id

    def call(self, c: CallRecord) -> bool:
        return (
            (self.api is None or c.api == self.api)
            and (self.since is None or c.started_at >= self.since)
            and (self.until is None or c.started_at < self.until)
        )


def _graph(placement: Placement) -> dict[str, Any]:
    """Where a call sits in its session's graph (recorder/graph.py)."""
    return {
        "purpose": placement.purpose,
        "edge": placement.edge,
        "parent_call": placement.parent,
        "root_call": placement.root,
        "trained": placement.trained,
    }


def call_json(call: CallRecord, placement: Placement) -> dict[str, Any]:
    """A call as an export row; the first choice's tokens are also at the top level."""
    first = call.completions[0] if call.completions else Completion(0, [], [], None)
    return {
        **call.flat(),
        **_graph(placement),
        "started_at": call.started_at.isoformat(),
        "finished_at": call.finished_at.isoformat(),
        "completion_token_ids": first.token_ids,
        "logprobs": first.logprobs,
        "finish_reason": first.finish_reason,
        "completions": [asdict(c) for c in call.completions],
    }


def sequence_json(seq: TrainingSequence, placement: Placement) -> dict[str, Any]:
    """A training sequence; its graph fields are its first call's (how the row attached)."""
    return {
        **_graph(placement),
        "session_id": seq.session_id,
        "chain": seq.chain,
        "run": seq.run,
        "task_id": seq.task_id,
        "group_id": seq.group_id,
        "reward": seq.reward,
        "truncated": seq.truncated,
        "input_ids": seq.input_ids,
        "loss_mask": seq.loss_mask,
        "logprobs": seq.logprobs,
        "calls": seq.calls,
        "span_starts": [s.start for s in seq.spans],
        "span_ends": [s.end for s in seq.spans],
        "policy_versions": [s.version for s in seq.spans],
        "span_rewards": [s.reward for s in seq.spans],
    }


def _message(raw: dict[str, Any]) -> dict[str, Any]:
    """A chat message in the one shape every SFT row shares (content never null)."""
    calls = raw.get("tool_calls") or None
    if calls is not None:
        calls = [
            {"id": c.get("id"), "type": c.get("type", "function"), "function": dict(c.get("function") or {})}
            for c in calls
        ]
    content = raw.get("content")
    if isinstance(content, list):  # content parts: keep the text
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return {
        "role": raw.get("role"),
        "content": content or "",
        "tool_calls": calls,
        "tool_call_id": raw.get("tool_call_id"),
    }


def sft_json(seq: TrainingSequence, calls: dict[int, CallRecord]) -> dict[str, Any] | None:
    """The conversation of a chain: its last call's messages and the answer the chain sampled
    (of a call with several choices, the chain's own choice)."""
    last = calls[seq.calls[-1]]
    chosen = seq.spans[-1].choice if seq.spans else 0
    choices = [c for c in (last.response or {}).get("choices") or [] if isinstance(c, dict)]
    answer = next((c for c in choices if c.get("index", 0) == chosen), None)
    messages = last.request.get("messages")
    if answer is None or not isinstance(messages, list) or "message" not in answer:
        return None
    return {
        "messages": [_message(m) for m in [*messages, answer["message"]]],
        "session_id": seq.session_id,
        "task_id": seq.task_id,
        "reward": seq.reward,
    }


async def rows(
    store: Store,
    kind: str,
    where: Filter,
    merge: bool = True,
    on_session: Callable[[int], None] | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """Export rows of `kind`, session by session; `on_session(total)` is called after each."""
    if kind not in KINDS:
        raise ValueError(f"unknown export kind {kind!r}; choose one of {', '.join(KINDS)}")
    sessions = [s for s in await store.list_sessions(run=where.run) if where.session(s)]
    for session in sessions:
        if on_session is not None:
            on_session(len(sessions))
        calls = [c async for c in store.iter_calls(session.id)]
        # The whole session's graph, before the filter: what is trained is decided there alone.
        graph = build(calls, session, await store.call_rewards(session.id), merge)
        placed = {p.seq: p for p in graph.placements}
        if kind == "calls":
            for call in calls:
                if where.call(call):
                    yield call_json(call, placed[call.seq])
            continue
        by_seq = {c.seq: c for c in calls}
        for seq in [*graph.trained.sequences, *graph.aside.sequences]:
            if not all(where.call(by_seq[n]) for n in seq.calls):
                continue
            row = sequence_json(seq, placed[seq.spans[0].seq]) if kind == "rl" else sft_json(seq, by_seq)
            if row is not None:
                yield row


def _arrow_schema(kind: str) -> Any:
    import pyarrow as pa

    graph_fields = [  # recorder/graph.py: where a row sits in its session
        ("purpose", pa.string()),
        ("edge", pa.string()),
        ("parent_call", pa.int32()),
        ("root_call", pa.int32()),
        ("trained", pa.bool_()),
    ]

    if kind == "rl":
        return pa.schema(
            [
                *graph_fields,
                ("session_id", pa.string()),
                ("chain", pa.int32()),
                ("run", pa.string()),
                ("task_id", pa.string()),
                ("group_id", pa.string()),
                ("reward", pa.float64()),
                ("truncated", pa.bool_()),
                ("input_ids", pa.list_(pa.int32())),
                ("loss_mask", pa.list_(pa.int8())),
                ("logprobs", pa.list_(pa.float32())),
                ("calls", pa.list_(pa.int32())),
                ("span_starts", pa.list_(pa.int32())),
                ("span_ends", pa.list_(pa.int32())),
                ("policy_versions", pa.list_(pa.string())),
                ("span_rewards", pa.list_(pa.float64())),
            ]
        )
    if kind == "sft":
        function = pa.struct([("name", pa.string()), ("arguments", pa.string())])
        tool_call = pa.struct([("id", pa.string()), ("type", pa.string()), ("function", function)])
        message = pa.struct(
            [
                ("role", pa.string()),
                ("content", pa.string()),
                ("tool_calls", pa.list_(tool_call)),
                ("tool_call_id", pa.string()),
            ]
        )
        return pa.schema(
            [
                ("messages", pa.list_(message)),
                ("session_id", pa.string()),
                ("task_id", pa.string()),
                ("reward", pa.float64()),
            ]
        )
    # calls: every field of a CallRecord (bodies as JSON strings), the first choice's at the top
    text, ids, floats = pa.string(), pa.list_(pa.int32()), pa.list_(pa.float32())
    completion = pa.struct([("index", pa.int32()), ("token_ids", ids), ("logprobs", floats), ("finish_reason", text)])
    return pa.schema(
        [
            ("session_id", text),
            ("seq", pa.int32()),
            ("api", text),
            ("model", text),
            ("upstream", text),
            ("stream", pa.bool_()),
            ("request", text),
            ("response", text),
            ("ok", pa.bool_()),
            ("http_status", pa.int32()),
            ("error", text),
            ("prompt_token_ids", ids),
            ("policy_version", text),
            ("policy_version_end", text),
            ("started_at", text),
            ("finished_at", text),
            ("rewrites", text),
            ("response_id", text),
            ("token_in", pa.bool_()),
            ("thread_start", text),
            ("call_id", text),
            ("latency_ms", pa.float64()),
            ("completion_token_ids", ids),
            ("logprobs", floats),
            ("finish_reason", text),
            ("completions", pa.list_(completion)),
            *graph_fields,
        ]
    )


def _flatten_bodies(row: dict[str, Any]) -> dict[str, Any]:
    """Free-form fields as JSON strings, so that every batch has one schema."""
    return {**row, **{name: orjson.dumps(row[name]).decode() for name in ("request", "response", "rewrites")}}


async def export(
    store: Store,
    out: Path,
    *,
    kind: str = "calls",
    fmt: str = "jsonl",
    where: Filter | None = None,
    merge: bool = True,
    on_session: Callable[[int], None] | None = None,
) -> int:
    """Write an export to `out` (a file, or a directory for `hf`); return the row count. An
    existing `out` is replaced only if it is a file or a dataset directory an export wrote."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if out.is_dir() and not is_dataset_dir(out):
        raise ValueError(f"{out} is a directory that no export wrote: it is not replaced")
    where = where or Filter()
    tmp = out.with_name(out.name + ".partial")
    parquet = tmp if fmt == "parquet" else out.with_name(out.name + ".partial.parquet")
    count = 0
    writer: Any = None
    batch: list[dict[str, Any]] = []

    def flush() -> None:
        nonlocal writer
        if not batch:
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist(batch, schema=_arrow_schema(kind))
        if writer is None:
            writer = pq.ParquetWriter(parquet, table.schema)
        writer.write_table(table)
        batch.clear()

    sink: Any = open(tmp, "wb") if fmt == "jsonl" else nullcontext()  # noqa: SIM115
    with sink as jsonl:
        async for row in rows(store, kind, where, merge, on_session):
            if jsonl is not None:
                jsonl.write(orjson.dumps(row) + b"\n")
            else:
                batch.append(_flatten_bodies(row) if kind == "calls" else row)
                if len(batch) >= BATCH:
                    flush()
            count += 1
    if fmt != "jsonl":
        flush()
        if writer is None:  # nothing matched: an empty file with the schema
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist([], schema=_arrow_schema(kind)), parquet)
        else:
            writer.close()
    if fmt == "hf":
        from datasets import Dataset

        shutil.rmtree(tmp, ignore_errors=True)
        Dataset.from_parquet(str(parquet)).save_to_disk(str(tmp))
        parquet.unlink()
    if out.is_dir():
        shutil.rmtree(out)
    tmp.replace(out)
    return count


def is_dataset_dir(path: Path) -> bool:
    """A directory as `datasets.save_to_disk` writes it, and nothing else in it."""
    names = {p.name for p in path.iterdir()}
    return {"dataset_info.json", "state.json"} <= names and all(
        n in ("dataset_info.json", "state.json") or n.endswith(".arrow") for n in names
    )
