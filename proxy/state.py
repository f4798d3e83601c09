"""What one proxy app holds while it runs: settings, recorder, upstreams, metrics (app.state.rlp),
and the narrow seam to the recorder: the few things the proxy asks of a store."""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from proxy.metrics import Metrics
from proxy.settings import Settings
from proxy.threads import Threads
from proxy.upstream import Upstreams
from proxy.workers import Marks
from recorder import CallRecord, SessionInfo
from recorder.caches import ByteLRU
from recorder.episodes import EndStatus, EpisodeOutcome
from recorder.records import ThreadRecord


class Recorder(Protocol):
    """What the proxy needs of a store (recorder.Store is one). Failures are recorder.errors'
    StoreError (StoreValueError for a value the store refuses) and SessionConflict."""

    @property
    def queue_depth(self) -> int: ...  # writes waiting to be committed
    @property
    def write_failures(self) -> int: ...
    def record(self, call: CallRecord) -> Awaitable[CallRecord]: ...  # once committed, as numbered
    def session_by_key(self, key: str) -> Awaitable[SessionInfo | None]: ...
    def resolve_session(self, info: SessionInfo) -> Awaitable[SessionInfo]: ...  # created on first use
    def create_session(self, info: SessionInfo) -> Awaitable[SessionInfo]: ...
    def get_session(self, session_id: str) -> Awaitable[SessionInfo | None]: ...
    def list_sessions(self, *, run: str | None = None, limit: int | None = None) -> Awaitable[list[SessionInfo]]: ...
    def last_seq(self, session_id: str) -> Awaitable[int]: ...
    def add_reward(
        self, session_id: str, value: float, source: str, call_seq: int | None = None, reward_id: str | None = None
    ) -> Awaitable[None]: ...
    def end_session(
        self, session_id: str, status: EndStatus = "ended", outcome: EpisodeOutcome | None = None
    ) -> Awaitable[str | None]: ...  # the session's key digest
    def recent_threads(self, session_id: str, limit: int) -> Awaitable[list[ThreadRecord]]: ...  # token-in
    def key_cache_usage(self) -> dict[str, int]: ...  # its sessions-by-key cache (/healthz)
    def forget_sessions(self, digests: list[str] | None) -> None: ...  # those keys (None: all) from that cache
    def stored_response(
        self, session_id: str, response_id: str
    ) -> Awaitable[tuple[dict[str, Any], dict[str, Any]] | None]: ...


class CallNumbers:
    """Each session's call numbers (1, 2, ...), counted on the event loop only. A session first
    seen here continues after its last recorded call; a call the store moved (another proxy took
    its number first) moves the count on. Bounded by bytes: sessions not used for a while are
    forgotten and read again when they come back."""

    def __init__(self, budget: int = 16 * 2**20) -> None:
        self.cache: ByteLRU[str, int] = ByteLRU(budget, lambda _: 32)

    async def next(self, recorder: Recorder, session_id: str) -> int:
        if session_id not in self.cache:
            last = await recorder.last_seq(session_id)
            self.cache[session_id] = max(last, self.cache.get(session_id, 0))  # another call may have come first
        self.cache[session_id] += 1
        return self.cache[session_id]

    def recorded(self, call: CallRecord) -> None:
        if call.seq > self.cache.get(call.session_id, call.seq):
            self.cache[call.session_id] = call.seq


class RecentResponses:
    """The last answered Responses calls (request and answer, as JSON), by (session, response
    id), within a byte budget; the store is read on a miss (after a restart, another proxy's
    response, or an old one)."""

    def __init__(self, budget: int = 64 * 2**20) -> None:
        self.cache: ByteLRU[tuple[str, str], tuple[bytes, bytes]] = ByteLRU(budget, lambda v: len(v[0]) + len(v[1]))

    def remember(self, call: CallRecord) -> None:
        if call.answered and call.response_id and call.response:
            self.cache[call.session_id, call.response_id] = (orjson.dumps(call.request), orjson.dumps(call.response))

    def get(self, session_id: str, response_id: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
        found = self.cache.get((session_id, response_id))
        # A copy, as from the database: the translators may change what they are given.
        return None if found is None else (orjson.loads(found[0]), orjson.loads(found[1]))


@dataclass
class ProxyState:
    settings: Settings
    store: Recorder
    upstreams: Upstreams
    metrics: Metrics = field(default_factory=Metrics)
    numbers: CallNumbers = field(default_factory=CallNumbers)
    threads: Threads = field(default_factory=Threads)
    recent_responses: RecentResponses = field(default_factory=RecentResponses)
    marks: Marks | None = None  # shared by the workers of `serve --workers N` (proxy/workers.py)

    def __post_init__(self) -> None:
        self._ended_seen = 0 if self.marks is None else self.marks.ended_count()

    def ended(self, digest: str | None) -> None:
        """A session ended here: its key digest, for the other workers to forget."""
        if self.marks is not None and digest is not None:
            self.marks.end(digest)

    def forget_ended(self) -> None:
        """Before a call's session is looked up: the sessions other workers ended since are read
        again (all of them, if too many ended to name), so that none ended is taken as active."""
        if self.marks is not None and self.marks.ended_count() != self._ended_seen:
            self._ended_seen, digests = self.marks.ended_since(self._ended_seen)
            self.store.forget_sessions(digests)

    def caches(self) -> dict[str, dict[str, int]]:
        """Each per-process cache's entries, bytes and budget (/healthz)."""
        return {
            "threads": self.threads.cache.usage(),
            "responses": self.recent_responses.cache.usage(),
            "call_numbers": self.numbers.cache.usage(),
            "session_keys": self.store.key_cache_usage(),
        }

    def observe(self, call: CallRecord) -> None:
        m = self.metrics
        m.calls.labels(call.api, "ok" if call.ok else "failed").inc()
        if not call.ok:
            m.errors.labels(str(call.http_status)).inc()
        m.tokens.labels("prompt").inc(len(call.prompt_token_ids))
        m.tokens.labels("completion").inc(sum(len(c.token_ids) for c in call.completions))
        m.latency.labels(call.api).observe(call.latency_ms / 1000.0)
        if m.shared:  # a worker's gauges are summed as it last set them; one process sets them at a scrape
            self.gauge()

    def gauge(self) -> None:
        self.metrics.queue_depth.set(self.store.queue_depth)
        self.metrics.record_failures.set(self.store.write_failures)
