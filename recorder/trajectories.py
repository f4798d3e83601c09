"""Training sequences assembled from a session's recorded calls, as the session graph chains
them (recorder/graph.py decides which call extends which): pure functions, no I/O.

A call that extends a chain (its prompt token ids start with every earlier prompt and sampled
token of the chain) adds its new prompt tokens (tool output, the next user turn, template glue)
with loss mask 0 and its sampled tokens with mask 1. A call that starts a chain reports why it
did not extend the one before (compaction, injected reminders, sub-agents, retries, a change of
model, interleaved agents), so that each is its own sequence instead of a wrong one. Nothing is
re-tokenized: every id comes from the upstream. Failed calls, calls without tokens and calls
whose logprobs do not match their tokens are skipped and reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from recorder.records import CallRecord, Completion, SessionInfo

NEUTRAL_LOGPROB = 0.0  # where the loss mask is 0
WINDOW = 8  # tokens shown on each side of a divergence


@dataclass(frozen=True)
class Span:
    """Tokens [start, end) of a sequence sampled in call `seq` under `version`."""

    start: int
    end: int
    seq: int
    version: str | None
    version_end: str | None
    reward: float | None = None  # posted for this call alone, if any
    choice: int = 0  # which of the call's choices (n > 1) was sampled here


@dataclass(frozen=True)
class Break:
    """Why call `seq` started a new chain instead of extending the previous call's chain."""

    seq: int
    reason: str
    at: int | None = None
    expected: list[int] = field(default_factory=list)
    found: list[int] = field(default_factory=list)
    thread_start: str | None = None  # why the proxy did not continue a thread (token-in), if it says


@dataclass(frozen=True)
class TrainingSequence:
    """One training sample: a chain of calls joined on their token ids."""

    session_id: str
    chain: int
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    spans: list[Span]
    truncated: bool
    reward: float | None = None
    run: str | None = None
    task_id: str | None = None
    group_id: str | None = None

    @property
    def calls(self) -> list[int]:
        return [s.seq for s in self.spans]

    @property
    def sampled_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass(frozen=True)
class SessionReport:
    """What became of a session's calls: sequences, breaks and skipped calls."""

    session_id: str
    calls: int
    sequences: list[TrainingSequence]
    breaks: list[Break]
    skipped: list[tuple[int, str]]
    unmerged_tokens: int  # prompt + completion of every used call: the cost without merging

    @property
    def tokens(self) -> int:
        return sum(len(s.input_ids) for s in self.sequences)


@dataclass
class _Chain:
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    truncated: bool = False
    request: dict[str, Any] = field(default_factory=dict)

    def copy(self) -> _Chain:
        return replace(
            self, ids=list(self.ids), mask=list(self.mask), logprobs=list(self.logprobs), spans=list(self.spans)
        )

    def extend(self, call: CallRecord, completion: Completion, reward: float | None) -> None:
        prompt_part = call.prompt_token_ids[len(self.ids) :]
        self.ids += prompt_part
        self.mask += [0] * len(prompt_part)
        self.logprobs += [NEUTRAL_LOGPROB] * len(prompt_part)
        start = len(self.ids)
        self.ids += completion.token_ids
        self.mask += [1] * len(completion.token_ids)
        self.logprobs += completion.logprobs
        self.spans.append(
            Span(start, len(self.ids), call.seq, call.policy_version, call.policy_version_end, reward, completion.index)
        )
        self.truncated = completion.finish_reason == "length"
        self.request = call.request


def _chosen(call: CallRecord, choice: int) -> Completion:
    """The call's choice `choice` (its first, if a record names one it lacks)."""
    return next((c for c in call.completions if c.index == choice), call.completions[0])


def skip_reason(call: CallRecord, choice: int = 0) -> str | None:
    """Why a call (its choice `choice`) cannot be in a training sequence, if it cannot."""
    if not call.ok:
        return f"failed call (HTTP {call.http_status}): {call.error}"
    if not call.prompt_token_ids or not call.completions:
        return "no token ids recorded (an upstream that does not return them?)"
    sampled = _chosen(call, choice)
    if not sampled.token_ids:
        return "empty completion"
    if len(sampled.logprobs) != len(sampled.token_ids):
        return f"{len(sampled.logprobs)} logprobs for {len(sampled.token_ids)} tokens"
    return None


