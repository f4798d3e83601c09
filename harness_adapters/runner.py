"""Run episodes: N per task, at most `concurrency` at a time, each in its own session and
workdir, then scored and closed. Talks to the proxy only through its admin API, so the proxy
may be in this process or anywhere else.

Each episode: create a session (`run`, `task_id`, `group_id` = run/task: the GRPO group) ->
start its environment (harness_adapters/environments/: a container for a Harbor task) ->
run the harness -> count its calls (none: reported as "no_calls", by name, and never scored:
the harness ignored the proxy's address) -> score it (a Harbor task's tests, each named reward
they wrote posted as "tests.<name>"; then each reward source posted under its name) -> remove
the environment -> end the session with its status and its typed outcome (recorder/episodes.py), through
the typed admin client (proxy/admin_client.py).

A Harbor task's tests score its container however the harness ended (its exit code, an error,
its timeout), as Harbor does: a harness that fixed the bug and then exited 1 solved the task.
The harness's own status stays in the outcome beside the reward. Without tests, only a harness
that ended well is scored; one that failed trains with the run's failure reward.

A fault of the infrastructure (the container engine, a lost Ray node, an error of our own) is
never the agent's: the attempt's session is ended as "ended" with the error ("infra: ...",
"lost: ..."), which never trains, and the episode runs again under a new session in the same
group (metadata `replaces`), up to `attempts` times.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from harness_adapters.environments import Box, BuildError, ContainerError, Environment, HostEnvironment, TestsError
from harness_adapters.harnesses import Adapter, Endpoint, Outcome
from harness_adapters.rewards import RewardError, RewardSource, weighted
from harness_adapters.tasks import Task
from proxy.admin_client import AdminClient
from recorder import SessionInfo
from recorder.episodes import EpisodeOutcome, EpisodeStatus, RewardPart, Sampling

log = logging.getLogger("rl_proxy.runner")
INFRA = "infra: "  # how the error of an attempt ended by an infrastructure fault starts
LOST = "lost: "  # the same, for an attempt whose Ray node or worker was lost
BUILD_FAILED = INFRA + "the task's image did not build: "  # not run again: it would fail alike


@dataclass
class EpisodeResult:
    task: Task
    episode: int
    session: SessionInfo  # as ended: its status, outcome, reward and calls
    outcome: Outcome  # what the harness did
    node: str | None = None  # the Ray node it ran on (None: this process)
    retried: list[dict[str, str | None]] = field(default_factory=list)  # earlier attempts: session and error

    @property
    def session_id(self) -> str:
        return self.session.id

    @property
    def status(self) -> EpisodeStatus | Literal["ended"]:
        """The episode's status; "ended" for an attempt that an infrastructure fault ended."""
        return self.session.status  # type: ignore[return-value]  # an episode's session ends with one

    @property
    def infra(self) -> bool:
        """Ended by an infrastructure fault (never trained)."""
        return self.session.status == "ended"

    @property
    def calls(self) -> int:
        return self.session.calls

    @property
    def reward(self) -> float | None:
        """The episode's score (None: not scored)."""
        return None if self.session.outcome is None else self.session.outcome.reward

    @property
    def error(self) -> str | None:
        return None if self.session.outcome is None else self.session.outcome.error

    def success(self, at: float) -> bool:
        return self.status == "ok" and self.reward is not None and self.reward >= at

    def as_json(self) -> dict[str, Any]:
        return {
            "task_id": self.task.id,
            "episode": self.episode,
            "session_id": self.session_id,
            "status": self.status,
            "reward": self.reward,
            "calls": self.calls,
            "error": self.error,
            "node": self.node,
            "outcome": self.outcome.as_json(),
            "retried": self.retried,
        }


class Engine(Protocol):
    """Where an open session's episode runs when not in this process (harness_adapters/engines.py:
    a Ray task); chosen above the runner (`collect`, `train`) and handed to it."""

    async def play(
        self, runner: EpisodeRunner, admin: AdminClient, session: SessionInfo, task: Task, n: int
    ) -> EpisodeResult: ...

    def describe(self) -> str: ...


