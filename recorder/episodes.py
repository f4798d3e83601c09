"""What an episode is, and the one rule that turns episodes into training rewards and a group's
advantages.

An episode is a session that a harness runner created, ran and ended: its `status` (a
`SessionStatus`), the `EpisodeOutcome` the runner wrote when it ended it (how the harness ran, the
reward and its parts) and the `Sampling` the proxy forced on its calls. These are the session's
own typed fields, stored in columns of their own: a client's key labels and `metadata` can never
write them. The rewards and advantages the trainer trains with, the rollout reward it reports
and the advantages the viewer shows all come from `episode_reward` and `group_advantages`, with
the run's `RewardRule`.

The trainer's own checks (sampling settings it cannot score, staleness) live with the trainer;
what they drop is left out of `group_advantages` like any other unscored episode.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# "active" until ended; "ended" by a client; an episode's own status when its runner ends it.
SessionStatus = Literal["active", "ended", "ok", "failed", "timeout", "no_calls"]
EndStatus = Literal["ended", "ok", "failed", "timeout", "no_calls"]
EpisodeStatus = Literal["ok", "failed", "timeout", "no_calls"]
HarnessStatus = Literal["ok", "failed", "timeout"]
# Why an episode does not train with its own reward: "" (it does), "failed" (the harness crashed
# or timed out: scored the run's failure_reward), "infra" (the proxy or vLLM failed a call),
# "unscored" (no reward), "foreign" (no runner ended it: a session that joined the group by its
# key), and the trainer's "sampling", "empty" and "stale".
Why = Literal["", "failed", "infra", "unscored", "foreign", "sampling", "empty", "stale", "capture"]


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RewardPart(Record):
    source: str = Field(max_length=64)
    value: float


class EpisodeOutcome(Record):
    """How an episode went, as its runner ends it (`POST /admin/sessions/{id}/end`)."""

    harness: HarnessStatus  # how the harness's own run ended
    error: str | None = None  # why the episode is not "ok", if it is not
    output: str = ""  # its final answer, or the end of its stdout
    exit_code: int | None = Field(None, ge=-(2**31), le=2**31 - 1)
    log: str | None = None  # path of the harness's log
    seconds: float = 0.0
    reward: float | None = None  # the sum of `parts`; None: not scored
    parts: tuple[RewardPart, ...] = ()


class Sampling(Record):
    """Sampling settings the proxy sets on every call of a session, whatever the harness asks
    (an evaluation at temperature 0 through an unchanged harness, say)."""

    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # what the store's JSON can hold
    # Set only on calls that offer tools: "required" makes a model that never calls one (a small
    # model in Claude Code or Codex) call one on every turn, its arguments sampled under a grammar.
    # Any other value is a tool's name, forced on the calls that offer that tool and no other
    # (Claude Code's "Agent": the main loop starts a subagent, whose own calls go unforced).
    tool_choice: Literal["auto", "required", "none"] | Annotated[str, Field(pattern=r"^[\w.:-]{1,64}$")] | None = None


class RewardRule(Record):
    """A run's settings that decide its rewards and advantages; stored with the run."""

    failure_reward: float = 0.0
    baseline: Literal["mean", "leave_one_out"] = "mean"
    scale: Literal["group", "batch", "none"] = "group"  # TRL's scale_rewards


@dataclass(frozen=True)
class EpisodeReward:
    value: float | None  # None: not trained
    why: Why


def episode_reward(
    status: SessionStatus,
    outcome: EpisodeOutcome | None,
    reward: float | None,
    upstream_failures: int,
    rule: RewardRule,
) -> EpisodeReward:
    """The reward an episode trains with, from its session's fields (`reward`: the sum posted for
    the session; `upstream_failures`: its calls answered 5xx)."""
    if outcome is None:
        return EpisodeReward(None, "foreign")
    if upstream_failures:
        return EpisodeReward(None, "infra")
    if status in ("failed", "timeout") and outcome.harness in ("failed", "timeout"):
        return EpisodeReward(rule.failure_reward, "failed")
    if status != "ok" or reward is None:
        return EpisodeReward(None, "unscored")
    return EpisodeReward(float(reward), "")


def advantages(rewards: Sequence[float], scale: str = "group", baseline: str = "mean") -> list[float]:
    """Group-relative advantages: reward minus the group's mean (or, with `leave_one_out`, the
    mean of the others), divided by the group's standard deviation when `scale` is "group"
    (TRL's `scale_rewards`; "batch" is applied across groups by the training loop)."""
    n = len(rewards)
    mean = statistics.fmean(rewards)
    centred = [r - mean for r in rewards]
    if baseline == "leave_one_out":
        centred = [c * n / (n - 1) for c in centred]
    if scale == "group":
        std = statistics.stdev(rewards) if n > 1 else 0.0
        centred = [c / (std + 1e-4) for c in centred]
    return centred


def group_advantages(rewards: Sequence[float | None], rule: RewardRule) -> list[float | None] | None:
    """Each episode's advantage (None for one not trained), or None when the group teaches
    nothing: fewer than two trained episodes, or all their rewards equal."""
    kept = [r for r in rewards if r is not None]
    if len(kept) < 2 or max(kept) == min(kept):
        return None
    values = iter(advantages(kept, "group" if rule.scale == "group" else "none", rule.baseline))
    return [None if r is None else next(values) for r in rewards]
