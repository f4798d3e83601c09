"""The writer thread's SQL for a batch of calls: inserting them with their completions in two
statements, and numbering them from the database (after a unique violation). Used by
store.Store on its writer connection."""

from __future__ import annotations

import functools
from dataclasses import replace

from sqlalchemy import Connection, Insert, func, insert, select
from sqlalchemy.sql.dml import ReturningInsert

from recorder.records import CallRecord
from recorder.schema import CallRow, CompletionRow


def number_calls(conn: Connection, calls: list[CallRecord]) -> tuple[list[CallRecord], list[CallRecord]]:
    """(the calls as recorded, those of them still to insert). A call whose `call_id` is already
    stored (a write sent again after its commit's answer was lost) is returned as stored. The
    others are numbered so that none takes a number already in the database: one proxy numbers
    its calls itself and nothing changes (concurrent calls may commit out of order); when several
    proxies serve one session (round robin behind a load balancer), a call whose number another
    one took first moves to the end of the session."""
    stored_query = select(CallRow.call_id, CallRow.seq).where(CallRow.call_id.in_([c.call_id for c in calls]))
    stored = dict(conn.execute(stored_query).tuples().all())
    new = [c for c in calls if c.call_id not in stored]
    sessions, seqs = {c.session_id for c in new}, {c.seq for c in new}
    where = CallRow.session_id.in_(sessions), CallRow.seq.in_(seqs)
    taken = set(conn.execute(select(CallRow.session_id, CallRow.seq).where(*where)).tuples()) if new else set()
    last: dict[str, int] = {}
    if taken or len({(c.session_id, c.seq) for c in new}) < len(new):  # a number taken, or given twice here
        last_query = select(CallRow.session_id, func.max(CallRow.seq)).where(where[0]).group_by(CallRow.session_id)
        last = dict(conn.execute(last_query).tuples().all())
        for call in new:
            last[call.session_id] = max(last.get(call.session_id, 0), call.seq)
    recorded, to_insert = [], []
    for call in calls:
        if call.call_id in stored:
            recorded.append(replace(call, seq=stored[call.call_id]))
            continue
        if (call.session_id, call.seq) in taken:
            last[call.session_id] += 1
            call = replace(call, seq=last[call.session_id])
        taken.add((call.session_id, call.seq))
        recorded.append(call)
        to_insert.append(call)
    return recorded, to_insert


@functools.cache
def _inserts() -> tuple[ReturningInsert[int, str | None], Insert]:
    """The two INSERT statements, built once: SQLAlchemy memoizes a statement's cache key on the
    object, so one kept spares every batch building it and its key again (a fifth of the insert's
    CPU at one client, benchmarks/profile_proxy.py). The calls' ids come back with their call_id,
    in no order: asked in the order given (`sort_by_parameter_order`), SQLite has no form that
    keeps it, and SQLAlchemy sends one INSERT a call instead of one for the batch."""
    return insert(CallRow).returning(CallRow.id, CallRow.call_id), insert(CompletionRow)


def insert_calls(conn: Connection, calls: list[CallRecord]) -> None:
    """Bulk-insert calls and their completions: two statements for a whole batch. Every call has
    a call_id of its own (the writer's calls are made by this proxy)."""
    into_calls, into_completions = _inserts()
    ids = {call_id: id_ for id_, call_id in conn.execute(into_calls, [c.flat() for c in calls]).tuples()}
    completions = [
        {
            "call_id": ids[call.call_id],
            "choice_index": c.index,
            "token_ids": c.token_ids,
            "logprobs": c.logprobs,
            "finish_reason": c.finish_reason,
        }
        for call in calls
        for c in call.completions
    ]
    if completions:
        conn.execute(into_completions, completions)