@dataclass
class EpisodeRunner:
    proxy_url: str
    adapter: Adapter
    rewards: list[RewardSource]
    model: str
    workdir: Path
    run: str
    timeout: float = 600.0
    concurrency: int = 4
    admin_token: str | None = None
    sampling: Sampling | None = None  # set by the proxy on every call, whatever the harness asks
    environment: Environment = field(default_factory=HostEnvironment)
    engine: Engine | None = None  # None: every episode runs in this process
    attempts: int = 3  # runs of an episode that infrastructure faults ended, the first included

    def admin(self) -> AdminClient:
        """A client of the proxy's admin API (use it in `async with`)."""
        return AdminClient(self.proxy_url, self.admin_token)

    async def run_all(
        self, tasks: list[Task], episodes_per_task: int, done: Callable[[EpisodeResult], None] | None = None
    ) -> list[EpisodeResult]:
        """Every task `episodes_per_task` times; `done` is called as each episode finishes."""
        limit = asyncio.Semaphore(self.concurrency)
        async with self.admin() as admin:

            async def one(task: Task, n: int) -> EpisodeResult:
                async with limit:
                    result = await self.episode(admin, task, n)
                if done is not None:
                    done(result)
                return result

            self.expect([task for task in tasks for _ in range(episodes_per_task)])
            work = [one(task, n) for task in tasks for n in range(episodes_per_task)]
            return list(await asyncio.gather(*work))

    def expect(self, tasks: list[Task]) -> None:
        """The episodes to come, in order (a container environment's warm pool starts on them),
        where they run on this machine."""
        if self.engine is None:
            self.environment.expect(tasks)

    async def episode(self, admin: AdminClient, task: Task, n: int, group: str | None = None) -> EpisodeResult:
        """One episode, in the GRPO group `group` (default: run/task), here or on the engine's
        cluster (harness_adapters/engines.py), run again while infrastructure faults end it."""
        group = group or f"{self.run}/{task.id}"
        replaces, retried = None, list[dict[str, str | None]]()
        for attempt in range(1, self.attempts + 1):
            session = await self.open(admin, task, n, group, replaces)
            try:
                if self.engine is not None:
                    result = await self.engine.play(self, admin, session, task, n)
                else:
                    result = await self.play(admin, session, task, n)
            except Exception as exc:  # our own bug, or a fault nothing above caught: not the agent's
                log.exception("episode %s of task %s: attempt %d failed", n, task.id, attempt)
                error = f"{INFRA}{type(exc).__name__}: {exc}"
                result = await self.end_infra(admin, session, task, n, Outcome("failed", error=error), error)
            if not result.infra or attempt == self.attempts or (result.error or "").startswith(BUILD_FAILED):
                result.retried = retried
                return result
            retried.append({"session_id": session.id, "error": result.error})
            replaces = session.id
        raise AssertionError("unreachable")

    async def end_infra(
        self, admin: AdminClient, session: SessionInfo, task: Task, n: int, outcome: Outcome, error: str
    ) -> EpisodeResult:
        """End an attempt that an infrastructure fault ended: "ended", never trained."""
        record = EpisodeOutcome(harness=outcome.status, error=f"{error} (attempt of episode {n})", log=outcome.log)
        ended = await admin.end_session(session.id, "ended", record)
        return EpisodeResult(task, n, ended, outcome)

    async def open(
        self, admin: AdminClient, task: Task, n: int, group: str, replaces: str | None = None
    ) -> SessionInfo:
        """The episode's session; `replaces`: the session of an attempt that was lost."""
        metadata: dict[str, Any] = {"episode": n} | ({"replaces": replaces} if replaces else {})
        return await admin.create_session(
            run=self.run, task_id=task.id, group_id=group, metadata=metadata, sampling=self.sampling
        )

    async def play(self, admin: AdminClient, session: SessionInfo, task: Task, n: int) -> EpisodeResult:
        """Run the episode of an open session: its environment, harness and rewards; end it."""
        workdir = self.workdir / session.id
        workdir.mkdir(parents=True, exist_ok=True)
        timeout = task.harbor.agent_timeout if task.harbor and task.harbor.agent_timeout else self.timeout
        error, reward, parts = None, None, tuple[RewardPart, ...]()
        outcome = Outcome("failed", error="the environment did not start")
        try:
            async with self.environment.episode(task, workdir, self.proxy_url, session.key) as box:
                # The harness reaches the proxy from where it runs; the reward sources from here.
                endpoint = Endpoint(self.proxy_url, session.key, self.model, session.id)
                inside = replace(endpoint, url=box.proxy_url) if box is not None and box.proxy_url else endpoint
                outcome = await self.adapter.run(task, inside, workdir, timeout, box)
                info = await admin.session(session.id)
                status: EpisodeStatus = outcome.status
                error = outcome.error
                tested = box is not None and task.harbor is not None
                if info.calls == 0:
                    status = "no_calls"
                    error = (
                        "the harness made no call through the proxy (a wrong base URL, or a variable it ignores?)"
                        + (f"; it {outcome.status}: {outcome.error}" if outcome.error else "")
                    )
                elif status == "ok" or tested:  # tests score a container however its harness ended
                    try:
                        parts = await self.score(admin, session.id, task, outcome, endpoint, workdir, info.reward, box)
                        reward, status = sum(part.value for part in parts), "ok"
                    except (RewardError, TestsError) as exc:
                        status, error = ("failed" if outcome.status == "ok" else outcome.status), str(exc)
        except BuildError as exc:  # the task's image does not build: every attempt would fail alike
            return await self.end_infra(admin, session, task, n, outcome, f"{BUILD_FAILED}{exc}")
        except ContainerError as exc:  # the engine failed: not the agent's doing, so never trained
            return await self.end_infra(admin, session, task, n, outcome, f"{INFRA}{exc}")
        record = EpisodeOutcome(
            harness=outcome.status,
            error=error,
            output=outcome.output,
            exit_code=outcome.exit_code,
            log=outcome.log,
            seconds=outcome.seconds,
            reward=reward,
            parts=parts,
        )
        ended = await admin.end_session(session.id, status, record)
        return EpisodeResult(task, n, ended, outcome)

    async def score(
        self,
        admin: AdminClient,
        session_id: str,
        task: Task,
        outcome: Outcome,
        endpoint: Endpoint,
        workdir: Path,
        posted: float | None,
        box: Box | None = None,
    ) -> tuple[RewardPart, ...]:
        """Score with the task's tests and every source first (nothing is posted if one fails),
        then post each part."""
        tests = await box.verify(task) if box is not None else {}
        parts = [(f"tests.{name}" if name != "reward" else "tests", value, True) for name, value in tests.items()]
        for source in self.rewards:
            parts.append(
                (source.type, await weighted(source, task, outcome, endpoint, workdir, posted), not source.stored)
            )
        for i, (source_name, value, post) in enumerate(parts):
            if post:  # its id: posted again (a retry), it still counts once
                await admin.add_reward(session_id, value, source_name, f"runner-{i}")
        return tuple(RewardPart(source=source_name, value=value) for source_name, value, _ in parts)


@dataclass(frozen=True)
class TaskSummary:
    """One task's episodes in a collect run: successes, mean reward, and what went wrong."""

    task: str
    episodes: int
    success: int
    mean_reward: float | None
    failed: int
    timeout: int
    no_calls: int
    infra: int  # ended by infrastructure faults, every attempt: never trained


def summary(results: list[EpisodeResult], success_at: float) -> list[TaskSummary]:
    """One row per task, in the order the tasks first finished."""
    rows = []
    for task_id in dict.fromkeys(r.task.id for r in results):
        mine = [r for r in results if r.task.id == task_id]
        rewards = [r.reward for r in mine if r.reward is not None]
        counts = {status: sum(r.status == status for r in mine) for status in ("failed", "timeout", "no_calls")}
        rows.append(
            TaskSummary(
                task_id,
                len(mine),
                sum(r.success(success_at) for r in mine),
                statistics.fmean(rewards) if rewards else None,
                **counts,
                infra=sum(r.infra for r in mine),
            )
        )
    return rows


def write_results(results: list[EpisodeResult], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as out:
        for r in results:
            out.write(json.dumps(r.as_json()) + "\n")
