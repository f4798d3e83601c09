"""Finished GRPO groups read back from the store as training samples, and what a checkpoint
holds besides the weights (`LoopState`).

A group is rebuilt into token-exact sequences (recorder.trajectories). Each episode's reward and
the group's advantages come from the run's rule (recorder/episodes.py, which the rollouts and the
viewer use too): an episode whose harness crashed or timed out is scored `failure_reward` (a
policy that hangs or loops is penalised, as evaluation counts it a failure); one the proxy or
vLLM failed (a call answered 5xx), with no call or no reward (the verifier failed), or a session
that joined the group by its key rather than from the runner, is dropped, each counted; so is
an episode sampled with settings the trainer cannot score at. Episodes sampled more than
`max_staleness` optimizer steps ago are dropped and counted; a group left with fewer than two
scored episodes, or whose rewards are all equal (no signal), is skipped and counted; groups that
keep coming back without one scored episode stop the run by name, and so do
`max_groups_without_signal` scored groups in a row with nothing to train. What was done with each
group is stored (`Store.save_group`), and so are the run's rule and settings.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from recorder.episodes import EpisodeReward, RewardRule, Why, group_advantages
from recorder.records import CallRecord, SessionInfo
from recorder.store import Store
from recorder.trajectories import TrainingSequence
from recorder.validation import check
from trainer.config import TrainConfig, TrainSection
from trainer.sample import Sample

FAILING_GROUPS = 3
# vLLM's sampling settings that shape the distribution its logprobs come from, at their neutral values.
NEUTRAL_SAMPLING: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}

# Request fields that make vLLM sample under a grammar unless they are absent, "auto", "none" or
# "text" (in any API's shape: Anthropic's tool_choice is {"type": "auto"}; a Responses request's
# `text.format` is its response_format).
GRAMMAR = ("tool_choice", "response_format", "structured_outputs")
# vLLM's Chat Completions and Completions fields that change the distribution a token is sampled
# from (bias, masks, forced ends, beams, watermarks, custom logits processors) when set to
# anything but their empty default. The Messages route drops them (anthropic.CHAT_FIELDS) and
# litellm's Responses translation does not pass them.
RESHAPING = (
    "logit_bias",
    "min_tokens",
    "allowed_token_ids",
    "bad_words",
    "thinking_token_budget",
    "vllm_xargs",
    "use_beam_search",
    "watermarking",
    "logits_processors",
)

# Reasons an episode has no reward at all, as against one the trainer dropped after scoring it.
# An episode with nothing to train ("empty": every call aux, say) is one too: a run of only those
# would make groups forever without a step.
DROPPED_BEFORE_SCORING = ("infra", "unscored", "foreign", "sampling", "capture", "empty")

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
    no_success: int = 0  # groups a warm-start step passed over: no episode succeeded
    dropped_stale: int = 0  # episodes older than max_staleness
    unscored: int = 0  # episodes with no call, or whose reward could not be computed
    foreign: int = 0  # sessions that joined a group by their key, not from the runner
    failures_scored: int = 0  # harness crashes and timeouts, scored failure_reward
    dropped_infra: int = 0  # episodes the proxy or vLLM failed
    refused_sampling: int = 0  # episodes sampled with settings the trainer does not score at
    capture_fatal: int = 0  # episodes whose records cannot be trusted (recorder/validation.py: FATAL)
    samples: int = 0
    tokens: int = 0
    version_steps: dict[str, int] = field(default_factory=dict)  # policy version: the step that made it
    curriculum: dict[str, list[bool]] = field(default_factory=dict)  # a task: its recent successes (Curriculum)

    def made_at(self, version: str | None) -> int:
        """The optimizer step whose weights a policy version is (staleness counts steps, not swaps)."""
        return self.version_steps.get(str(version), version_number(version))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> LoopState:
        return cls(**json.loads(path.read_text()))


def trained_sequences(
    calls: list[CallRecord], session: SessionInfo, min_calls: int
) -> tuple[str | None, list[TrainingSequence], list[CallRecord]]:
    """An episode's sequences as the trainer trains them (the session graph's trained ones,
    recorder/graph.py: aux calls, a superseded retry and the choices the episode did not go on
    with left out), or what makes its capture FATAL; and the calls they are made of (only those decide
    whether the episode can be trained on as sampled: `sampling_refused`)."""
    checked = check(calls, session, min_calls)
    trained = [c for c in calls if c.seq in checked.graph.trained_calls]
    if checked.grade.level == "FATAL":
        return checked.grade.problems[0], [], trained
    return None, [q for q in checked.sequences if q.sampled_tokens], trained


def version_number(version: str | None) -> int:
    return int(version) if version is not None and version.isdigit() else 0


def reward_rule(train: TrainSection, scale_rewards: str) -> RewardRule:
    """The run's reward rule (recorder/episodes.py) from its config and TRL's scale_rewards."""
    return RewardRule(failure_reward=train.failure_reward, baseline=train.baseline, scale=scale_rewards)  # type: ignore[arg-type]


def sampling_refused(calls: list[CallRecord], settings: dict[str, Any]) -> str | None:
    """Why an episode's calls cannot be trained on as sampled, if they cannot: vLLM records the
    logprobs of the distribution it sampled from (after temperature, top-p, top-k, penalties,
    a grammar), and the trainer scores its tokens at one temperature, untruncated. `settings`
    are a run's (`GroupReader.settings`): the temperature it scores at, vLLM's defaults where a
    request names none, and whether truncated sampling is allowed."""
    temperature, allow = settings["temperature"], settings["allow_truncated_sampling"]
    defaults = {**NEUTRAL_SAMPLING, **{k: v for k, v in settings["defaults"].items() if k in NEUTRAL_SAMPLING}}
    for call in calls:
        # What the upstream was sent: the request, or what the proxy set instead (a session's sampling).
        request = call.request
        if call.api == "openai.responses":  # its text.format is what goes upstream as response_format
            request = {**request, "response_format": (request.get("text") or {}).get("format")}
        sent: dict[str, Any] = {
            k: call.rewrites[k][1] if k in call.rewrites else request.get(k)
            for k in (*NEUTRAL_SAMPLING, *GRAMMAR, *RESHAPING)
        }
        used = {k: defaults[k] if sent[k] is None else sent[k] for k in NEUTRAL_SAMPLING}
        if abs(float(used["temperature"]) - temperature) > 1e-6:
            return (
                f"call {call.seq} sampled at temperature {used['temperature']}, and the trainer scores at "
                f"{temperature} (grpo.temperature)"
            )
        changed = [
            f"{k} {v}"
            for k, v in used.items()
            if k != "temperature" and v != NEUTRAL_SAMPLING[k] and (k, v) != ("top_k", 0)
        ]
        # A grammar masks the vocabulary as truncation does (a forced tool call, a JSON schema).
        for k in GRAMMAR:
            kind = sent[k].get("type", sent[k]) if isinstance(sent[k], dict) else sent[k]
            if kind not in (None, "auto", "none", "text"):
                changed.append(f"{k} {sent[k]!r}")
        changed += [f"{k} {sent[k]!r}" for k in RESHAPING if sent[k] not in (None, False, 0, [], {})]
        if changed and not allow:
            return (
                f"call {call.seq} sampled with {', '.join(changed)}: the trainer scores the whole "
                "distribution (train.allow_truncated_sampling accepts such calls)"
            )
    return None


class GroupReader:
    """Samples with their advantages from finished groups; counts what it leaves out in `state`
    and stores what it did with each group (the viewer shows it)."""

    def __init__(
        self,
        config: TrainConfig,
        store: Store,
        state: LoopState,
        rule: RewardRule,
        temperature: float = 1.0,
        defaults: dict[str, Any] | None = None,
    ) -> None:
        """`temperature` is the one the trainer scores tokens at; `defaults` the sampling settings
        vLLM applies where a request names none (the model's generation_config.json)."""
        self.config, self.cfg, self.store, self.state, self.rule = config, config.train, store, state, rule
        self.settings = {
            "temperature": temperature,
            "defaults": {k: v for k, v in (defaults or {}).items() if k in NEUTRAL_SAMPLING},
            "allow_truncated_sampling": self.cfg.allow_truncated_sampling,
            "max_staleness": self.cfg.max_staleness,
            "min_calls": self.cfg.min_calls,
            "warm_start": self.cfg.warm_start,  # the steps that were supervised (the viewer says so)
        }
        self.failing = 0  # groups in a row without one scored episode
        self.without_signal = 0  # groups in a row with scored episodes and nothing to train
        self.last_rewards: list[float | None] = []  # the last group's (None: left out), for a progress line
        self.refused: str | None = None  # why the last episode refused for its sampling settings was
        self.fatal: str | None = None  # what made the last episode left out for its capture FATAL

    async def save_run(self) -> None:
        """Store the run's rule and settings, for the viewer."""
        await self.store.save_run(self.config.run, self.rule, self.settings)

    async def leftovers(self) -> list[str]:
        """Groups finished before a restart and not yet trained on (resume): every episode of
        the group ended by the runner (a session that joined the group by its key is no episode,
        and an attempt that an infrastructure fault ended, "ended", is none either: the episode
        it was is its replacement's, which may not have ended)."""
        sessions = await self.store.list_sessions(run=self.config.run)
        groups: dict[str, list[SessionInfo]] = defaultdict(list)
        for s in sessions:
            if s.group_id and s.outcome is not None and s.status != "ended":
                groups[s.group_id].append(s)
        consumed = set(self.state.consumed)
        n = self.config.episodes_per_task
        return [g for g, members in groups.items() if len(members) >= n and g not in consumed]

    async def prepare(self, group: str, supervised: bool = False) -> tuple[list[Sample], list[float], list[int]] | None:
        """A group's samples with their advantages, or None (counted) if it cannot be used. For a
        `supervised` step (the warm start) its successful episodes, each of weight 1, whatever
        the others' rewards; None if none succeeded."""
        self.state.consumed.append(group)
        sessions = await self.store.list_sessions(group_id=group)
        rows: list[tuple[SessionInfo, float | None, Why, list[TrainingSequence], int]] = []
        for s in sessions:
            scored = s.training_reward(self.rule)
            reward, why = scored.value, scored.why
            sequences: list[TrainingSequence] = []
            lag = 0
            if reward is not None:
                calls = [c async for c in self.store.iter_calls(s.id)]
                # placing a session is pure CPU work: off the loop that serves the proxy's calls
                fatal, sequences, trained = await asyncio.to_thread(trained_sequences, calls, s, self.cfg.min_calls)
                refused = sampling_refused(trained, self.settings)
                if refused is not None:
                    if refused != self.refused:
                        log.warning("episodes left out of training: %s", refused)
                    self.refused = refused
                    reward, why, sequences = None, "sampling", []
                elif fatal is not None:
                    log.warning("episode %s left out of training: %s", s.id, fatal)
                    reward, why, self.fatal = None, "capture", fatal
                else:
                    reward, why, lag = self.fresh(reward, why, sequences)
            elif why == "foreign":
                log.warning("group %s: session %r joined it by its key, not from the runner: left out", group, s.id)
            self.count(why)
            rows.append((s, reward, why, sequences, lag))
        self.last_rewards = [reward for _, reward, *_ in rows]
        self.check_failing(sessions, [why for _, _, why, _, _ in rows])
        values = group_advantages([reward for _, reward, _, _, _ in rows], self.rule)
        if supervised:
            values = [
                1.0 if reward is not None and reward >= self.config.success_at else None for _, reward, *_ in rows
            ]
        shown = [
            [s.id, reward, None if values is None else values[i], why] for i, (s, reward, why, _, _) in enumerate(rows)
        ]
        await self.store.save_group(group, self.config.run, self.state.step, shown)
        if values is None or all(a is None for a in values):
            given = [reward for _, reward, *_ in rows if reward is not None]
            equal = values is None and len(given) >= 2
            self.state.skipped_equal += equal
            self.state.no_success += supervised
            if equal or supervised:
                self.check_signal(given, supervised)
            return None
        self.without_signal = 0
        kept = [(row, a) for row, a in zip(rows, values, strict=True) if a is not None and row[1] is not None]
        samples = [Sample(q, a) for (_, _, _, sequences, _), a in kept for q in sequences]
        return samples, [reward for (_, reward, *_), _ in kept if reward is not None], [row[4] for row, _ in kept]

    def fresh(self, reward: float, why: Why, sequences: list[TrainingSequence]) -> tuple[float | None, Why, int]:
        """(reward, why, staleness) of an episode's sequences: none to train ("empty"), or sampled
        more than `max_staleness` optimizer steps ago ("stale")."""
        if not sequences:
            return None, "empty", 0
        versions = {span.version for q in sequences for span in q.spans}
        lag = self.state.step - min(self.state.made_at(v) for v in versions)
        # A version newer than the serving one was made after the checkpoint a run resumed
        # from: weights that no longer exist.
        if lag > self.cfg.max_staleness or any(version_number(v) > self.state.version for v in versions):
            return None, "stale", lag
        return reward, why, lag

    def count(self, why: Why) -> None:
        counter = {
            "infra": "dropped_infra",
            "failed": "failures_scored",
            "unscored": "unscored",
            "empty": "unscored",
            "foreign": "foreign",
            "sampling": "refused_sampling",
            "stale": "dropped_stale",
            "capture": "capture_fatal",
        }.get(why)
        if counter is not None:
            setattr(self.state, counter, getattr(self.state, counter) + 1)

    def check_signal(self, rewards: list[float], supervised: bool) -> None:
        """Stop, saying why, when `max_groups_without_signal` groups in a row were scored and gave
        nothing to train (equal rewards; in a warm start, no success): a policy that solves none of
        the tasks, or all, would make such groups forever (as DAPO's dynamic sampling stops after
        `max_num_gen_batches`)."""
        self.without_signal += 1
        if self.without_signal < self.cfg.max_groups_without_signal:
            return
        what = "a success to imitate (warm start)" if supervised else "rewards that differ"
        raise TrainError(
            f"{self.without_signal} groups in a row without {what}: nothing to train (the last group's "
            f"rewards: {rewards}). The policy scores the same on every task tried: start from a model that "
            "solves some of them, give easier tasks, or warm-start on successes (train.warm_start_from); "
            "train.max_groups_without_signal sets how many such groups are waited for"
        )

    def check_failing(self, sessions: list[SessionInfo], whys: list[Why]) -> None:
        """Stop, naming the cause, when groups keep coming back without one scored episode
        (vLLM gone, a harness that cannot start, episodes with nothing to train): training could
        never go on."""
        if any(why not in DROPPED_BEFORE_SCORING for why in whys):
            self.failing = 0
            return
        self.failing += 1
        if self.failing >= FAILING_GROUPS:
            errors = [(s.outcome.error if s.outcome else None) or s.status for s in sessions]
            refused = f"; refused for sampling settings: {self.refused}" if self.refused else ""
            fatal = f"; left out for its capture: {self.fatal}" if "capture" in whys else ""
            empty = "; episodes with nothing to train" if "empty" in whys else ""
            raise TrainError(
                f"{self.failing} groups in a row without one scored episode; the last: {errors[-1:]}"
                + refused
                + fatal
                + empty
            )


async def successes(
    store: Store, rule: RewardRule, success_at: float, min_calls: int, heldout: set[str], vocab: int
) -> list[list[TrainingSequence]]:
    """The trained sequences of every successful episode in a store (a collect run's, a user's
    own), for the warm start: as the trainer builds them, FATAL captures and the `heldout`
    tasks' episodes left out. A token id the model does not have (`vocab` ids) is an error:
    the store was recorded with another model."""
    found = []
    for s in await store.list_sessions(min_reward=success_at):
        reward = s.training_reward(rule).value
        if reward is None or reward < success_at or s.task_id in heldout:
            continue
        calls = [c async for c in store.iter_calls(s.id)]
        fatal, sequences, _ = trained_sequences(calls, s, min_calls)
        if fatal is None and sequences:
            top = max(max(q.input_ids) for q in sequences)
            if top >= vocab:
                raise TrainError(
                    f"episode {s.id} holds token id {top}, and the model's vocabulary has {vocab}: "
                    "its store was recorded with another model"
                )
            found.append(sequences)
    return found


@dataclass(frozen=True)
class GroupView:
    """A group as the trainer took it (`step`: the optimizer step that took it), or, before any
    trainer took it, as it would train under its run's stored rule and settings (`step` None;
    staleness, which depends on when it is taken, is not judged then)."""

    episodes: list[tuple[SessionInfo, float | None, float | None, Why]]  # session, reward, advantage, why
    step: int | None
    rule: RewardRule
    supervised: bool = False  # taken by a warm-start step: its successes trained with weight 1

    @property
    def trained(self) -> bool:
        return any(advantage is not None for _, _, advantage, _ in self.episodes)


async def group_view(store: Store, group: str) -> GroupView | None:
    """How the trainer treats `group` (None: no such group), for the viewer."""
    sessions = await store.list_sessions(group_id=group)
    if not sessions:
        return None
    found = await store.run_settings(sessions[0].run) if sessions[0].run else None
    rule, settings = found or (RewardRule(), {"temperature": 1.0, "defaults": {}, "allow_truncated_sampling": False})
    taken = await store.trained_group(group)
    if taken is None:
        return await would_train(store, sessions, rule, settings)
    by_id = {s.id: s for s in sessions}
    episodes = [(by_id[i], reward, a, why) for i, reward, a, why in taken[1] if i in by_id]
    return GroupView(episodes, taken[0], rule, taken[0] < settings.get("warm_start", 0))


async def would_train(
    store: Store, sessions: list[SessionInfo], rule: RewardRule, settings: dict[str, Any]
) -> GroupView:
    """A group's episodes as a trainer with this rule and these settings would take them now
    (staleness aside, which depends on the step that takes them)."""
    scored: list[tuple[SessionInfo, float | None, Why]] = []
    for s in sessions:
        episode = s.training_reward(rule)
        if episode.value is not None:
            calls = [c async for c in store.iter_calls(s.id)]
            fatal, sequences, trained = trained_sequences(calls, s, settings.get("min_calls", 1))
            if sampling_refused(trained, settings):
                episode = EpisodeReward(None, "sampling")
            elif fatal is not None:
                episode = EpisodeReward(None, "capture")
            elif not sequences:
                episode = EpisodeReward(None, "empty")
        scored.append((s, episode.value, episode.why))
    values = group_advantages([reward for _, reward, _ in scored], rule) or [None] * len(scored)
    return GroupView([(s, reward, a, why) for (s, reward, why), a in zip(scored, values, strict=True)], None, rule)
