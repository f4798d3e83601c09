"""The data that crosses packages: a recorded call and a session (an episode's own fields are
typed in recorder/episodes.py).

These frozen dataclasses are the contract between the proxy (which fills them), the store
(which persists them) and the trainer and exporters (which read them back).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any
from uuid import uuid4

from recorder.episodes import EpisodeOutcome, EpisodeReward, RewardRule, Sampling, SessionStatus, episode_reward


@dataclass(frozen=True)
class Completion:
    """One sampled choice of a call: exactly the tokens the model produced."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


@dataclass(frozen=True)
class CallRecord:
    """One model call as it went through the proxy.

    `request` and `response` are the bodies as the client sent and received them (a streamed
    response is stored assembled into the non-streamed shape). Token ids and logprobs are
    the upstream's own, never re-tokenized. `policy_version_end` differs from
    `policy_version` when the weights were swapped while the call was running.
    """

    session_id: str
    seq: int
    api: str
    model: str
    upstream: str
    stream: bool
    request: dict[str, Any]
    response: dict[str, Any] | None
    ok: bool
    http_status: int
    error: str | None
    # A list as read back; the proxy records the array its capture made (packed as it is).
    prompt_token_ids: Sequence[int]
    completions: list[Completion]
    policy_version: str | None
    policy_version_end: str | None
    started_at: datetime
    finished_at: datetime
    rewrites: dict[str, Any] = field(default_factory=dict)  # what the proxy changed: {name: [was, now]}
    response_id: str | None = None  # the Responses API's id of this answer (previous_response_id)
    # Chosen where the call is made and unique in the store: a write retried after a commit whose
    # answer was lost finds its call already there instead of writing it twice.
    # Token-in (proxy/threads.py): whether the prompt was built from the tokens of an earlier call
    # of the session, and if the call starts a new thread instead, why (or, for a second call that
    # continued the same answer, a retry or a fork, which call continued it first).
    token_in: bool = False
    thread_start: str | None = None
    # Token-in's state of this call beyond the record (its upstream messages' and tools' digests,
    # each choice's message), so that another proxy, or this one after a restart, continues it.
    thread: dict[str, Any] | None = None
    # (None when read back from a store written before schema version 6.) A copy made with
    # dataclasses.replace keeps it: give a copy recorded as a call of its own a new one.
    call_id: str | None = field(default_factory=lambda: uuid4().hex)

    @property
    def answered(self) -> bool:
        """The client got this answer whole (whether or not it can be trained on: `ok`)."""
        return self.http_status == 200 and self.response is not None

    @property
    def latency_ms(self) -> float:
        return (self.finished_at - self.started_at).total_seconds() * 1000.0

    def flat(self) -> dict[str, Any]:
        """Every field but the completions, and the latency: one row of the `calls` table."""
        row = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "completions"}
        row["latency_ms"] = self.latency_ms
        return row


@dataclass(frozen=True)
class SessionInfo:
    """A session: one agent episode. Its key is what the harness sends as its API key.

    `metadata` is the client's (key labels, the admin API's `metadata`): nothing the proxy,
    recorder or trainer reads is kept there. `outcome` and `sampling` are written only through
    the admin API. `reward` (the sum posted for the session), `calls` and `upstream_failures`
    (calls answered 5xx) are counted by the store when it reads sessions back."""

    id: str
    key: str
    run: str | None = None
    task_id: str | None = None
    group_id: str | None = None
    # The model name the harness's own work asks for (the admin API's, or the key's `model=`): its
    # calls to any other name that nothing links to the work are side calls (recorder/graph.py).
    policy_model: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    status: SessionStatus = "active"
    created_at: datetime | None = None
    ended_at: datetime | None = None
    reward: float | None = None
    calls: int = 0
    outcome: EpisodeOutcome | None = None
    sampling: Sampling | None = None
    upstream_failures: int = 0

    def training_reward(self, rule: RewardRule) -> EpisodeReward:
        """The reward this episode trains with under `rule` (recorder/episodes.py)."""
        return episode_reward(self.status, self.outcome, self.reward, self.upstream_failures, rule)


@dataclass(frozen=True)
class ThreadRecord:
    """What token-in needs of a recorded call to continue it (`Store.recent_threads`): its
    `CallRecord.thread` state, prompt ids and each choice's sampled ids, by choice index."""

    call_id: str
    seq: int
    prompt_token_ids: list[int]
    sampled: list[list[int]]
    thread: dict[str, Any]


@dataclass(frozen=True)
class LearnerView:
    """What the learner saw of one training sequence in a step: its logprob of each trained token
    (in order; the behaviour logprobs are the calls' own) and the sequence's advantage."""

    session_id: str
    first_seq: int  # the sequence's first call
    advantage: float
    logprobs: list[float]
