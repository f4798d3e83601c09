"""The store: SQLAlchemy over SQLite (WAL) or any other database, one writer, plain reads.

Writes (new sessions, calls, rewards, session ends) go through one queue. A single writer commits
whatever is queued in one transaction (group commit) on a thread of its own with a synchronous
connection, and only then resolves each writer's future, so a call is durable before the proxy
answers the client. One thread hop per batch is what keeps recording under a millisecond: the
same insert through SQLAlchemy's async engine took 1.7-2.5 ms (six aiosqlite hops and the async
session machinery; see docs/benchmarks.md, "Proxy overhead"). Reads use the async engine
(aiosqlite). If a batch fails, its writes are retried one by one so that one bad record cannot lose the others.
Every write is idempotent (a call carries its own `call_id`, a reward its `reward_id`, a session
is created once): a batch whose connection dropped, even during COMMIT, is simply sent again.
SQLite runs with journal_mode=WAL and synchronous=FULL.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import uuid4

import orjson
from sqlalchemy import Connection, case, create_engine, delete, event, func, insert, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from recorder.batches import insert_calls, number_calls
from recorder.errors import SchemaMismatch, SessionConflict, store_error, translated
from recorder.records import CallRecord, Completion, SessionInfo
from recorder.schema import (
    MIGRATIONS,
    SCHEMA_VERSION,
    Base,
    CallRow,
    CompletionRow,
    RewardRow,
    SchemaVersionRow,
    SessionRow,
    async_url,
    key_digest,
    sync_url,
)

log = logging.getLogger("rl_proxy.recorder")

Op = Callable[[Connection], object]
Write = CallRecord | Op
MAX_BATCH = 512
KNOWN_KEYS = 100_000  # sessions looked up by key that stay in memory (the least recently used go)


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def _session_info(row: SessionRow, reward: float | None = None, calls: int = 0) -> SessionInfo:
    return SessionInfo(
        id=row.id,
        key=row.key,
        run=row.run,
        task_id=row.task_id,
        group_id=row.group_id,
        metadata=dict(row.meta or {}),
        status=row.status,
        created_at=row.created_at,
        ended_at=row.ended_at,
        reward=reward,
        calls=calls,
    )


_CALL_FIELDS = [f for f in CallRecord.__dataclass_fields__ if f != "completions"]


def _call_record(row: Any, completions: list[Completion]) -> CallRecord:
    fields = {name: row[name] for name in _CALL_FIELDS}
    fields["rewrites"] = fields["rewrites"] or {}
    fields["token_in"] = bool(fields["token_in"])  # None: written before version 6
    return CallRecord(**fields, completions=completions)


class Store:
    """Sessions, calls and rewards in one SQL database. Use as `async with Store(url) as store`."""

    def __init__(self, url: str, busy_timeout: float = 30.0, readonly: bool = False) -> None:
        """`busy_timeout`: seconds a SQLite write waits for another writer's lock before it fails.
        `readonly` (the viewer): nothing is created or migrated, and a store that is not at this
        schema version is refused."""
        self.url = async_url(url)
        self.readonly = readonly
        options: dict[str, Any] = {
            "json_serializer": lambda obj: orjson.dumps(obj).decode(),
            "json_deserializer": orjson.loads,
        }
        if self.url.startswith("sqlite"):
            options["connect_args"] = {"timeout": busy_timeout}
        # A server's pooled connections die with it: checked before use, so that reads recover
        # by themselves when it is back (a file cannot go away so).
        self.engine = create_async_engine(self.url, pool_pre_ping=not self.url.startswith("sqlite"), **options)
        self.write_engine = create_engine(sync_url(self.url), pool_size=1, **options)
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)
            event.listen(self.write_engine, "connect", _sqlite_pragmas)
        self._sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recorder-writer")
        self._write_conn: Connection | None = None
        self._queue: asyncio.Queue[tuple[Write, asyncio.Future[Any]] | None] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self._by_key: OrderedDict[str, SessionInfo] = OrderedDict()  # key digest: its session
        self._digest_of: dict[str, str] = {}  # session id: its key digest, for what _by_key holds
        self._creating: dict[str, asyncio.Future[None]] = {}  # key digest: its session's insert
        self._new_ids: set[str] = set()  # ids of those sessions
        self.write_failures = 0
        self.committed_batches = 0

    async def __aenter__(self) -> Store:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        if self.readonly:
            await self._check_version()
            return
        url = make_url(self.url)
        if url.drivername.startswith("sqlite") and url.database:
            Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        async with self.engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        async with self.engine.begin() as conn:
            found = await conn.scalar(select(func.max(SchemaVersionRow.version)))
            if found is not None and found > SCHEMA_VERSION:
                raise SchemaMismatch(
                    f"{self.url} has schema version {found}; this rl-proxy knows up to "
                    f"{SCHEMA_VERSION}: upgrade rl-proxy"
                )
            for version in range(found or SCHEMA_VERSION, SCHEMA_VERSION):
                log.info("migrating %s from schema version %d", self.url, version)
                for step in MIGRATIONS[version]:
                    await (conn.execute(text(step)) if isinstance(step, str) else conn.run_sync(step))
            if found != SCHEMA_VERSION:
                await conn.execute(delete(SchemaVersionRow))
                await conn.execute(insert(SchemaVersionRow).values(version=SCHEMA_VERSION))
        self._writer = asyncio.create_task(self._write_loop(), name="recorder-writer")

    async def _check_version(self) -> None:
        shown = make_url(self.url).render_as_string(hide_password=True)
        try:
            async with self.engine.connect() as conn:
                found = await conn.scalar(select(func.max(SchemaVersionRow.version)))
        except (SQLAlchemyError, OSError) as exc:
            raise SchemaMismatch(f"no rl-proxy store at {shown}: {store_error(exc)}") from exc
        if found != SCHEMA_VERSION:
            raise SchemaMismatch(f"{shown} has schema version {found}, and a read-only rl-proxy reads only "
                                 f"{SCHEMA_VERSION}: `rl-proxy report --db ...` migrates it")  # fmt: skip

    async def close(self) -> None:
        if self._writer is not None:
            await self._queue.put(None)
            await self._writer
            self._writer = None
        if self._write_conn is not None:
            self._thread.submit(self._write_conn.close).result()
        self._thread.shutdown()
        self.write_engine.dispose()
        await self.engine.dispose()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    # -- writing -------------------------------------------------------------------------

    def submit(self, op: Write) -> asyncio.Future[Any]:
        """Queue a write (a call, or an operation on a session); the future resolves once it is
        committed, to the call as recorded (or to what the operation returned)."""
        if self._writer is None:
            raise RuntimeError("Store is not open")
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((op, done))
        return done

    async def _write_loop(self) -> None:
        stop = False
        while not stop:
            item = await self._queue.get()
            batch = []
            while item is not None:
                batch.append(item)
                if len(batch) >= MAX_BATCH or self._queue.empty():
                    break
                item = self._queue.get_nowait()
            stop = item is None
            if batch:
                await self._commit(batch)

    def _commit_sync(self, writes: list[Write]) -> list[Any]:
        """Commit `writes` in one transaction; what each resolves to. The writer thread keeps one
        connection for the store's life (no pool round trip a batch). A connection the server
        dropped (a restart) is replaced and the batch sent again, even if it dropped during
        COMMIT: every write is idempotent, so one that was committed is not written twice."""
        for attempt in range(2):
            if self._write_conn is None:
                self._write_conn = self.write_engine.connect()
            conn = self._write_conn
            try:
                with conn.begin():
                    # sessions before calls: a call's session must exist
                    results = {i: w(conn) for i, w in enumerate(writes) if not isinstance(w, CallRecord)}
                    calls = [(i, w) for i, w in enumerate(writes) if isinstance(w, CallRecord)]
                    if calls:
                        recorded, to_insert = number_calls(conn, [w for _, w in calls])
                        if to_insert:
                            insert_calls(conn, to_insert)
                        results.update(zip([i for i, _ in calls], recorded, strict=True))
                return [results[i] for i in range(len(writes))]
            except Exception:
                if not conn.invalidated or attempt == 1:
                    raise
                conn.close()
                self._write_conn = None
        raise AssertionError("unreachable")

    async def _commit(self, batch: list[tuple[Write, asyncio.Future[Any]]]) -> None:
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._thread, self._commit_sync, [w for w, _ in batch])
        except Exception as exc:
            if len(batch) == 1:
                self.write_failures += 1
                log.error("recording failed: %s", exc)
                _settle(batch[0][1], exc)
                return
            log.warning("batch of %d writes failed (%s); retrying one by one", len(batch), exc)
            for one in batch:
                await self._commit([one])
            return
        self.committed_batches += 1
        for (_, done), result in zip(batch, results, strict=True):
            _settle(done, None, result)

    def record_nowait(self, call: CallRecord) -> asyncio.Future[CallRecord]:
        return self.submit(call)

    @translated
    async def record(self, call: CallRecord) -> CallRecord:
        """Persist one call; returns it as recorded (its number may have moved: `number_calls`)
        once it is committed."""
        return await self.record_nowait(call)

    # -- sessions ------------------------------------------------------------------------

    @translated
    async def session_by_key(self, key: str) -> SessionInfo | None:
        digest = key_digest(key)
        creating = self._creating.get(digest)
        if creating is not None:  # known only once committed: its insert may yet fail (id taken)
            await asyncio.wait([creating])
        cached = self._by_key.get(digest)
        if cached is not None:
            self._by_key.move_to_end(digest)
            return cached
        async with self._sessions() as s:
            row = await s.scalar(select(SessionRow).where(SessionRow.key == digest))
        if row is None:
            return None
        info = _session_info(row)
        self._remember(digest, info)
        return info

    def _remember(self, digest: str, info: SessionInfo) -> None:
        self._by_key[digest] = info
        self._digest_of[info.id] = digest
        if len(self._by_key) > KNOWN_KEYS:
            _, dropped = self._by_key.popitem(last=False)
            self._digest_of.pop(dropped.id, None)

    @translated
    async def last_seq(self, session_id: str) -> int:
        """The highest call number recorded in a session (0 if none)."""
        async with self.engine.connect() as conn:
            last = await conn.scalar(select(func.max(CallRow.seq)).where(CallRow.session_id == session_id))
        return last or 0

    @translated
    async def create_session(self, info: SessionInfo) -> SessionInfo:
        """Create a session (durably). Raises SessionConflict if its id or key is taken. The
        store keeps only the key's digest; the session returned still carries the key.

        The database's unique constraints decide, and no lock is held: sessions created together
        are committed together (with a lock and a look-up first, the 64th of 64 sessions opened
        at once waited 4.7 s). Until its insert is committed, a look-up of its key waits."""
        digest = key_digest(info.key)
        if digest in self._by_key or digest in self._creating:
            raise SessionConflict("this session key is already in use")
        if info.id in self._new_ids:
            raise SessionConflict(f"session id {info.id!r} is already taken")
        created = replace(info, status="active", created_at=utcnow(), reward=None, calls=0)
        values = {
            "id": info.id,
            "key": digest,
            "run": info.run,
            "task_id": info.task_id,
            "group_id": info.group_id,
            "metadata": info.metadata,
            "status": created.status,
            "created_at": created.created_at,
        }

        def create(conn: Connection) -> None:  # sent again after a lost COMMIT answer, it finds itself
            mine = select(SessionRow.id).where(SessionRow.id == info.id, SessionRow.key == digest)
            if conn.scalar(mine) is None:
                conn.execute(insert(SessionRow).values(values))

        committed = self._creating[digest] = self.submit(create)
        self._new_ids.add(info.id)
        try:
            await committed
        except IntegrityError as exc:
            async with self._sessions() as s:
                taken = await s.scalar(select(SessionRow.id).where(SessionRow.id == info.id))
            if taken is not None:
                raise SessionConflict(f"session id {info.id!r} is already taken") from exc
            raise SessionConflict("this session key is already in use") from exc
        finally:
            self._new_ids.discard(info.id)
            del self._creating[digest]
        self._remember(digest, replace(created, key=digest))
        return created

    @translated
    async def resolve_session(self, info: SessionInfo) -> SessionInfo:
        """The stored session with `info.key`, created from `info` on first use."""
        found = await self.session_by_key(info.key)
        if found is not None:
            return found
        try:
            return await self.create_session(info)
        except SessionConflict:
            found = await self.session_by_key(info.key)
            if found is None:
                raise
            return found

    @translated
    async def add_reward(
        self, session_id: str, value: float, source: str, call_seq: int | None = None, reward_id: str | None = None
    ) -> None:
        """A reward for the session, or for its call number `call_seq`. A reward posted again with
        the same `reward_id` for the same session (a client's retry) is kept once: the first."""
        values = {
            "session_id": session_id, "value": value, "source": source, "call_seq": call_seq, "created_at": utcnow(),
            "reward_id": reward_id or uuid4().hex,
        }  # fmt: skip

        def add(conn: Connection) -> None:
            mine = RewardRow.session_id == session_id, RewardRow.reward_id == values["reward_id"]
            if conn.scalar(select(RewardRow.id).where(*mine)) is None:
                conn.execute(insert(RewardRow).values(values))

        await self.submit(add)

    @translated
    async def end_session(self, session_id: str, status: str = "ended", metadata: dict[str, Any] | None = None) -> None:
        """Mark a session finished: `status` says how ("ended", or an episode's "ok", "failed",
        "timeout", "no_calls"); `metadata`, if given, replaces its metadata."""
        values: dict[str, Any] = {"status": status, "ended_at": utcnow()}
        if metadata is not None:
            values["metadata"] = metadata
        ended = update(SessionRow).where(SessionRow.id == session_id).values(values)
        await self.submit(lambda conn: conn.execute(ended))
        digest = self._digest_of.pop(session_id, None)
        if digest is not None:
            self._by_key.pop(digest, None)

    # -- reading -------------------------------------------------------------------------

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
        by = {"created": SessionRow.created_at, "reward": reward, "calls": calls, "run": SessionRow.run,
              "task": SessionRow.task_id, "status": SessionRow.status}[sort]  # fmt: skip
        # Sessions without a value last either way, on SQLite as on PostgreSQL (which differ).
        order = [by.desc().nulls_last(), SessionRow.id.desc()] if descending else [by.nulls_last(), SessionRow.id]
        query = self._filtered(select(SessionRow, reward, calls), reward, run=run, session_id=session_id,
                               group_id=group_id, task_id=task_id, status=status, min_reward=min_reward,
                               max_reward=max_reward)  # fmt: skip
        async with self._sessions() as s:
            result = await s.execute(query.order_by(*order).offset(offset).limit(limit))
            return [_session_info(row, reward, n or 0) for row, reward, n in result.all()]

    @translated
    async def count_sessions(self, **filters: Any) -> int:
        """How many sessions match the filters of `list_sessions`."""
        reward = self._reward_of_session()
        query = self._filtered(select(func.count()).select_from(SessionRow), reward, **filters)
        async with self.engine.connect() as conn:
            return int((await conn.execute(query)).scalar_one())

    @staticmethod
    def _filtered(query: Any, reward: Any, *, min_reward: float | None = None, max_reward: float | None = None,
                  **equal: str | None) -> Any:  # fmt: skip
        columns = {"run": SessionRow.run, "session_id": SessionRow.id, "group_id": SessionRow.group_id,
                   "task_id": SessionRow.task_id, "status": SessionRow.status}  # fmt: skip
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
        per_session = select(SessionRow.run, SessionRow.status, SessionRow.created_at,
                             self._reward_of_session().label("reward")).subquery()  # fmt: skip
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
        calls, completions = CallRow.__table__, CompletionRow.__table__
        # One session's calls are walked on its (session_id, seq) index, all calls on the id.
        key = calls.c.id if session_id is None else calls.c.seq
        last = 0
        while True:
            query = select(calls).where(key > last).order_by(key).limit(batch)
            if session_id is not None:
                query = query.where(calls.c.session_id == session_id)
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
            for row in rows:
                yield _call_record(row, by_call.get(row["id"], []))
            if len(rows) < batch:
                return
            last = rows[-1][key.name]


def _settle(done: asyncio.Future[Any], exc: BaseException | None, result: Any = None) -> None:
    if done.done():
        return
    if exc is None:
        done.set_result(result)
    else:
        done.set_exception(exc)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
