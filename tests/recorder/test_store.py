"""The store on a temporary SQLite file and a PostgreSQL database, with hand-built records."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from sqlalchemy import event, text

from benchmarks.support.samples import call
from proxy.state import CallNumbers
from recorder import SessionInfo, Store
from recorder.episodes import Sampling
from recorder.errors import SessionClosed
from recorder.export import export
from recorder.schema import SCHEMA_VERSION, key_digest, pack, unpack
from recorder.store import SchemaMismatch, SessionConflict, async_url

DISCONNECTS = {  # what each driver raises when the server goes away (SQLAlchemy's is_disconnect)
    "postgresql": lambda: psycopg.OperationalError("server closed the connection unexpectedly"),
    "sqlite": lambda: sqlite3.ProgrammingError("Cannot operate on a closed database."),
}


def test_packing_round_trips_exactly() -> None:
    ids = [0, 1, 49151, 2**31 - 1, 7]
    assert unpack(pack(ids, "i"), "i") == ids
    logprobs = [-0.0, -1.5, -12.25, -1e-8]
    assert unpack(pack(logprobs, "f"), "f") == pytest.approx(logprobs, rel=1e-6)
    assert len(pack(ids, "i")) == 4 * len(ids)


def test_async_url_accepts_paths_and_sync_drivers(tmp_path: Path) -> None:
    assert async_url(str(tmp_path / "a.db")) == f"sqlite+aiosqlite:///{tmp_path / 'a.db'}"
    assert async_url("sqlite:////x/y.db") == "sqlite+aiosqlite:////x/y.db"
    assert async_url("postgresql://u:p@h/db") == "postgresql+asyncpg://u:p@h/db"


async def test_calls_sessions_and_rewards_round_trip(db: str) -> None:
    async with Store(db) as store:
        info = await store.resolve_session(SessionInfo(id="a", key="key-a", run="r", task_id="t"))
        assert await store.resolve_session(SessionInfo(id="b", key="key-a")) == replace(info, key=key_digest("key-a"))
        await asyncio.gather(*(store.record(call("a", i + 1, [i, i + 1])) for i in range(40)))
        await store.add_reward("a", 1.0, "verifier")
        await store.add_reward("a", -0.25, "judge")
        assert store.committed_batches < 40  # grouped commits
    async with Store(db) as store:  # reopened: everything is there
        [session] = await store.list_sessions()
        assert (session.calls, session.reward, session.run, session.task_id) == (40, 0.75, "r", "t")
        calls = [c async for c in store.iter_calls("a", batch=7)]
        assert [c.seq for c in calls] == list(range(1, 41))
        assert calls[5].completions[0].token_ids == [5, 6]
        assert calls[5].prompt_token_ids == [1, 2, 3, 6]
        assert calls[5].latency_ms == pytest.approx(5.0)
        assert (calls[5].policy_version, calls[5].policy_version_end) == ("v1", "v2")
        assert await store.last_seq("a") == 40


async def test_one_bad_write_loses_no_other(db: str) -> None:
    async with Store(db) as store:
        await store.resolve_session(SessionInfo(id="a", key="a"))
        good = [store.record_nowait(call("a", i, [i])) for i in range(1, 4)]
        orphan = store.record_nowait(call("no-such-session", 1, [9]))  # foreign key fails
        await asyncio.gather(*good)
        with pytest.raises(Exception, match=r"(?i)foreign key"):
            await orphan
        assert store.write_failures == 1
        assert [c.completions[0].token_ids async for c in store.iter_calls()] == [[1], [2], [3]]


async def test_a_call_into_an_ended_session_is_refused_by_the_database_and_its_batch_kept(db: str) -> None:
    """A proxy that looked the session up before another one ended it, or a call in flight at
    its end: the database refuses the call, and the calls batched with it are recorded."""
    async with Store(db) as one, Store(db) as two:
        for sid in ("over", "going"):
            await one.resolve_session(SessionInfo(id=sid, key=sid))
        await one.record(call("over", 1, [1]))
        await two.end_session("over", "ok")  # another proxy: `one` never hears of it
        late = one.record_nowait(call("over", 2, [2]))
        kept = one.record_nowait(call("going", 1, [3]))
        with pytest.raises(SessionClosed, match="over"):
            await late
        await kept
        assert one.write_failures == 0  # refused by design, not a failure of the store
        calls = [(c.session_id, c.seq) async for c in two.iter_calls()]
    assert calls == [("over", 1), ("going", 1)]


async def test_session_conflicts_are_named_and_keys_never_stored(db: str) -> None:
    async with Store(db) as store:
        created = await store.create_session(SessionInfo(id="a", key="sk-real-provider-key"))
        assert created.key == "sk-real-provider-key"  # the admin API shows it once
        with pytest.raises(SessionConflict, match="id 'a'"):
            await store.create_session(SessionInfo(id="a", key="k2"))
        with pytest.raises(SessionConflict, match="key is already in use"):
            await store.create_session(SessionInfo(id="b", key="sk-real-provider-key"))
    async with Store(db) as store:  # found again by its key, which is nowhere in the database
        found = await store.session_by_key("sk-real-provider-key")
        assert found is not None and found.id == "a" and found.key.startswith("sha256:")
        async with store.engine.connect() as conn:
            rows = (await conn.execute(text("SELECT * FROM sessions"))).all()
        assert "sk-real-provider-key" not in repr(rows)


async def test_two_stores_on_one_session_number_calls_without_collisions(db: str) -> None:
    """Two proxies serving one session (round robin behind a load balancer): each numbers calls
    from what it knew, and a number the other took first moves the call to the session's end."""
    async with Store(db) as one, Store(db) as two:
        numbers = {one: CallNumbers(), two: CallNumbers()}  # each proxy's own count

        async def record(store: Store, tokens: list[int]) -> None:
            numbers[store].recorded(await store.record(call("a", await numbers[store].next(store, "a"), tokens)))

        await one.resolve_session(SessionInfo(id="a", key="a"))
        await two.resolve_session(SessionInfo(id="a", key="a"))
        for turn in range(6):
            await record((one, two)[turn % 2], [turn])
        await asyncio.gather(*(record(store, [9]) for store in (one, two) for _ in range(10)))
        calls = [c async for c in one.iter_calls("a")]
    assert [c.seq for c in calls] == list(range(1, 27))
    assert [c.completions[0].token_ids for c in calls[:6]] == [[t] for t in range(6)]


