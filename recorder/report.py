"""Merge reports as text: why a session's calls did or did not join into one sequence, and a
run's summary. Pure functions over `SessionReport`s; decoding token windows is optional."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from recorder.trajectories import Break, SessionReport
from recorder.validation import grade_line

Decode = Callable[[list[int]], str]


def describe_break(brk: Break, decode: Decode | None = None) -> str:
    text = f"call {brk.seq} starts a new chain: {brk.reason}"
    if brk.at is not None and brk.reason == "prefix diverges":
        text += f" at token {brk.at}"
    if brk.thread_start:
        text += f" (the proxy started a new thread: {brk.thread_start})"
    if brk.expected or brk.found:
        show: Decode = decode or (lambda ids: str(ids))
        text += f"\n    chain had:   {show(brk.expected)!r}\n    prompt has:  {show(brk.found)!r}"
    return text


def session_lines(report: SessionReport, decode: Decode | None = None) -> list[str]:
    saved = report.unmerged_tokens - report.tokens
    lines = [
        f"{report.calls} calls -> {len(report.sequences)} sequence(s); "
        f"{report.tokens} training tokens merged vs {report.unmerged_tokens} one per call "
        f"({saved} saved)"
    ]
    for seq in report.sequences:
        flag = ", truncated" if seq.truncated else ""
        lines.append(
            f"  sequence {seq.chain}: calls {seq.calls}, {len(seq.input_ids)} tokens, "
            f"{seq.sampled_tokens} sampled{flag}"
        )
    lines += ["  " + describe_break(b, decode) for b in report.breaks]
    lines += [f"  call {seq} skipped: {why}" for seq, why in report.skipped]
    return lines


@dataclass(frozen=True)
class RunSummary:
    sessions: int
    empty_sessions: list[str]
    calls: int
    sequences: int
    merged_tokens: int
    unmerged_tokens: int
    breaks: Counter[str]
    skipped: int
    mean_reward: float | None
    edges: Counter[str]  # calls by how they joined their session (recorder/graph.py), and aux calls
    delivered: tuple[int, int, int]  # graph.delivery summed: reaching a sequence, meant to, in one chain
    grades: Counter[str]  # episodes by capture grade (recorder/validation.py)

    def lines(self) -> list[str]:
        ratio = self.unmerged_tokens / self.merged_tokens if self.merged_tokens else 0.0
        out = [
            f"sessions {self.sessions} ({len(self.empty_sessions)} without calls), calls {self.calls}, "
            f"sequences {self.sequences}, skipped calls {self.skipped}",
            f"training tokens: {self.merged_tokens} merged vs {self.unmerged_tokens} one per call ({ratio:.2f}x)",
            "mean reward: " + ("none posted" if self.mean_reward is None else f"{self.mean_reward:.3f}"),
        ]
        out.append("calls by edge: " + ", ".join(f"{edge} {n}" for edge, n in self.edges.items()))
        reached, sampled, chain = self.delivered
        fraction, one = (f"{reached / sampled:.4f}", f"{chain / sampled:.4f}") if sampled else ("-", "-")
        out.append(
            f"delivered_fraction {fraction} ({reached} of {sampled} sampled tokens of trained calls); "
            f"{one} keeping one chain per episode"
        )
        out.append(grade_line(self.grades))
        out += [f"breaks: {reason}: {n}" for reason, n in self.breaks.most_common()]
        if self.empty_sessions:
            out.append("sessions without calls (harness not using the proxy?): " + ", ".join(self.empty_sessions[:20]))
        return out


def summarise(
    reports: list[SessionReport],
    rewards: dict[str, float | None],
    edges: Counter[str] | None = None,
    delivered: tuple[int, int, int] = (0, 0, 0),
    grades: Counter[str] | None = None,
) -> RunSummary:
    given = [r for r in rewards.values() if r is not None]
    return RunSummary(
        sessions=len(reports),
        empty_sessions=[r.session_id for r in reports if r.calls == 0],
        calls=sum(r.calls for r in reports),
        sequences=sum(len(r.sequences) for r in reports),
        merged_tokens=sum(r.tokens for r in reports),
        unmerged_tokens=sum(r.unmerged_tokens for r in reports),
        breaks=Counter(b.reason for r in reports for b in r.breaks),
        skipped=sum(len(r.skipped) for r in reports),
        mean_reward=sum(given) / len(given) if given else None,
        edges=edges or Counter(),
        delivered=delivered,
        grades=grades or Counter(),
    )
