"""SQLAlchemy tables of the store and the packed-array column types.

Token ids are stored as little-endian int32 arrays and logprobs as float32 arrays (about 8x
smaller than JSON text and read back without parsing). `SCHEMA_VERSION` is written to the
`schema_version` table; a store written by a newer schema is refused rather than misread, and
an older one is brought up to date by the statements in `MIGRATIONS` when it is opened.
`async_url` and `sync_url` name one database for the async readers and the writer thread.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import JSON, Connection, ForeignKey, Index, LargeBinary, String, Text, UniqueConstraint, text
from sqlalchemy.engine import Dialect, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

SCHEMA_VERSION = 11

# From version N to N + 1: plain SQL that SQLite and PostgreSQL both run, or, where SQL cannot
# say it (hashing), a function given the connection.
MIGRATIONS: dict[int, list[str | Callable[[Connection], None]]] = {
    1: ["ALTER TABLE rewards ADD COLUMN call_seq INTEGER"],  # per-call rewards
    2: ["ALTER TABLE calls ADD COLUMN rewrites JSON"],  # model aliases and caps applied to a call
    3: [  # Responses API ids, for previous_response_id
        "ALTER TABLE calls ADD COLUMN response_id VARCHAR(64)",
        "CREATE INDEX ix_calls_response_id ON calls (response_id)",
    ],
    4: [lambda conn: _hash_session_keys(conn)],  # keys are credentials: only their digests kept
    5: [  # ids chosen by the writer, so that a retried write cannot be recorded twice
        "ALTER TABLE calls ADD COLUMN call_id VARCHAR(64)",
        "CREATE UNIQUE INDEX ix_calls_call_id ON calls (call_id)",
        "ALTER TABLE rewards ADD COLUMN reward_id VARCHAR(64)",
        "CREATE UNIQUE INDEX ix_rewards_reward_id ON rewards (session_id, reward_id)",
        "ALTER TABLE calls ADD COLUMN token_in BOOLEAN",  # token-in: prompts built from earlier tokens
        "ALTER TABLE calls ADD COLUMN thread_start VARCHAR(256)",
    ],
    6: [  # the viewer's session list pages in start order and filters by status
        "CREATE INDEX IF NOT EXISTS ix_sessions_created_at ON sessions (created_at)",
        "CREATE INDEX IF NOT EXISTS ix_sessions_status ON sessions (status)",
    ],
    7: [  # an episode's outcome and forced sampling in columns of their own, out of the client's metadata
        "ALTER TABLE sessions ADD COLUMN outcome JSON",
        "ALTER TABLE sessions ADD COLUMN sampling JSON",
        lambda conn: _episode_columns(conn),
    ],
    8: ["ALTER TABLE calls ADD COLUMN thread JSON"],  # token-in's state, for other proxies and restarts
    9: [],  # learner_views: a new table, made by create_all
    10: ["ALTER TABLE sessions ADD COLUMN policy_model VARCHAR(256)"],  # what the session graph trains
}


ENDED = "rlp: the session has ended"  # the database's refusal of a call into it, which the writer reads
_SQLITE_REFUSES = (
    "CREATE TRIGGER IF NOT EXISTS calls_into_ended_sessions BEFORE INSERT ON calls "
    "WHEN (SELECT status FROM sessions WHERE id = NEW.session_id) != 'active' "
    f"BEGIN SELECT RAISE(ABORT, '{ENDED}'); END"
)
_POSTGRESQL_REFUSES = (
    f"""CREATE OR REPLACE FUNCTION rlp_calls_into_ended_sessions() RETURNS trigger AS $$
BEGIN
    IF (SELECT status FROM sessions WHERE id = NEW.session_id) <> 'active' THEN
        RAISE EXCEPTION '{ENDED}' USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$ LANGUAGE plpgsql""",
    "CREATE TRIGGER calls_into_ended_sessions BEFORE INSERT ON calls "
    "FOR EACH ROW EXECUTE FUNCTION rlp_calls_into_ended_sessions()",
)


def refuse_calls_into_ended_sessions(conn: Connection) -> None:
    """The trigger by which the database refuses a call whose session has ended. A proxy's own
    check is on its cache, which another proxy's end does not reach; this one is at commit, in the
    same transaction as the call, so nothing is recorded into an episode after it ended (and maybe
    was scored). Made by every store that opens the database, new or older; a look-up by the
    session's primary key a call."""
    if conn.dialect.name == "sqlite":
        conn.exec_driver_sql(_SQLITE_REFUSES)
    elif conn.dialect.name == "postgresql" and not conn.scalar(
        text("SELECT count(*) FROM pg_trigger WHERE tgname = 'calls_into_ended_sessions'")
    ):
        for statement in _POSTGRESQL_REFUSES:
            conn.exec_driver_sql(statement)