async def test_calls_numbered_by_their_proxy_are_inserted_without_a_query(db: str) -> None:
    """Issue 49: each commit read the calls' numbers and ids back (two SELECTs) before inserting,
    though one proxy's numbers are nearly always free. Now the database is asked only after a
    unique violation says a number or call id is taken (the test above). And a batch is two
    INSERTs, its calls' and their completions': asked for the ids in the calls' order, SQLAlchemy
    sent SQLite one INSERT a call."""
    async with Store(db) as store:
        await store.resolve_session(SessionInfo(id="a", key="a"))
        sent: list[str] = []
        event.listen(store.write_engine, "before_cursor_execute", lambda *args: sent.append(args[2]))
        recorded = await asyncio.gather(*(store.record_nowait(call("a", seq, [seq])) for seq in (1, 2, 3)))
        assert [c.seq for c in recorded] == [1, 2, 3]
        assert sent and not [sql for sql in sent if sql.lstrip().upper().startswith("SELECT")], sent
        assert len([sql for sql in sent if sql.lstrip().upper().startswith("INSERT")]) == 2, sent


async def test_call_numbers_continue_a_stored_session_and_stay_bounded(db: str) -> None:
    async with Store(db) as store:
        await store.resolve_session(SessionInfo(id="a", key="a"))
        await store.resolve_session(SessionInfo(id="b", key="b"))
        for seq in (1, 2, 3):
            await store.record(call("a", seq, [seq]))
        numbers = CallNumbers(budget=400)  # room for one session
        assert [await numbers.next(store, "a") for _ in range(2)] == [4, 5]
        assert await numbers.next(store, "b") == 1  # "a" is forgotten: one session is kept
        assert await numbers.next(store, "a") == 4  # read again: 4 and 5 were never recorded


