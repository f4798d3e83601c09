"""Finished GRPO groups read back from the store as training samples, and what a checkpoint
holds besides the weights (`LoopState`).

A group is rebuilt into token-exact sequences (recorder.trajectories). An episode whose harness
crashed or timed out is scored `failure_reward` (a policy that hangs or loops is penalised, as
evaluation counts it a failure); one the proxy or vLLM failed (a call answered 5xx), or with no
call or no reward (the verifier failed), is dropped, each counted. Episodes sampled more than
`max_staleness` optimizer steps ago are dropped and counted; a group left with fewer than two
scored episodes, or whose rewards are all equal (no signal), is skipped and counted; groups that
keep coming back without one scored episode stop the run by name.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from recorder.records import SessionInfo
from recorder.store import Store
from recorder.trajectories import TrainingSequence, build_sequences
from trainer.config import TrainConfig
from trainer.grpo import Sample, advantages

FAILING_GROUPS = 3
# vLLM's sampling settings that shape the distribution its logprobs come from, at their neutral values.
NEUTRAL_SAMPLING: dict[str, Any] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0,
}  # fmt: skip

# Request fields that make vLLM sample under a grammar unless they are absent, "auto", "none" or
# "text" (in any API's shape: Anthropic's tool_choice is {"type": "auto"}).
GRAMMAR = ("tool_choice", "response_format", "structured_outputs")

log = logging.getLogger("rl_proxy.trainer")


class TrainError(RuntimeError):
    """The run cannot go on; the message says why. The last checkpoint is intact."""


@dataclass
class LoopState:
    """What a checkpoint holds besides the weights and the optimizer."""

    step: int = 0
    version: int = 0
    consumed: list[str] = field(default_factory=list)  # groups trained on or discarded
    skipped_equal: int = 0  # groups whose rewards were all equal
    dropped_stale: int = 0  # episodes older than max_staleness
    unscored: int = 0  # episodes with no call, or whose reward could not be computed
    failures_scored: int = 0  # harness crashes and timeouts, scored failure_reward
    dropped_infra: int = 0  # episodes the proxy or vLLM failed
    refused_sampling: int = 0  # episodes sampled with settings the trainer does not score at
    samples: int = 0
    tokens: int = 0
    version_steps: dict[str, int] = field(default_factory=dict)  # policy version: the step that made it

    def made_at(self, version: str | None) -> int:
        """The optimizer step whose weights a policy version is (staleness counts steps, not swaps)."""
        return self.version_steps.get(str(version), version_number(version))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> LoopState:
        return cls(**json.loads(path.read_text()))


def continued(sequences: list[TrainingSequence]) -> list[TrainingSequence]:
    """The sequences of the choices the episode went on with. A call with several choices (n > 1)
    forks its chain, and only the choice a later call continued (or, at the episode's end, the
    first) produced the outcome the episode's reward is for: the other branches are dropped."""
    chosen = {span.seq: span.choice for q in sequences for span in q.spans[:-1]}  # followed by a later call
    return [q for q in sequences if all(span.choice == chosen.get(span.seq, 0) for span in q.spans)]


def version_number(version: str | None) -> int:
    return int(version) if version is not None and version.isdigit() else 0


def episode_reward(session: SessionInfo, calls: list[Any], failure_reward: float) -> tuple[float | None, str]:
    """The reward an episode is trained with (None: dropped) and why it is not its own: "infra"
    (the proxy or vLLM failed a call), "failed" (the harness crashed or timed out: scored
    `failure_reward`), "unscored" (no reward), or "" (it is the session's reward)."""
    if any(c.http_status >= 500 for c in calls):
        return None, "infra"
    harness = (session.metadata.get("outcome") or {}).get("status")
    if session.status in ("failed", "timeout") and harness in ("failed", "timeout"):
        return failure_reward, "failed"
    if session.status != "ok" or session.reward is None:
        return None, "unscored"
    return float(session.reward), ""