def key_digest(key: str) -> str:
    """What the store keeps of a session key: its SHA-256. A key is a credential (an admin-issued
    key, or whatever API key a harness sends, a real provider key included) and is never stored."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def _hash_session_keys(conn: Connection) -> None:
    for session_id, key in conn.execute(text("SELECT id, key FROM sessions")).all():
        if not key.startswith("sha256:"):
            conn.execute(text("UPDATE sessions SET key = :k WHERE id = :i"), {"k": key_digest(key), "i": session_id})


def _episode_columns(conn: Connection) -> None:
    """Move what version 7 kept in a session's metadata (the runner's `outcome`, the admin API's
    `sampling`) into their columns. Only values of the shape those wrote move: a client's key
    label of the same name stays in the metadata, where nothing reads it."""
    rows = conn.execute(text("SELECT id, metadata FROM sessions")).all()
    for session_id, raw in rows:
        meta = json.loads(raw) if isinstance(raw, str) else dict(raw or {})
        outcome, sampling = meta.get("outcome"), meta.get("sampling")
        values: dict[str, Any] = {}
        if isinstance(outcome, dict) and outcome.get("status") in ("ok", "failed", "timeout"):
            keep = ("error", "output", "exit_code", "log", "seconds", "reward")
            values["outcome"] = {"harness": outcome["status"], **{k: outcome[k] for k in keep if k in outcome}}
        if isinstance(sampling, dict):
            values["sampling"] = sampling
        if values:
            rest = {k: v for k, v in meta.items() if k not in values}
            values = {k: json.dumps(v) for k, v in {**values, "metadata": rest}.items()}
            sets = ", ".join(f"{k} = :{k}" for k in values)
            conn.execute(text(f"UPDATE sessions SET {sets} WHERE id = :id"), {**values, "id": session_id})


def pack(values: Sequence[int] | Sequence[float], typecode: str) -> bytes:
    if isinstance(values, array) and values.typecode == typecode and sys.byteorder == "little":
        return values.tobytes()  # the proxy's prompt ids: an array already, no value at a time
    packed = array(typecode, values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack(blob: bytes, typecode: str) -> list[Any]:
    packed = array(typecode)
    packed.frombytes(blob)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


class _Packed(TypeDecorator[list[Any]]):
    impl = LargeBinary
    cache_ok = True
    typecode = ""

    def process_bind_param(self, value: list[Any] | None, dialect: Dialect) -> bytes | None:
        return None if value is None else pack(value, self.typecode)

    def process_result_value(self, value: bytes | None, dialect: Dialect) -> list[Any] | None:
        return None if value is None else unpack(value, self.typecode)


# cache_ok on each class: SQLAlchemy reads it from the class's own __dict__, and without it every
# statement with a packed column (each batch's INSERT) was compiled anew (SAWarning "will not
# produce a cache key").
class PackedInts(_Packed):
    typecode = "i"
    cache_ok = True


class PackedFloats(_Packed):
    typecode = "f"
    cache_ok = True


class Base(DeclarativeBase):
    pass


class SchemaVersionRow(Base):
    __tablename__ = "schema_version"
    version: Mapped[int] = mapped_column(primary_key=True)


class SessionRow(Base):
    __tablename__ = "sessions"
    id: Mapped[str] = mapped_column(String(256), primary_key=True)
    key: Mapped[str] = mapped_column(String(512), unique=True)  # key_digest(key), never the key
    run: Mapped[str | None] = mapped_column(String(256), index=True)
    task_id: Mapped[str | None] = mapped_column(String(256), index=True)
    group_id: Mapped[str | None] = mapped_column(String(256), index=True)
    policy_model: Mapped[str | None] = mapped_column(String(256))
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    status: Mapped[str] = mapped_column(String(16), default="active", index=True)
    created_at: Mapped[datetime] = mapped_column(index=True)
    ended_at: Mapped[datetime | None]
    outcome: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # episodes.Outcome, from the admin API only
    sampling: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # episodes.Sampling, likewise


class CallRow(Base):
    __tablename__ = "calls"
    __table_args__ = (UniqueConstraint("session_id", "seq"),)
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"))
    seq: Mapped[int]
    api: Mapped[str] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(256))
    upstream: Mapped[str] = mapped_column(String(512))
    stream: Mapped[bool]
    ok: Mapped[bool]
    http_status: Mapped[int]
    error: Mapped[str | None] = mapped_column(Text)
    request: Mapped[dict[str, Any]] = mapped_column(JSON)
    response: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    prompt_token_ids: Mapped[list[int]] = mapped_column(PackedInts)
    policy_version: Mapped[str | None] = mapped_column(String(64))
    policy_version_end: Mapped[str | None] = mapped_column(String(64))
    started_at: Mapped[datetime] = mapped_column(index=True)
    finished_at: Mapped[datetime]
    latency_ms: Mapped[float]
    rewrites: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    response_id: Mapped[str | None] = mapped_column(String(64), index=True)
    call_id: Mapped[str | None] = mapped_column(String(64), unique=True, index=True)  # None: written before version 6
    token_in: Mapped[bool | None]
    thread_start: Mapped[str | None] = mapped_column(String(256))
    # CallRecord.thread; None as SQL NULL (not JSON null), so that the calls that have one are found
    thread: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))


class CompletionRow(Base):
    __tablename__ = "completions"
    call_id: Mapped[int] = mapped_column(ForeignKey("calls.id"), primary_key=True)
    choice_index: Mapped[int] = mapped_column(primary_key=True)
    token_ids: Mapped[list[int]] = mapped_column(PackedInts)
    logprobs: Mapped[list[float]] = mapped_column(PackedFloats)
    finish_reason: Mapped[str | None] = mapped_column(String(32))


class RewardRow(Base):
    __tablename__ = "rewards"
    __table_args__ = (Index("ix_rewards_reward_id", "session_id", "reward_id", unique=True),)
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), index=True)
    value: Mapped[float]
    source: Mapped[str] = mapped_column(String(64))
    call_seq: Mapped[int | None]  # a reward for one call of the session; None: for the session
    created_at: Mapped[datetime]
    reward_id: Mapped[str | None] = mapped_column(String(64))  # unique in its session; None: before version 6


class RunRow(Base):
    """A training run's settings, written by the trainer when it starts: what the viewer needs
    to show a group's advantages as the run computed them."""

    __tablename__ = "runs"
    id: Mapped[str] = mapped_column(String(256), primary_key=True)
    rule: Mapped[dict[str, Any]] = mapped_column(JSON)  # episodes.RewardRule
    settings: Mapped[dict[str, Any]] = mapped_column(JSON)  # what else decides a group (temperature, ...)
    created_at: Mapped[datetime]