async def test_one_number_given_twice_in_a_batch_and_one_reward_id_in_two_sessions(db: str, caplog: Any) -> None:
    async with Store(db) as store:
        for sid in ("a", "b"):
            await store.resolve_session(SessionInfo(id=sid, key=sid))
            await store.add_reward(sid, 1.0, "verifier", reward_id="final")  # ids are per session
        recorded = await asyncio.gather(*(store.record_nowait(call("a", 1, [t])) for t in (7, 8)))
        assert sorted(c.seq for c in recorded) == [1, 2] and store.write_failures == 0
        assert not [r for r in caplog.records if "retrying one by one" in r.getMessage()]
        assert [s.reward for s in await store.list_sessions()] == [1.0, 1.0]


async def test_a_batch_sent_again_after_a_lost_commit_answer_is_recorded_once(db: str) -> None:
    """The connection drops while COMMIT's answer is on its way: the batch was committed, the
    writer cannot know it and sends it again. Nothing may be written twice."""
    async with Store(db) as store:
        await store.resolve_session(SessionInfo(id="a", key="a"))
        dialect = store.write_engine.dialect
        commit, dropped = dialect.do_commit, []

        def commit_then_drop(dbapi_connection: object) -> None:
            commit(dbapi_connection)
            if not dropped:
                dropped.append(True)
                raise DISCONNECTS[dialect.name]()

        dialect.do_commit = commit_then_drop  # type: ignore[method-assign]
        writes = [store.record_nowait(call("a", seq, [seq])) for seq in (1, 2, 3)]
        writes.append(asyncio.ensure_future(store.add_reward("a", 1.0, "verifier", reward_id="r-1")))
        recorded = await asyncio.gather(*writes)
        await store.add_reward("a", 1.0, "verifier", reward_id="r-1")  # a client's retry
        assert dropped and [c.seq for c in recorded[:3]] == [1, 2, 3]
        assert [c.seq async for c in store.iter_calls("a")] == [1, 2, 3]
        [session] = await store.list_sessions()
        assert session.reward == 1.0 and store.write_failures == 0