class GroupReader:
    """Samples with their advantages from finished groups; counts what it leaves out in `state`."""

    def __init__(
        self,
        config: TrainConfig,
        store: Store,
        state: LoopState,
        scale_rewards: Any,
        temperature: float = 1.0,
        defaults: dict[str, Any] | None = None,
    ) -> None:
        """`temperature` is the one the trainer scores tokens at; `defaults` the sampling settings
        vLLM applies where a request names none (the model's generation_config.json)."""
        self.config, self.cfg, self.store, self.state = config, config.train, store, state
        self.scale_rewards = scale_rewards  # TRL's scale_rewards: "group", "batch", "none" (or a bool)
        self.temperature = temperature
        self.defaults = {**NEUTRAL_SAMPLING, **{k: v for k, v in (defaults or {}).items() if k in NEUTRAL_SAMPLING}}
        self.failing = 0  # groups in a row without one scored episode
        self.refused: str | None = None  # why the last episode refused for its sampling settings was

    async def leftovers(self) -> list[str]:
        """Groups finished before a restart and not yet trained on (resume)."""
        sessions = await self.store.list_sessions(run=self.config.run)
        groups: dict[str, list[SessionInfo]] = defaultdict(list)
        for s in sessions:
            if s.group_id:
                groups[s.group_id].append(s)
        consumed = set(self.state.consumed)
        n = self.config.episodes_per_task
        finished = [g for g, members in groups.items() if len(members) == n and all(s.ended_at for s in members)]
        return [g for g in finished if g not in consumed]

    async def prepare(self, group: str) -> tuple[list[Sample], list[float], list[int]] | None:
        """A group's samples with their advantages, or None (counted) if it cannot be used."""
        self.state.consumed.append(group)
        sessions = await self.store.list_sessions(group_id=group)
        kept: list[tuple[float, list[Any], int]] = []
        scored = 0
        for s in sessions:
            calls = [c async for c in self.store.iter_calls(s.id)]
            reward = self.reward(s, calls)
            if reward is None:
                continue
            refused = self.sampling_refused(calls)
            if refused is not None:
                self.state.refused_sampling += 1
                if refused != self.refused:
                    log.warning("episodes left out of training: %s", refused)
                self.refused = refused
                continue
            scored += 1
            report = build_sequences(calls, s)  # per-call rewards are not used by GRPO here
            sequences = continued([q for q in report.sequences if q.sampled_tokens])
            if not sequences:
                self.state.unscored += 1
                continue
            versions = {span.version for q in sequences for span in q.spans}
            lag = self.state.step - min(self.state.made_at(v) for v in versions)
            # A version newer than the serving one was made after the checkpoint a run resumed
            # from: weights that no longer exist.
            if lag > self.cfg.max_staleness or any(version_number(v) > self.state.version for v in versions):
                self.state.dropped_stale += 1
                continue
            kept.append((reward, sequences, lag))
        self.check_failing(sessions, scored)
        rewards = [reward for reward, _, _ in kept]
        if len(kept) < 2 or max(rewards) == min(rewards):
            self.state.skipped_equal += len(kept) >= 2
            return None
        by_group = self.scale_rewards in ("group", True)
        values = advantages(rewards, "group" if by_group else "none", self.cfg.baseline)
        samples = [Sample(q, a) for (_, sequences, _), a in zip(kept, values, strict=True) for q in sequences]
        return samples, rewards, [lag for _, _, lag in kept]

    def reward(self, session: SessionInfo, calls: list[Any]) -> float | None:
        """The episode's reward to train on, or None (counted) if it is dropped."""
        reward, why = episode_reward(session, calls, self.cfg.failure_reward)
        if why == "infra":
            self.state.dropped_infra += 1
        elif why == "failed":
            self.state.failures_scored += 1
        elif why == "unscored":
            self.state.unscored += 1
        return reward

    def sampling_refused(self, calls: list[Any]) -> str | None:
        """Why an episode's calls cannot be trained on as sampled, if they cannot: vLLM records
        the logprobs of the distribution it sampled from (after temperature, top-p, top-k,
        penalties), and the trainer scores its tokens at one temperature, untruncated."""
        for call in calls:
            # What the upstream was sent: the request, or what the proxy set instead (a session's sampling).
            sent = {
                k: call.rewrites[k][1] if k in call.rewrites else call.request.get(k)
                for k in (*NEUTRAL_SAMPLING, *GRAMMAR)
            }
            used = {k: self.defaults[k] if sent[k] is None else sent[k] for k in NEUTRAL_SAMPLING}
            if abs(float(used["temperature"]) - self.temperature) > 1e-6:
                return (f"call {call.seq} sampled at temperature {used['temperature']}, and the trainer scores at "
                        f"{self.temperature} (grpo.temperature)")  # fmt: skip
            changed = [f"{k} {v}" for k, v in used.items()
                       if k != "temperature" and v != NEUTRAL_SAMPLING[k] and (k, v) != ("top_k", 0)]  # fmt: skip
            # A grammar masks the vocabulary as truncation does (a forced tool call, a JSON schema).
            for k in GRAMMAR:
                kind = sent[k].get("type", sent[k]) if isinstance(sent[k], dict) else sent[k]
                if kind not in (None, "auto", "none", "text"):
                    changed.append(f"{k} {sent[k]!r}")
            if changed and not self.cfg.allow_truncated_sampling:
                return (f"call {call.seq} sampled with {', '.join(changed)}: the trainer scores the whole "
                        "distribution (train.allow_truncated_sampling accepts such calls)")  # fmt: skip
        return None

    def check_failing(self, sessions: list[SessionInfo], scored: int) -> None:
        """Stop, naming the cause, when groups keep coming back without one scored episode
        (vLLM gone, a harness that cannot start): training could never go on."""
        if scored:
            self.failing = 0
            return
        self.failing += 1
        if self.failing >= FAILING_GROUPS:
            errors = [s.metadata.get("outcome", {}).get("error") or s.status for s in sessions]
            refused = f"; refused for sampling settings: {self.refused}" if self.refused else ""
            raise TrainError(f"{self.failing} groups in a row without one scored episode; the last: {errors[-1:]}"
                             + refused)  # fmt: skip
