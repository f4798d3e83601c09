"""Reconstruction on hand-built calls: merging, every break reason, skips, one-per-call mode."""

from __future__ import annotations

from datetime import datetime

import pytest

from recorder import CallRecord, Completion, SessionInfo
from recorder.graph import build_sequences
from recorder.trajectories import NEUTRAL_LOGPROB

T0 = datetime(2026, 1, 1)
SYSTEM = {"role": "system", "content": "be brief"}


def call(
    seq: int,
    prompt: list[int],
    tokens: list[int],
    *,
    ok: bool = True,
    finish: str = "stop",
    request: dict | None = None,
    version: str = "v1",
    logprobs: list[float] | None = None,
) -> CallRecord:
    return CallRecord(
        session_id="s",
        seq=seq,
        api="chat.completions",
        model="m",
        upstream="u",
        stream=False,
        request=request if request is not None else {"messages": [SYSTEM]},
        response=None,
        ok=ok,
        http_status=200 if ok else 500,
        error=None if ok else "boom",
        prompt_token_ids=prompt,
        completions=[Completion(0, tokens, logprobs if logprobs is not None else [-0.1 * t for t in tokens], finish)],
        policy_version=version,
        policy_version_end=version,
        started_at=T0,
        finished_at=T0,
    )


def test_three_turns_merge_into_one_sequence() -> None:
    calls = [
        call(1, [1, 2, 3], [10, 11]),
        call(2, [1, 2, 3, 10, 11, 4, 5], [12], version="v2"),
        call(3, [1, 2, 3, 10, 11, 4, 5, 12, 6], [13, 14]),
    ]
    session = SessionInfo(id="s", key="s", run="r", task_id="t", group_id="g", reward=1.0)
    report = build_sequences(calls, session)
    [seq] = report.sequences
    assert seq.input_ids == [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14]
    assert seq.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    n = NEUTRAL_LOGPROB
    assert seq.logprobs == pytest.approx([n, n, n, -1.0, -1.1, n, n, -1.2, n, -1.3, -1.4])
    assert [(s.start, s.end, s.seq, s.version) for s in seq.spans] == [
        (3, 5, 1, "v1"),
        (7, 8, 2, "v2"),
        (9, 11, 3, "v1"),
    ]
    assert (seq.reward, seq.run, seq.task_id, seq.group_id) == (1.0, "r", "t", "g")
    assert report.breaks == [] and report.skipped == []
    assert report.tokens == 11 and report.unmerged_tokens == 5 + 8 + 11


def test_summarised_context_starts_a_new_chain_with_the_divergence() -> None:
    calls = [call(1, [1, 2, 3, 4, 5], [10]), call(2, [1, 2, 3, 9, 9], [11])]
    report = build_sequences(calls)
    assert len(report.sequences) == 2
    [brk] = report.breaks
    assert (brk.seq, brk.reason, brk.at) == (2, "prefix diverges", 3)
    assert brk.expected == [1, 2, 3, 4, 5, 10] and brk.found == [1, 2, 3, 9, 9]


def test_interleaved_agents_give_two_sequences() -> None:
    a1, b1 = call(1, [1, 2], [10]), call(2, [7, 8], [20])
    a2, b2 = call(3, [1, 2, 10, 3], [11]), call(4, [7, 8, 20, 9], [21])
    report = build_sequences([b2, a2, b1, a1])  # order comes from seq, not from the list
    assert [s.input_ids for s in report.sequences] == [[1, 2, 10, 3, 11], [7, 8, 20, 9, 21]]
    assert [(b.seq, b.reason) for b in report.breaks] == [(2, "no common prefix")]


def test_retry_tools_and_system_prompt_breaks_are_named() -> None:
    tools = {"messages": [SYSTEM], "tools": [{"type": "function", "function": {"name": "f"}}]}
    other_system = {**tools, "messages": [{"role": "system", "content": "be verbose"}]}
    calls = [
        call(1, [1, 2], [10]),
        call(2, [1, 2], [11]),  # the same prompt again
        call(3, [5, 6], [12], request=tools),
        call(4, [5, 7], [13], request=other_system),
    ]
    assert [b.reason for b in build_sequences(calls).breaks] == ["retry", "tools changed", "system prompt changed"]


def test_a_change_of_model_never_merges() -> None:
    other = {"messages": [SYSTEM], "model": "judge"}
    report = build_sequences([call(1, [1, 2], [10]), call(2, [1, 2, 10, 3], [11], request=other)])
    assert [(b.seq, b.reason) for b in report.breaks] == [(2, "model changed")]
    assert len(report.sequences) == 2


def test_bad_calls_are_skipped_and_reported_never_merged() -> None:
    calls = [
        call(1, [1, 2], [10]),
        call(2, [1, 2, 10, 3], [11], ok=False),
        call(3, [1, 2, 10, 3], [12], logprobs=[-1.0, -2.0]),
        call(4, [1, 2, 10, 3], [13], finish="length"),
    ]
    report = build_sequences(calls)
    assert [seq for seq, _ in report.skipped] == [2, 3]
    assert "HTTP 500" in report.skipped[0][1] and "2 logprobs for 1 tokens" in report.skipped[1][1]
    [seq] = report.sequences
    assert seq.input_ids == [1, 2, 10, 3, 13] and seq.truncated


def test_one_sample_per_call() -> None:
    calls = [call(1, [1, 2], [10]), call(2, [1, 2, 10, 3], [11])]
    report = build_sequences(calls, merge=False)
    assert [s.input_ids for s in report.sequences] == [[1, 2, 10], [1, 2, 10, 3, 11]]
    assert [s.loss_mask for s in report.sequences] == [[0, 0, 1], [0, 0, 0, 0, 1]]
    assert report.breaks == [] and report.tokens == report.unmerged_tokens == 8


def test_extra_choices_become_their_own_sequences() -> None:
    two = call(1, [1, 2], [10])
    two = CallRecord(
        **{**two.__dict__, "completions": [*two.completions, Completion(1, [20, 21], [-1.0, -1.0], "stop")]}
    )
    report = build_sequences([two, call(2, [1, 2, 10, 3], [11])])
    assert [s.input_ids for s in report.sequences] == [[1, 2, 10, 3, 11], [1, 2, 20, 21]]
    assert [[(span.seq, span.choice) for span in s.spans] for s in report.sequences] == [[(1, 0), (2, 0)], [(1, 1)]]


def test_an_extra_choice_forks_the_chain_with_its_earlier_turns() -> None:
    """Call 2 samples two choices; call 3 continues the second: both branches keep call 1's
    sampled turn, and the one call 3 extends is the second choice's."""
    second = call(2, [1, 2, 10, 3], [11])
    second = CallRecord(
        **{**second.__dict__, "completions": [*second.completions, Completion(1, [20], [-1.0], "stop")]}
    )
    report = build_sequences([call(1, [1, 2], [10]), second, call(3, [1, 2, 10, 3, 20, 4], [12])])
    first_choice, continued = report.sequences
    assert first_choice.input_ids == [1, 2, 10, 3, 11] and first_choice.loss_mask == [0, 0, 1, 0, 1]
    assert continued.input_ids == [1, 2, 10, 3, 20, 4, 12] and continued.loss_mask == [0, 0, 1, 0, 1, 0, 1]
    assert [(span.seq, span.choice) for span in continued.spans] == [(1, 0), (2, 1), (3, 0)]
