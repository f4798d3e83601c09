"""Capture validation: how far an episode's records can be trusted for training, graded.

- FATAL (the trainer skips the episode and counts it): no call; a call meant for training that
  was answered but holds no token ids or logprobs; a training sequence whose trained ids are
  not the ids its calls sampled; fewer trained calls answered than the harness was expected to
  make (`min_calls`: aux and failed calls do not count).
- WARN: under 90% of the sampled tokens of trained calls reach a training sequence; a retry
  whose pair neither a later call continued (the re-send is trained, a guess); aux calls that
  sampled more tokens than the trained ones.
- INFO: everything else worth a line (calls placed `new` with their reasons).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from recorder.graph import Placement, SessionGraph, build, delivery
from recorder.records import CallRecord, SessionInfo
from recorder.store import Store
from recorder.trajectories import TrainingSequence

Level = Literal["FATAL", "WARN", "INFO", "OK"]
LEVELS: tuple[Level, ...] = ("FATAL", "WARN", "INFO", "OK")
MIN_DELIVERED = 0.9


@dataclass(frozen=True)
class Grade:
    level: Level
    problems: list[str] = field(default_factory=list)  # the worst level's first, as sentences


def grade(calls: list[CallRecord], graph: SessionGraph, min_calls: int = 1) -> Grade:
    """The grade of one episode: its calls and its graph (graph.build)."""
    found: dict[Level, list[str]] = {"FATAL": [], "WARN": [], "INFO": []}
    if not calls:
        return Grade("FATAL", ["no call reached the proxy"])
    placements, sequences = graph.placements, graph.trained.sequences
    placed = {p.seq: p for p in placements}
    for call in calls:
        if not placed[call.seq].trained or not call.answered:
            continue
        bare = not call.prompt_token_ids or any(not c.token_ids for c in call.completions)
        unmatched = any(len(c.logprobs) != len(c.token_ids) for c in call.completions)
        if bare or unmatched:
            found["FATAL"].append(f"call {call.seq} was answered without its token ids or logprobs")
    by_seq = {c.seq: c for c in calls}
    for sequence in sequences:
        for span in sequence.spans:
            window = zip(
                sequence.input_ids[span.start : span.end], sequence.loss_mask[span.start : span.end], strict=True
            )
            if [t for t, m in window if m] != by_seq[span.seq].completions[span.choice].token_ids:
                found["FATAL"].append(f"sequence {sequence.chain} trains other ids than call {span.seq} sampled")
    made = sum(placed[c.seq].trained and c.ok for c in calls)
    if not made:
        found["FATAL"].append(
            f"no trained call: its {len(calls)} call(s) failed or are aux (side calls, or another model "
            f"than the session's policy model {graph.policy!r} that nothing links to the work)"
        )
    elif made < min_calls:
        found["FATAL"].append(f"{made} trained call(s), and the harness was expected to make at least {min_calls}")
    reached, meant, _ = delivery(calls, graph)
    if meant and reached / meant < MIN_DELIVERED:
        found["WARN"].append(f"only {reached} of {meant} sampled tokens of trained calls reach a training sequence")
    aux = sum(len(c.token_ids) for call in calls if placed[call.seq].purpose == "aux" for c in call.completions)
    if aux > meant:
        found["WARN"].append(f"aux calls sampled {aux} tokens, the trained calls {meant}")
    continued = {p.parent for p in placements if p.edge in ("continue", "fork")}
    found["WARN"] += [
        f"call {p.seq} re-sent call {p.parent} and no later call continued either: the last is trained"
        for p in placements
        if p.edge == "retry"
        and p.parent is not None
        and by_seq[p.parent].answered
        and not {p.seq, p.parent} & continued
    ]
    found["INFO"] += [
        f"call {p.seq} starts a sequence: {p.reason}"
        for p in placements[1:]
        if p.edge == "new" and p.purpose == "train"
    ]
    level: Level = next((lv for lv in LEVELS if found.get(lv)), "OK")
    return Grade(level, [line for lines in found.values() for line in lines])


@dataclass(frozen=True)
class Checked:
    """An episode's graph (graph.build: its placements and trained sequences) and its grade."""

    graph: SessionGraph
    grade: Grade

    @property
    def placements(self) -> list[Placement]:
        return self.graph.placements

    @property
    def sequences(self) -> list[TrainingSequence]:
        return self.graph.trained.sequences


def check(
    calls: list[CallRecord],
    session: SessionInfo | None = None,
    min_calls: int = 1,
    call_rewards: dict[int, float] | None = None,
) -> Checked:
    graph = build(calls, session, call_rewards)
    return Checked(graph, grade(calls, graph, min_calls))


async def grade_counts(store: Store, sessions: list[str]) -> Counter[str]:
    """How many of these sessions have each grade (`rl-proxy collect` prints them)."""
    counts: Counter[str] = Counter()
    for session_id in sessions:
        info = await store.get_session(session_id)
        counts[check([c async for c in store.iter_calls(session_id)], info).grade.level] += 1
    return counts


def grade_line(counts: Counter[str]) -> str:
    return "capture grades: " + ", ".join(f"{level} {counts.get(level, 0)}" for level in LEVELS)
