"""The store's one writer: a queue of writes that a single task commits in batches (group commit)
on a thread of its own, with one synchronous connection kept for the store's life.

A write is a `CallRecord` or a function of the connection (a new session, a reward, a session's
end). Each write's future resolves only once its batch is committed, so a call is durable before
the proxy answers the client. One thread hop per batch is what keeps recording under a
millisecond: the same insert through SQLAlchemy's async engine took 1.7-2.5 ms (six aiosqlite
hops and the async session machinery; see docs/benchmarks.md, "Proxy overhead"). If a batch
fails, its writes are retried one by one so that one bad record cannot lose the others. Every
write is idempotent (a call carries its own `call_id`, a reward its `reward_id`, a session is
created once): a batch whose connection dropped, even during COMMIT, is simply sent again.
Reads are not here: they go through the async engine (store.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import IntegrityError

from recorder.batches import insert_calls, number_calls
from recorder.errors import SessionClosed
from recorder.records import CallRecord
from recorder.schema import ENDED

log = logging.getLogger("rl_proxy.recorder")

Op = Callable[[Connection], object]
Write = CallRecord | Op
MAX_BATCH = 512
ATTEMPTS = 4  # of a batch: as numbered, then when its connection dropped or its call numbers were taken


class Writer:
    """Group commit over `engine`. `start` in a running event loop, `close` to drain and stop."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recorder-writer")
        self._conn: Connection | None = None
        self._queue: asyncio.Queue[tuple[Write, asyncio.Future[Any]] | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.failures = 0
        self.committed_batches = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="recorder-writer")

    async def close(self) -> None:
        if self._task is not None:
            await self._queue.put(None)
            await self._task
            self._task = None
        if self._conn is not None:
            self._thread.submit(self._conn.close).result()
        self._thread.shutdown()
        self.engine.dispose()

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    def submit(self, write: Write) -> asyncio.Future[Any]:
        """Queue a write; the future resolves once it is committed, to the call as recorded (or
        to what the operation returned)."""
        if self._task is None:
            raise RuntimeError("Store is not open")
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((write, done))
        return done

    async def _loop(self) -> None:
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
        """Commit `writes` in one transaction; what each resolves to. A connection the server
        dropped (a restart) is replaced and the batch sent again, even if it dropped during
        COMMIT: every write is idempotent, so one that was committed is not written twice. Calls
        are first inserted as this proxy numbered them, with no query; a unique violation (a
        number another proxy took, a call already stored) has the batch numbered anew from the
        database and sent again."""
        for attempt in range(ATTEMPTS):
            if self._conn is None:
                self._conn = self.engine.connect()
            conn = self._conn
            try:
                with conn.begin():
                    # sessions before calls: a call's session must exist
                    results = {i: w(conn) for i, w in enumerate(writes) if not isinstance(w, CallRecord)}
                    calls = [(i, w) for i, w in enumerate(writes) if isinstance(w, CallRecord)]
                    if calls:
                        # First as this proxy numbered them (no query): a unique violation says a
                        # number or call_id is taken, and the next attempt numbers them anew.
                        given = [w for _, w in calls]
                        recorded, to_insert = (given, given) if attempt == 0 else number_calls(conn, given)
                        if to_insert:
                            insert_calls(conn, to_insert)
                        results.update(zip([i for i, _ in calls], recorded, strict=True))
                return [results[i] for i in range(len(writes))]
            except IntegrityError as exc:
                if ENDED in str(exc.orig):  # refused, not a number taken: the same batch would be again
                    raise SessionClosed(_ended_session(writes, str(exc.orig))) from exc
                if attempt == ATTEMPTS - 1 or not any(isinstance(w, CallRecord) for w in writes):
                    raise
            except Exception:
                if not conn.invalidated or attempt == ATTEMPTS - 1:
                    raise
                conn.close()
                self._conn = None
        raise AssertionError("unreachable")

    async def _commit(self, batch: list[tuple[Write, asyncio.Future[Any]]]) -> None:
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._thread, self._commit_sync, [w for w, _ in batch])
        except Exception as exc:
            if len(batch) == 1:
                if not isinstance(exc, SessionClosed):  # a refusal by design, not the store failing
                    self.failures += 1
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


def _ended_session(writes: list[Write], refusal: str) -> str:
    """The refusal in words: the ended session, where the batch is one call (retried one by one)."""
    calls = [w for w in writes if isinstance(w, CallRecord)]
    return f"session {calls[0].session_id!r} has ended" if len(calls) == 1 else refusal


def _settle(done: asyncio.Future[Any], exc: BaseException | None, result: Any = None) -> None:
    if done.done():
        return
    if exc is None:
        done.set_result(result)
    else:
        done.set_exception(exc)
