"""The store: SQLAlchemy over SQLite (WAL) or any other database, one writer, plain reads.

Writes (new sessions, calls, rewards, session ends, runs and trained groups) go through the one
writer (writer.py: group commit on a thread of its own), so a call is durable before the proxy
answers the client. Reads use the async engine (aiosqlite, asyncpg), and those on a call's path
a synchronous one (reads.py, `Reads.read`): on the event loop's thread for SQLite, in reader
threads for a server. SQLite runs with journal_mode=WAL and synchronous=FULL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import uuid4

import orjson
from sqlalchemy import Connection, bindparam, create_engine, delete, event, func, insert, select, text, update
from sqlalchemy.engine import ExceptionContext, make_url
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session

from recorder.caches import ByteLRU
from recorder.episodes import EpisodeOutcome, RewardRule, SessionStatus
from recorder.errors import SchemaMismatch, SessionClosed, SessionConflict, store_error, translated
from recorder.reads import Reads, session_info
from recorder.records import CallRecord, LearnerView, SessionInfo
from recorder.schema import (
    MIGRATIONS,
    SCHEMA_VERSION,
    Base,
    CallRow,
    GroupRow,
    LearnerViewRow,
    RewardRow,
    RunRow,
    SchemaVersionRow,
    SessionRow,
    async_url,
    key_digest,
    refuse_calls_into_ended_sessions,
    sync_url,
)
from recorder.writer import Write, Writer

log = logging.getLogger("rl_proxy.recorder")


def _session_bytes(info: SessionInfo) -> int:
    return 512 + len(info.id) + len(info.key) + len(orjson.dumps(info.metadata))  # its labels, as JSON


# A new session's look-up and insert on the writer's thread, built once: built at each session,
# with its values in them, they took 0.52 ms of the writer's CPU against 0.09-0.18 (a throw-away
# timing of 300 sessions on SQLite).
MINE = select(SessionRow.id).where(SessionRow.id == bindparam("id"), SessionRow.key == bindparam("key"))
INTO_SESSIONS = insert(SessionRow)
READERS = 4  # threads (and connections) of a server's reads on a call's path (Reads.read)
# Seconds a SQLite read on the event loop's thread waits for a lock (Reads.read): in WAL mode only a
# recovery takes one from readers, and every call in flight waits with it.
READ_BUSY_TIMEOUT = 1.0
KEY_CACHE_BYTES = 32 * 2**20  # sessions looked up by key kept in memory (the least recently used go)


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


class Store(Reads):
    """Sessions, calls and rewards in one SQL database. Use as `async with Store(url) as store`."""

    def __init__(self, url: str, busy_timeout: float = 30.0, readonly: bool = False) -> None:
        """`busy_timeout`: seconds a SQLite write waits for another writer's lock before it fails.
        `readonly` (the viewer): nothing is created or migrated, and a store that is not at this
        schema version is refused."""
        self.url = async_url(url)
        self.readonly = readonly
        engine_url = self.url
        if readonly and make_url(self.url).get_backend_name() == "sqlite":
            # SQLite's own read-only mode: no file created where none is, no pragma written.
            engine_url = (
                make_url(self.url)
                .set(database=f"file:{make_url(self.url).database}", query={"mode": "ro", "uri": "true"})
                .render_as_string(hide_password=False)
            )
        options: dict[str, Any] = {
            "json_serializer": lambda obj: orjson.dumps(obj).decode(),
            "json_deserializer": orjson.loads,
        }
        if self.url.startswith("sqlite"):
            options["connect_args"] = {"timeout": busy_timeout}
        # A server's pooled connections die with it: checked before use, so that reads recover
        # by themselves when it is back (a file cannot go away so).
        served = not self.url.startswith("sqlite")
        self.engine = create_async_engine(engine_url, pool_pre_ping=served, **options)
        self.write_engine = create_engine(sync_url(self.url), pool_size=1, **options)
        self.inline_reads = not served
        reading = {**options, "connect_args": {"timeout": READ_BUSY_TIMEOUT}} if self.inline_reads else options
        self.read_engine = create_engine(sync_url(engine_url), pool_size=READERS, pool_pre_ping=served, **reading)
        self.readers = ThreadPoolExecutor(READERS, thread_name_prefix="recorder-reader")
        if self.engine.dialect.name == "postgresql":
            event.listen(self.engine.sync_engine, "handle_error", _broken_connection)
        if self.engine.dialect.name == "sqlite" and not readonly:
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)
            event.listen(self.write_engine, "connect", _sqlite_pragmas)
            event.listen(self.read_engine, "connect", _sqlite_pragmas)
        self._sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        self.writer = Writer(self.write_engine)
        # key digest: its session
        self._by_key: ByteLRU[str, SessionInfo] = ByteLRU(KEY_CACHE_BYTES, _session_bytes, self._forget)
        self._digest_of: dict[str, str] = {}  # session id: its key digest, for what _by_key holds
        self._creating: dict[str, asyncio.Future[None]] = {}  # key digest: its session's insert
        self._forgotten = 0  # times `forget_sessions` dropped sessions from _by_key
        self._new_ids: set[str] = set()  # ids of those sessions

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
            # One store at a time creates or migrates the schema: replicas started together on a
            # new database raced in CREATE TABLE, and all but one failed to start.
            if self.engine.dialect.name == "sqlite":
                await conn.exec_driver_sql("BEGIN IMMEDIATE")  # the write lock, held until commit
            elif self.engine.dialect.name == "postgresql":
                await conn.execute(text("SELECT pg_advisory_xact_lock(7262716)"))  # DDL is transactional
            await conn.run_sync(Base.metadata.create_all)
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
            await conn.run_sync(refuse_calls_into_ended_sessions)
            if found != SCHEMA_VERSION:
                await conn.execute(delete(SchemaVersionRow))
                await conn.execute(insert(SchemaVersionRow).values(version=SCHEMA_VERSION))
        self.writer.start()

    async def _check_version(self) -> None:
        shown = make_url(self.url).render_as_string(hide_password=True)
        try:
            async with self.engine.connect() as conn:
                found = await conn.scalar(select(func.max(SchemaVersionRow.version)))
        except (SQLAlchemyError, OSError) as exc:
            raise SchemaMismatch(f"no rl-proxy store at {shown}: {store_error(exc)}") from exc
        if found != SCHEMA_VERSION:
            raise SchemaMismatch(
                f"{shown} has schema version {found}, and a read-only rl-proxy reads only "
                f"{SCHEMA_VERSION}: `rl-proxy report --db ...` migrates it"
            )

    async def close(self) -> None:
        await self.writer.close()
        self.readers.shutdown()
        self.read_engine.dispose()
        await self.engine.dispose()

    # -- writing -------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return self.writer.depth

    @property
    def write_failures(self) -> int:
        return self.writer.failures

    @property
    def committed_batches(self) -> int:
        return self.writer.committed_batches

    def submit(self, write: Write) -> asyncio.Future[Any]:
        """Queue a write (a call, or an operation on the connection); the future resolves once it
        is committed (writer.py)."""
        return self.writer.submit(write)

    def record_nowait(self, call: CallRecord) -> asyncio.Future[CallRecord]:
        return self.submit(call)

    @translated
    async def record(self, call: CallRecord) -> CallRecord:
        """Persist one call; returns it as recorded (its number may have moved: `number_calls`)
        once it is committed. A call whose session has ended (SessionClosed) drops the session
        from the key cache too, so that its next call reads it again and is refused."""
        try:
            return await self.record_nowait(call)
        except SessionClosed:
            digest = self._digest_of.get(call.session_id)
            self.forget_sessions([digest] if digest else [])
            raise

    # -- sessions ------------------------------------------------------------------------

    @translated
    async def session_by_key(self, key: str) -> SessionInfo | None:
        digest = key_digest(key)
        creating = self._creating.get(digest)
        if creating is not None:  # known only once committed: its insert may yet fail (id taken)
            await asyncio.wait([creating])
        cached = self._by_key.get(digest)
        if cached is not None:
            return cached

        def find(conn: Connection) -> SessionInfo | None:
            with Session(conn) as s:
                row = s.scalar(select(SessionRow).where(SessionRow.key == digest))
                return None if row is None else session_info(row)

        forgotten = self._forgotten
        info = await self.read(find)
        if info is not None and forgotten == self._forgotten:  # not read before sessions were forgotten
            self._remember(digest, info)
        return info

    def _remember(self, digest: str, info: SessionInfo) -> None:
        self._by_key[digest] = info
        if digest in self._by_key:  # kept
            self._digest_of[info.id] = digest

    def _forget(self, digest: str, info: SessionInfo) -> None:
        self._digest_of.pop(info.id, None)

    def key_cache_usage(self) -> dict[str, int]:
        return self._by_key.usage()

    def forget_sessions(self, digests: list[str] | None) -> None:
        """Drop these keys' sessions from the sessions-by-key cache (None: every one): they ended,
        here or in another process. A read begun before is not kept either."""
        if digests is None:
            self._by_key.clear()  # cachetools' clear: `_forget` is not called
            self._digest_of.clear()
        for digest in digests or ():
            info = self._by_key.pop(digest, None)
            if info is not None:
                self._digest_of.pop(info.id, None)
        self._forgotten += 1

    @translated
    async def last_seq(self, session_id: str) -> int:
        """The highest call number recorded in a session (0 if none)."""
        last = select(func.max(CallRow.seq)).where(CallRow.session_id == session_id)
        return await self.read(lambda conn: conn.scalar(last)) or 0

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
            "policy_model": info.policy_model,
            "metadata": info.metadata,
            "sampling": None if info.sampling is None else info.sampling.model_dump(exclude_none=True),
            "status": created.status,
            "created_at": created.created_at,
        }

        def create(conn: Connection) -> None:  # sent again after a lost COMMIT answer, it finds itself
            if conn.scalar(MINE, {"id": info.id, "key": digest}) is None:
                conn.execute(INTO_SESSIONS, values)

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
            "session_id": session_id,
            "value": value,
            "source": source,
            "call_seq": call_seq,
            "created_at": utcnow(),
            "reward_id": reward_id or uuid4().hex,
        }

        def add(conn: Connection) -> None:
            mine = RewardRow.session_id == session_id, RewardRow.reward_id == values["reward_id"]
            if conn.scalar(select(RewardRow.id).where(*mine)) is None:
                conn.execute(insert(RewardRow).values(values))

        await self.submit(add)

    @translated
    async def end_session(
        self, session_id: str, status: SessionStatus = "ended", outcome: EpisodeOutcome | None = None
    ) -> str | None:
        """Mark a session finished: `status` says how ("ended", or an episode's own status), and
        an episode's runner gives its `outcome`. Returns its key's digest (None: no such session)."""
        values: dict[str, Any] = {"status": status, "ended_at": utcnow()}
        if outcome is not None:
            values["outcome"] = outcome.model_dump(mode="json")
        ended = update(SessionRow).where(SessionRow.id == session_id).values(values).returning(SessionRow.key)
        key: str | None = await self.submit(lambda conn: conn.execute(ended).scalar())
        if key is not None:
            self.forget_sessions([key])
        return key

    @translated
    async def save_run(self, run: str, rule: RewardRule, settings: dict[str, Any]) -> None:
        """Keep a training run's reward rule and settings (a resumed run writes them again)."""
        values = {"rule": rule.model_dump(mode="json"), "settings": settings, "created_at": utcnow()}

        def save(conn: Connection) -> None:
            if conn.execute(update(RunRow).where(RunRow.id == run).values(values)).rowcount == 0:
                conn.execute(insert(RunRow).values(id=run, **values))

        await self.submit(save)

    @translated
    async def save_learner_views(self, run: str | None, step: int, views: list[LearnerView]) -> None:
        """What the learner saw of a sample of a step's sequences (LearnerView each)."""
        now = utcnow()
        rows = [{"run": run, "step": step, **asdict(view), "created_at": now} for view in views]

        def save(conn: Connection) -> None:
            if rows:
                conn.execute(insert(LearnerViewRow), rows)

        await self.submit(save)

    @translated
    async def save_group(self, group: str, run: str | None, step: int, episodes: list[Any]) -> None:
        """What the trainer did with a group: [session id, reward, advantage, why] per episode."""
        values = {"id": group, "run": run, "step": step, "episodes": episodes, "created_at": utcnow()}

        def save(conn: Connection) -> None:
            if conn.scalar(select(GroupRow.id).where(GroupRow.id == group)) is None:
                conn.execute(insert(GroupRow).values(values))

        await self.submit(save)


# How asyncpg reports a connection the server ended (terminated, restarted) in the middle of use.
BROKEN = ("connection was closed in the middle of operation", "another operation is in progress")


def _broken_connection(context: ExceptionContext) -> None:
    """Count asyncpg's reports of a connection lost mid-use as disconnects, so that the pool drops
    it: SQLAlchemy did not, the broken connection went back to the pool, and the next reads on it
    failed too ("cannot switch to state 12; another operation is in progress"), seen in the scale
    soak with the proxies' connections terminated."""
    if any(words in str(context.original_exception) for words in BROKEN):
        context.is_disconnect = True


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # Turning a new file to WAL takes its lock, and SQLite answers "database is locked" at once
    # rather than waiting for it: stores opened together on a new database failed there (the
    # replicas' test, under load, about once in a hundred).
    deadline = time.monotonic() + 30
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            break
        except Exception as exc:  # the driver's OperationalError (sqlite3's, or aiosqlite's adapter's)
            if "database is locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