def _system(request: dict[str, Any]) -> Any:
    messages = request.get("messages") or []
    return messages[0].get("content") if messages and messages[0].get("role") == "system" else None


def _break(call: CallRecord, previous: _Chain, prompts: set[tuple[int, ...]]) -> Break:
    return replace(_why_break(call, previous, prompts), thread_start=call.thread_start)


def _why_break(call: CallRecord, previous: _Chain, prompts: set[tuple[int, ...]]) -> Break:
    prompt = call.prompt_token_ids
    if tuple(prompt) in prompts:
        return Break(call.seq, "retry")
    if call.request.get("model") != previous.request.get("model"):
        return Break(call.seq, "model changed")
    if call.request.get("tools") != previous.request.get("tools"):
        return Break(call.seq, "tools changed")
    if _system(call.request) != _system(previous.request):
        return Break(call.seq, "system prompt changed")
    k = 0
    for a, b in zip(previous.ids, prompt, strict=False):
        if a != b:
            break
        k += 1
    if k == 0:
        return Break(call.seq, "no common prefix", 0)
    window = slice(max(0, k - WINDOW), k + WINDOW)
    return Break(call.seq, "prefix diverges", k, previous.ids[window], list(prompt[window]))


def assemble(
    placed: list[tuple[CallRecord, int, int]],
    session: SessionInfo | None = None,
    call_rewards: dict[int, float] | None = None,
    merge: bool = True,
) -> tuple[SessionReport, list[TrainingSequence]]:
    """The sequences of calls as the graph chained them: `placed` holds, in call order, each call,
    the first call of the chain it belongs to (itself: it starts one) and which of its choices
    the chain goes on with; a call's prompt extends its chain's tokens (the graph joined it only
    so). Each other choice of an n > 1 call is a sequence of its own, the chain up to that call
    and then that choice: the second list. `merge=False`: one sequence per call. The session's
    reward goes with every sequence; `call_rewards` (by call number) with their sampled spans."""
    call_rewards = call_rewards or {}
    chains: dict[int, _Chain] = {}  # by the chain's first call: its tokens so far
    made: list[_Chain] = []
    others: list[_Chain] = []
    breaks: list[Break] = []
    skipped: list[tuple[int, str]] = []
    prompts: set[tuple[int, ...]] = set()
    previous: _Chain | None = None
    unmerged = 0
    for call, root, choice in placed:
        reason = skip_reason(call, choice)
        if reason is not None:
            skipped.append((call.seq, reason))
            continue
        root = root if merge else call.seq
        chain = chains.get(root)
        if chain is None or call.prompt_token_ids[: len(chain.ids)] != chain.ids:
            if previous is not None and merge:
                breaks.append(_break(call, previous, prompts))
            chain = chains[root] = _Chain()  # a root whose own call was skipped: the chain starts here
            made.append(chain)
        sampled = _chosen(call, choice)
        before = chain.copy() if len(call.completions) > 1 else chain
        chain.extend(call, sampled, call_rewards.get(call.seq))
        unmerged += len(call.prompt_token_ids) + len(sampled.token_ids)
        for other in call.completions:  # the other choices of the same prompt: each a fork of the chain
            if other is not sampled and other.token_ids and len(other.logprobs) == len(other.token_ids):
                alternative = before.copy()
                alternative.extend(call, other, call_rewards.get(call.seq))
                others.append(alternative)
                unmerged += len(call.prompt_token_ids) + len(other.token_ids)
        prompts.add(tuple(call.prompt_token_ids))
        previous = chain
    session_id = session.id if session else (placed[0][0].session_id if placed else "")

    def sequence(i: int, c: _Chain) -> TrainingSequence:
        return TrainingSequence(
            session_id,
            i,
            c.ids,
            c.mask,
            c.logprobs,
            c.spans,
            c.truncated,
            reward=session.reward if session else None,
            run=session.run if session else None,
            task_id=session.task_id if session else None,
            group_id=session.group_id if session else None,
        )

    sequences = [sequence(i, c) for i, c in enumerate(made)]
    report = SessionReport(session_id, len(placed), sequences, breaks, skipped, unmerged)
    return report, [sequence(len(sequences) + i, c) for i, c in enumerate(others)]
