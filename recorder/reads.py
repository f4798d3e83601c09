"""The store's reads: sessions (filtered, sorted, paged and counted in SQL), runs, rewards,
calls in batches, and what the trainer stored of its runs and groups. Plain queries on the async
engine; those on a call's path (a session's look-up by key, its last call number, token-in's
threads read back) on a synchronous engine in reader threads (`Reads.read`). `Store` (store.py)
adds the writing and the session look-ups by key.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, get_args

from pydantic import BaseModel, ValidationError
from sqlalchemy import Connection, Engine, Select, String, bindparam, case, func, or_, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from recorder.episodes import EpisodeOutcome, RewardRule, Sampling, SessionStatus
from recorder.errors import store_error, translated
from recorder.records import CallRecord, Completion, LearnerView, SessionInfo, ThreadRecord
from recorder.schema import CallRow, CompletionRow, GroupRow, LearnerViewRow, RewardRow, RunRow, SessionRow

log = logging.getLogger("rl_proxy.recorder")


@functools.cache
def _recent_threads(limit: int) -> Select[Any]:
    """`Reads.recent_threads`'s query, the session a parameter: built and compiled once, not at
    every call that reads its threads back."""
    calls, completions = CallRow.__table__, CompletionRow.__table__
    session_id = bindparam("session_id", type_=String())
    mine = (calls.c.session_id == session_id, calls.c.thread.is_not(None))
    later = calls.alias("later")  # the calls that continued one: not correlated with the outer query
    went_on = later.c.thread["continues"]["call"].as_string()
    continued = select(went_on).where(later.c.session_id == session_id, went_on.is_not(None))
    open_ends = calls.c.call_id.not_in(continued)
    newest = select(calls.c.id).where(*mine).order_by(calls.c.seq.desc()).limit(limit)
    ends = select(calls.c.id).where(*mine, open_ends).order_by(calls.c.seq.desc()).limit(limit)
    return (
        select(calls.c.call_id, calls.c.seq, calls.c.prompt_token_ids, calls.c.thread, completions.c.token_ids)
        .join(completions, completions.c.call_id == calls.c.id)
        .where(or_(calls.c.id.in_(newest), calls.c.id.in_(ends)))
        .order_by(calls.c.seq.desc(), completions.c.choice_index)
    )


def session_info(row: SessionRow, reward: float | None = None, calls: int = 0, failures: int = 0) -> SessionInfo:
    return SessionInfo(
        id=row.id,
        key=row.key,
        run=row.run,
        task_id=row.task_id,
        group_id=row.group_id,
        policy_model=row.policy_model,
        metadata=dict(row.meta or {}),
        status=row.status if row.status in get_args(SessionStatus) else "ended",  # type: ignore[arg-type]
        created_at=row.created_at,
        ended_at=row.ended_at,
        reward=reward,
        calls=calls,
        outcome=_valid(EpisodeOutcome, row.outcome, row.id),
        sampling=_valid(Sampling, row.sampling, row.id),
        upstream_failures=failures,
    )


M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")


def _valid(model: type[M], value: dict[str, Any] | None, session_id: str) -> M | None:
    """A stored episode field read back; one that does not validate (written by hand, or by a
    bug) is left out with a warning, so that one bad session never stops a run or a page."""
    if value is None:
        return None
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        log.warning("session %r: its stored %s is not valid and is ignored: %s", session_id, model.__name__, exc)
        return None


_CALL_FIELDS = [f for f in CallRecord.__dataclass_fields__ if f != "completions"]


def _call_record(row: Any, completions: list[Completion]) -> CallRecord:
    fields = {name: row[name] for name in _CALL_FIELDS}
    fields["rewrites"] = fields["rewrites"] or {}
    fields["token_in"] = bool(fields["token_in"])  # None: written before version 6
    return CallRecord(**fields, completions=completions)


class Reads:
    """Read queries over `engine`; sessions as `SessionInfo` with their reward, calls and
    upstream failures counted."""

    engine: AsyncEngine
    _sessions: async_sessionmaker[AsyncSession]
    read_engine: Engine
    readers: ThreadPoolExecutor
    inline_reads: bool  # SQLite: reads on the event loop's thread

    async def read(self, work: Callable[[Connection], R]) -> R:
        """`work` on a connection of the synchronous read engine: the reads every new session and
        every thread read back make. Through the async engine over aiosqlite a read took several
        thread hops, and 0.56-0.68 ms of CPU at one client (1.5-2.0 ms at 16 at once) against
        0.24-0.29 in one hop to a reader thread, as a server's reads still go. SQLite's run on the
        event loop's thread: in WAL mode a read never waits for the writer, and a thread read back
        took 0.4-0.6 ms so against 1.8-2.3 through a reader thread at 16 clients, the hop's
        wake-ups and the GIL passing between the threads (docs/benchmarks.md, "The thread read
        back, measured again"); its busy timeout is short (READ_BUSY_TIMEOUT)."""

        def run() -> R:
            with self.read_engine.connect() as conn:
                return work(conn)

        if self.inline_reads:
            return run()
        return await asyncio.get_running_loop().run_in_executor(self.readers, run)

    @translated
    async def get_session(self, session_id: str) -> SessionInfo | None:
        sessions = await self.list_sessions(session_id=session_id)
        return sessions[0] if sessions else None

    @staticmethod
    def _reward_of_session() -> Any:
        return (
            select(func.sum(RewardRow.value))
            .where(RewardRow.session_id == SessionRow.id, RewardRow.call_seq.is_(None))
            .scalar_subquery()
        )

    @translated
    async def list_sessions(
        self,
        *,
        run: str | None = None,
        session_id: str | None = None,
        group_id: str | None = None,
        task_id: str | None = None,
        status: str | None = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
        sort: str = "created",
        descending: bool = False,
        offset: int = 0,
        limit: int | None = None,
    ) -> list[SessionInfo]:
        """Sessions that match every filter given, in `sort` order ("created", "reward", "calls",
        "run", "task", "status"), `limit` of them from `offset`."""
        # Correlated subqueries walk the (session_id, ...) indexes: one session costs the same
        # however many calls the store holds (a GROUP BY over all calls did not).
        reward = self._reward_of_session()
        calls = select(func.count()).where(CallRow.session_id == SessionRow.id).scalar_subquery()
        failures = (
            select(func.count())
            .where(CallRow.session_id == SessionRow.id, CallRow.http_status >= 500)
            .scalar_subquery()
        )
        by = {
            "created": SessionRow.created_at,
            "reward": reward,
            "calls": calls,
            "run": SessionRow.run,
            "task": SessionRow.task_id,
            "status": SessionRow.status,
        }[sort]
        # Sessions without a value last either way, on SQLite as on PostgreSQL (which differ).
        order = [by.desc().nulls_last(), SessionRow.id.desc()] if descending else [by.nulls_last(), SessionRow.id]
        query = self._filtered(
            select(SessionRow, reward, calls, failures),
            reward,
            run=run,
            session_id=session_id,
            group_id=group_id,
            task_id=task_id,
            status=status,
            min_reward=min_reward,
            max_reward=max_reward,
        )
        async with self._sessions() as s:
            result = await s.execute(query.order_by(*order).offset(offset).limit(limit))
            return [session_info(row, reward, n or 0, bad or 0) for row, reward, n, bad in result.all()]

    @translated
    async def count_sessions(self, **filters: Any) -> int:
        """How many sessions match the filters of `list_sessions`."""
        reward = self._reward_of_session()
        query = self._filtered(select(func.count()).select_from(SessionRow), reward, **filters)
        async with self.engine.connect() as conn:
            return int((await conn.execute(query)).scalar_one())

    @staticmethod
    def _filtered(
        query: Any,
        reward: Any,
        *,
        min_reward: float | None = None,
        max_reward: float | None = None,
        **equal: str | None,
    ) -> Any:
        columns = {
            "run": SessionRow.run,
            "session_id": SessionRow.id,
            "group_id": SessionRow.group_id,
            "task_id": SessionRow.task_id,
            "status": SessionRow.status,
        }
        for name, value in equal.items():
            if value is not None:
                query = query.where(columns[name] == value)
        if min_reward is not None:
            query = query.where(reward >= min_reward)
        if max_reward is not None:
            query = query.where(reward <= max_reward)
        return query

    @translated
    async def runs(self) -> list[dict[str, Any]]:
        """Each run: its sessions, how many ended ok, with a reward, the mean reward and how
        many reached 1.0, and when its first and last sessions started."""
        per_session = select(
            SessionRow.run, SessionRow.status, SessionRow.created_at, self._reward_of_session().label("reward")
        ).subquery()
        reward = per_session.c.reward
        query = (
            select(
                per_session.c.run,
                func.count().label("sessions"),
                func.sum(case((per_session.c.status == "ok", 1), else_=0)).label("ok"),
                func.count(reward).label("rewarded"),
                func.avg(reward).label("mean_reward"),
                func.sum(case((reward >= 1.0, 1), else_=0)).label("successes"),
                func.min(per_session.c.created_at).label("first"),
                func.max(per_session.c.created_at).label("last"),
            )
            .group_by(per_session.c.run)
            .order_by(func.max(per_session.c.created_at).desc())
        )
        async with self.engine.connect() as conn:
            return [dict(row) for row in (await conn.execute(query)).mappings()]

    @translated
    async def rewards(self, session_id: str) -> list[tuple[str, float, int | None]]:
        """Every reward posted for a session, in order: (source, value, call number or None)."""
        query = (
            select(RewardRow.source, RewardRow.value, RewardRow.call_seq)
            .where(RewardRow.session_id == session_id)
            .order_by(RewardRow.id)
        )
        async with self.engine.connect() as conn:
            return [(source, float(value), seq) for source, value, seq in (await conn.execute(query)).all()]

    @translated
    async def call_rewards(self, session_id: str) -> dict[int, float]:
        """Rewards posted for single calls of a session, summed per call number."""
        query = (
            select(RewardRow.call_seq, func.sum(RewardRow.value))
            .where(RewardRow.session_id == session_id, RewardRow.call_seq.is_not(None))
            .group_by(RewardRow.call_seq)
        )
        async with self.engine.connect() as conn:
            return {seq: float(value) for seq, value in (await conn.execute(query)).all() if seq is not None}

    @translated
    async def learner_views(self, session_id: str) -> dict[int, tuple[int, LearnerView]]:
        """The latest learner view of each sequence of a session: {first call: (step, view)}."""
        v = LearnerViewRow
        query = select(v.first_seq, v.step, v.advantage, v.logprobs).where(v.session_id == session_id).order_by(v.id)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return {
            first: (step, LearnerView(session_id, first, advantage, list(lps))) for first, step, advantage, lps in rows
        }

    @translated
    async def stored_response(self, session_id: str, response_id: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The request and answer of a session's Responses call with this id, if the client got
        it (CallRecord.answered: a call that cannot be trained on may still be continued)."""
        query = select(CallRow.request, CallRow.response).where(
            CallRow.response_id == response_id, CallRow.session_id == session_id, CallRow.http_status == 200
        )
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).first()
        return None if row is None or row.response is None else (row.request, row.response)

    async def iter_calls(self, session_id: str | None = None, batch: int = 512) -> AsyncIterator[CallRecord]:
        """Every recorded call (of a session, in call order; else in insertion order), read in
        batches (bounded memory). Core queries, not ORM objects: several times faster."""
        calls = CallRow.__table__
        # One session's calls are walked on its (session_id, seq) index, all calls on the id.
        key = calls.c.id if session_id is None else calls.c.seq
        last = 0
        while True:
            query = select(calls).where(key > last).order_by(key).limit(batch)
            if session_id is not None:
                query = query.where(calls.c.session_id == session_id)
            found = await self._calls(query)
            for _, call in found:
                yield call
            if len(found) < batch:
                return
            last = found[-1][1].seq if session_id is not None else found[-1][0]

    @translated
    async def recent_threads(self, session_id: str, limit: int) -> list[ThreadRecord]:
        """A session's calls that token-in can continue (their `thread` state), newest first, with
        only what token-in needs: not the request (the whole conversation), the answer or the
        logprobs. The newest `limit` of them, and the newest `limit` that no later call continued
        (the open ends: a main loop waiting while a subagent makes more calls than `limit`). One
        query, on the (session_id, seq) and call_id indexes, built once per `limit`."""
        query = _recent_threads(limit)
        rows = await self.read(lambda conn: conn.execute(query, {"session_id": session_id}).all())
        found: dict[str, ThreadRecord] = {}
        for r in rows:
            found.setdefault(r.call_id, ThreadRecord(r.call_id, r.seq, r.prompt_token_ids, [], r.thread))
            found[r.call_id].sampled.append(r.token_ids)
        return list(found.values())

    async def _calls(self, query: Any) -> list[tuple[int, CallRecord]]:
        """The calls a query of the calls table selects, with their completions: (row id, call)."""
        completions = CompletionRow.__table__
        by_call: dict[int, list[Completion]] = {}
        try:
            async with self.engine.connect() as conn:
                rows = (await conn.execute(query)).mappings().all()
                chosen = select(completions).where(completions.c.call_id.in_([r["id"] for r in rows]))
                for c in (await conn.execute(chosen.order_by(completions.c.choice_index))).mappings():
                    by_call.setdefault(c["call_id"], []).append(
                        Completion(c["choice_index"], c["token_ids"], c["logprobs"], c["finish_reason"])
                    )
        except (SQLAlchemyError, OSError) as exc:
            raise store_error(exc) from exc
        return [(row["id"], _call_record(row, by_call.get(row["id"], []))) for row in rows]

    @translated
    async def run_settings(self, run: str) -> tuple[RewardRule, dict[str, Any]] | None:
        """A training run's reward rule and settings, if the trainer stored them."""
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(RunRow.rule, RunRow.settings).where(RunRow.id == run))).first()
        return None if row is None else (RewardRule.model_validate(row.rule), dict(row.settings))

    @translated
    async def trained_group(self, group: str) -> tuple[int, list[Any]] | None:
        """(the step that took it, its episodes) if the trainer took `group`."""
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(GroupRow.step, GroupRow.episodes).where(GroupRow.id == group))).first()
        return None if row is None else (row.step, list(row.episodes))
