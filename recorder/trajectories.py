"""Training sequences rebuilt from a session's recorded calls: pure functions, no I/O.

Prefix merging on token ids (the default): a call whose prompt token ids start with an open
chain's tokens (every earlier prompt and completion of that chain) extends it; the new prompt
tokens (tool output, the next user turn, template glue) get loss mask 0, the sampled tokens
mask 1. A call that extends no chain starts one, and the break is reported with its reason, so
compaction, injected reminders, sub-agents, retries, a change of model and interleaved agents
each become their own sequence instead of a wrong one. Nothing is re-tokenized: every id comes from the upstream.
Failed calls, calls without tokens and calls whose logprobs do not match their tokens are
skipped and reported.
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


def _skip_reason(call: CallRecord) -> str | None:
    if not call.ok:
        return f"failed call (HTTP {call.http_status}): {call.error}"
    if not call.prompt_token_ids or not call.completions:
        return "no token ids recorded (an upstream that does not return them?)"
    first = call.completions[0]
    if not first.token_ids:
        return "empty completion"
    if len(first.logprobs) != len(first.token_ids):
        return f"{len(first.logprobs)} logprobs for {len(first.token_ids)} tokens"
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
    return Break(call.seq, "prefix diverges", k, previous.ids[window], prompt[window])


def build_sequences(
    calls: list[CallRecord],
    session: SessionInfo | None = None,
    merge: bool = True,
    call_rewards: dict[int, float] | None = None,
) -> SessionReport:
    """A session's training sequences. `merge=False` gives one sequence per call. The session's
    reward goes with every sequence; `call_rewards` (by call number) with their sampled spans."""
    call_rewards = call_rewards or {}
    ordered = sorted(calls, key=lambda c: c.seq)
    chains: list[_Chain] = []
    breaks: list[Break] = []
    skipped: list[tuple[int, str]] = []
    prompts: set[tuple[int, ...]] = set()
    previous: _Chain | None = None
    unmerged = 0
    for call in ordered:
        reason = _skip_reason(call)
        if reason is not None:
            skipped.append((call.seq, reason))
            continue
        completion = call.completions[0]
        unmerged += len(call.prompt_token_ids) + len(completion.token_ids)
        extendable = [
            c
            for c in chains
            if merge
            and c.request.get("model") == call.request.get("model")
            and call.prompt_token_ids[: len(c.ids)] == c.ids
        ]
        if extendable:
            chain = max(extendable, key=lambda c: len(c.ids))
        else:
            if merge and previous is not None:
                breaks.append(_break(call, previous, prompts))
            chain = _Chain()
            chains.append(chain)
        fork = chain.copy() if len(call.completions) > 1 else chain
        chain.extend(call, completion, call_rewards.get(call.seq))
        prompts.add(tuple(call.prompt_token_ids))
        previous = chain
        for extra in call.completions[1:]:  # other choices of the same prompt: each a fork of the chain
            if extra.token_ids and len(extra.logprobs) == len(extra.token_ids):
                alternative = fork.copy()
                alternative.extend(call, extra, call_rewards.get(call.seq))
                chains.append(alternative)
                unmerged += len(call.prompt_token_ids) + len(extra.token_ids)
    session_id = session.id if session else (ordered[0].session_id if ordered else "")
    sequences = [
        TrainingSequence(
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
        for i, c in enumerate(chains)
    ]
    return SessionReport(session_id, len(ordered), sequences, breaks, skipped, unmerged)