class GroupRow(Base):
    """What the trainer did with a group it took: each episode's reward, advantage and why."""

    __tablename__ = "trained_groups"
    id: Mapped[str] = mapped_column(String(256), primary_key=True)
    run: Mapped[str | None] = mapped_column(String(256), index=True)
    step: Mapped[int]  # the optimizer step that took it (its samples trained in step + 1)
    episodes: Mapped[list[Any]] = mapped_column(JSON)  # [session id, reward, advantage, why] each
    created_at: Mapped[datetime]


ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+asyncpg"}
SYNC_DRIVERS = {"sqlite": "sqlite+pysqlite", "postgresql": "postgresql+psycopg"}


def async_url(url: str) -> str:
    """Accept plain paths and sync driver names; return an async SQLAlchemy URL."""
    if "://" not in url:
        return f"sqlite+aiosqlite:///{Path(url).expanduser().resolve()}"
    parsed = make_url(url)
    if parsed.drivername in ASYNC_DRIVERS:
        parsed = parsed.set(drivername=ASYNC_DRIVERS[parsed.drivername])
    return parsed.render_as_string(hide_password=False)


def missing(url: str) -> bool:
    """Whether a store given as a plain path (not a URL) is not there: a SQLite file is created
    on first write, so a reader checks first, to name a mistyped path."""
    return "://" not in url and not Path(url).expanduser().exists()


def sync_url(url: str) -> str:
    """The same database through a synchronous driver, for the writer thread."""
    parsed = make_url(async_url(url))
    return parsed.set(
        drivername=SYNC_DRIVERS.get(parsed.get_backend_name(), parsed.get_backend_name())
    ).render_as_string(hide_password=False)


def shown_url(url: str) -> str:
    """A database URL as it may be printed: its password masked."""
    return make_url(url).render_as_string(hide_password=True) if "://" in url else url


class LearnerViewRow(Base):
    """What the learner saw of one training sequence in one step (a sample of each step's): its
    logprob of each trained token, beside the behaviour logprob the call recorded, and the
    advantage the sequence was pushed with. The viewer overlays them on the sequence's tokens."""

    __tablename__ = "learner_views"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    run: Mapped[str | None] = mapped_column(String(256))
    step: Mapped[int]  # the optimizer step that trained it
    session_id: Mapped[str] = mapped_column(String(256), index=True)
    first_seq: Mapped[int]  # the sequence's first call
    advantage: Mapped[float]
    logprobs: Mapped[list[float]] = mapped_column(PackedFloats)  # one per trained token, in order
    created_at: Mapped[datetime]