async def test_token_arrays_are_stored_packed(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    async with Store(str(db)) as store:
        await store.resolve_session(SessionInfo(id="a", key="a"))
        await store.record(call("a", 1, list(range(1000))))
    blob = sqlite3.connect(db).execute("select token_ids from completions").fetchone()[0]
    assert isinstance(blob, bytes) and len(blob) == 4000


async def test_newer_schema_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    async with Store(str(db)):
        pass
    with sqlite3.connect(db) as conn:
        conn.execute("insert into schema_version values (99)")
    with pytest.raises(SchemaMismatch, match="99"):
        async with Store(str(db)):
            pass


async def test_export_jsonl_has_the_documented_fields(db: str, tmp_path: Path) -> None:
    out = tmp_path / "calls.jsonl"
    async with Store(db) as store:
        await store.resolve_session(SessionInfo(id="a", key="a"))
        for i in range(1, 4):
            await store.record(call("a", i, [i, 2]))
        sessions: list[int] = []
        assert await export(store, out, on_session=sessions.append) == 3
    lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert len(lines) == 3 and sessions == [1]
    first = lines[0]
    for name in (
        "session_id",
        "seq",
        "api",
        "prompt_token_ids",
        "completion_token_ids",
        "logprobs",
        "policy_version",
        "request",
        "response",
    ):
        assert name in first
    assert first["completion_token_ids"] == [1, 2] and first["logprobs"] == [-0.5, -0.5]
    assert first["request"]["messages"][0]["content"] == "a/1"


async def test_an_older_store_is_migrated_its_keys_hashed_and_per_call_rewards_kept_apart(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    async with Store(str(db)) as store:
        await store.resolve_session(SessionInfo(id="a", key="a"))
        await store.record(call("a", 1, [5]))
        await store.add_reward("a", 1.0, "verifier")
    with sqlite3.connect(db) as conn:  # make it a version-1 store, as the first release wrote it
        for index in ("ix_calls_call_id", "ix_rewards_reward_id", "ix_sessions_created_at", "ix_sessions_status"):
            conn.execute(f"drop index {index}")
        conn.execute("alter table calls drop column call_id")
        conn.execute("alter table calls drop column token_in")
        conn.execute("alter table calls drop column thread_start")
        conn.execute("alter table rewards drop column reward_id")
        conn.execute("alter table rewards drop column call_seq")
        conn.execute("alter table calls drop column rewrites")
        conn.execute("drop index ix_calls_response_id")
        conn.execute("alter table calls drop column response_id")
        conn.execute("alter table sessions drop column outcome")
        conn.execute("alter table sessions drop column sampling")
        conn.execute("alter table calls drop column thread")
        conn.execute("alter table sessions drop column policy_model")
        conn.execute("update schema_version set version = 1")
        conn.execute("update sessions set key = 'a'")  # keys were stored as sent
    async with Store(str(db)) as store:
        assert (await store.session_by_key("a")) is not None
        await store.add_reward("a", 0.5, "judge", call_seq=1)
        await store.add_reward("a", 0.25, "judge", call_seq=1)
        [session] = await store.list_sessions()
        assert session.reward == 1.0 and session.calls == 1
        assert await store.call_rewards("a") == {1: 0.75}
    with sqlite3.connect(db) as conn:
        assert conn.execute("select version from schema_version").fetchall() == [(SCHEMA_VERSION,)]
        assert conn.execute("select key from sessions").fetchall() == [(key_digest("a"),)]
        assert conn.execute("select rewrites, response_id, call_id from calls").fetchall() == [(None, None, None)]
        for index in ("ix_calls_response_id", "ix_sessions_created_at", "ix_sessions_status"):
            assert conn.execute(f"select name from sqlite_master where name = '{index}'").fetchall(), index


async def test_a_version_7_store_moves_outcomes_and_sampling_out_of_the_metadata(tmp_path: Path) -> None:
    """Version 7 kept the runner's outcome and the forced sampling in the metadata, where a key
    label of the same name could overwrite them; the migration moves only values of their shape."""
    db = tmp_path / "s.db"
    async with Store(str(db)) as store:
        for sid in ("episode", "labelled"):
            await store.resolve_session(SessionInfo(id=sid, key=sid))
    old_outcome = {
        "status": "timeout",
        "output": "",
        "error": "killed",
        "exit_code": None,
        "log": None,
        "seconds": 3.0,
        "reward": None,
    }
    with sqlite3.connect(db) as conn:
        conn.execute("alter table sessions drop column outcome")
        conn.execute("alter table sessions drop column sampling")
        conn.execute("alter table calls drop column thread")
        conn.execute("alter table sessions drop column policy_model")
        conn.execute("update schema_version set version = 7")
        meta = {"episode": 2, "outcome": old_outcome, "sampling": {"temperature": 0.0}}
        conn.execute("update sessions set metadata = ? where id = 'episode'", (json.dumps(meta),))
        conn.execute("""update sessions set metadata = '{"outcome": "1"}' where id = 'labelled'""")
    async with Store(str(db)) as store:
        episode, labelled = await store.get_session("episode"), await store.get_session("labelled")
    assert episode is not None and labelled is not None
    assert episode.metadata == {"episode": 2} and episode.sampling == Sampling(temperature=0.0)
    assert episode.outcome is not None and (episode.outcome.harness, episode.outcome.error) == ("timeout", "killed")
    assert labelled.metadata == {"outcome": "1"} and labelled.outcome is None


async def test_a_stored_outcome_that_does_not_validate_is_ignored_not_raised(db: str) -> None:
    async with Store(db) as store:
        await store.resolve_session(SessionInfo(id="s", key="s"))
        async with store.engine.begin() as conn:  # as a bug, or a hand, could have written them
            bad = {"o": '{"harness": "exploded"}', "s": '"hot"'}
            await conn.execute(text("update sessions set outcome = :o, sampling = :s"), bad)
        session = await store.get_session("s")
    assert session is not None and session.outcome is None and session.sampling is None


async def test_sessions_filtered_sorted_paged_counted_and_summed_by_run(db: str) -> None:
    async with Store(db) as store:
        for i in range(6):
            sid = f"s{i}"
            info = SessionInfo(id=sid, key=sid, run=f"r{i % 2}", task_id="t", group_id=f"g{i // 3}")
            await store.resolve_session(info)
            for seq in range(1, i + 1):
                await store.record(call(sid, seq, [seq]))
            if i:  # s0 has no reward
                await store.add_reward(sid, i / 5, "verifier")
            await store.add_reward(sid, 9.0, "judge", call_seq=1)  # a call's reward is not the session's
            await store.end_session(sid, "ok" if i % 2 else "failed")
        by_reward = await store.list_sessions(run="r1", sort="reward", descending=True)
        assert [(s.id, s.reward, s.calls) for s in by_reward] == [("s5", 1.0, 5), ("s3", 0.6, 3), ("s1", 0.2, 1)]
        for descending in (False, True):  # s0, with no reward, last either way on both databases
            assert (await store.list_sessions(sort="reward", descending=descending))[-1].id == "s0"
        page = await store.list_sessions(sort="calls", offset=2, limit=2)
        assert [s.id for s in page] == ["s2", "s3"]
        assert await store.count_sessions(min_reward=0.4, max_reward=0.8) == 3  # s2, s3, s4
        assert await store.count_sessions(status="failed", group_id="g1") == 1  # s4
        runs = {r["run"]: r for r in await store.runs()}
        assert (runs["r0"]["sessions"], runs["r0"]["ok"], runs["r0"]["rewarded"]) == (3, 0, 2)
        assert float(runs["r1"]["mean_reward"]) == pytest.approx(0.6) and runs["r1"]["successes"] == 1
        assert await store.rewards("s1") == [("verifier", 0.2, None), ("judge", 9.0, 1)]


async def test_a_read_only_store_writes_nothing_and_refuses_a_missing_one_by_name(tmp_path: Path) -> None:
    """`Store(readonly=True)` (the viewer) opened SQLite read-write: it switched the file to WAL
    and created an empty database where none was."""
    missing = tmp_path / "nowhere.db"
    with pytest.raises(SchemaMismatch, match="no rl-proxy store at"):
        async with Store(str(missing), readonly=True):
            pass
    assert not missing.exists()
    db = tmp_path / "s.db"
    async with Store(str(db)) as store:
        await store.resolve_session(SessionInfo(id="s", key="s"))
    with sqlite3.connect(db) as conn:
        conn.execute("pragma journal_mode=delete")
    before = db.read_bytes()
    async with Store(str(db), readonly=True) as store:
        assert [s.id for s in await store.list_sessions()] == ["s"]
    with sqlite3.connect(db) as conn:
        assert conn.execute("pragma journal_mode").fetchone() == ("delete",)
    assert db.read_bytes() == before and not (tmp_path / "s.db-wal").exists()


async def test_recent_threads_are_the_newest_calls_that_have_one(db: str) -> None:
    """A call token-in cannot continue (failed, no ids) has no thread state: stored as SQL NULL,
    it never takes the place of one that has (JSON's null would have)."""
    async with Store(db) as store:
        await store.resolve_session(SessionInfo(id="s", key="s"))
        for seq in range(1, 7):
            state = {"messages": [], "tools": "00", "answers": []} if seq in (1, 2) else None
            await store.record(replace(call("s", seq, [seq]), thread=state))
        found = await store.recent_threads("s", 4)
    assert [c.seq for c in found] == [2, 1] and all(c.thread for c in found)


async def test_stores_opened_at_once_on_a_new_database_create_it_once(db: str) -> None:
    """Replicas of a deployment start together on a new database: each store creates the schema
    if it is missing. On PostgreSQL two such CREATE TABLEs raced (a unique violation in
    pg_type) and a proxy failed to start; now the first takes a lock and the others find it made."""
    stores = [Store(db) for _ in range(4)]
    await asyncio.gather(*(s.open() for s in stores))
    try:
        await stores[0].resolve_session(SessionInfo(id="a", key="a"))
        await stores[1].record(call("a", 1, [1]))
        assert [c.seq async for c in stores[2].iter_calls("a")] == [1]
    finally:
        for s in stores:
            await s.close()
