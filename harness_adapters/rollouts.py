"""GRPO groups of episodes, as a trainer takes them: one task, `episodes_per_task` episodes,
each its own session with the group's id. Also evaluation: a success rate over tasks.

`Rollouts` produces group ids and leaves the episodes in the store (the proxy recorded every
call, the runner posted the rewards); the trainer reads them back from there. `fill` keeps
groups coming into a bounded queue (async training: when the queue is full, finished rollouts
hold their slot, so no new one starts); `groups` makes some now (sync training).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from harness_adapters.runner import EpisodeRunner
from harness_adapters.tasks import Task
from proxy.admin_client import AdminClient
from recorder.episodes import RewardRule

log = logging.getLogger("rl_proxy.rollouts")


@dataclass
class Curriculum:
    """Tasks sampled by how likely a group of theirs is to hold both a success and a failure
    (what GRPO learns from; DAPO's dynamic sampling and prime-rl's online difficulty filter
    spend rollouts alike): with a pass rate p from the task's recent episodes (Laplace's rule, so
    an untried task counts as 1/2), a group of k episodes has both with 1 - p^k - (1 - p)^k. No
    task falls below `floor`, so a task that never succeeds yet is still tried now and then."""

    episodes_per_task: int
    success_at: float
    floor: float = 0.05
    window: int = 32  # the recent episodes a pass rate counts
    outcomes: dict[str, deque[bool]] = field(default_factory=dict)

    def record(self, task: str, success: bool) -> None:
        self.outcomes.setdefault(task, deque(maxlen=self.window)).append(success)

    def saved(self) -> dict[str, list[bool]]:
        """The recent outcomes, as a checkpoint keeps them (`restore` takes them back)."""
        return {task: list(seen) for task, seen in self.outcomes.items()}

    def restore(self, saved: dict[str, list[bool]]) -> None:
        """Go on from a checkpoint's outcomes: a resumed run does not take every task as untried."""
        for task, seen in saved.items():
            self.outcomes[task] = deque(seen, maxlen=self.window)

    def weight(self, task: str) -> float:
        seen = self.outcomes.get(task, ())
        p = (sum(seen) + 1) / (len(seen) + 2)
        k = self.episodes_per_task
        return max(self.floor, 1 - p**k - (1 - p) ** k)

    def pick(self, tasks: list[Task]) -> Task:
        return random.choices(tasks, weights=[self.weight(t.id) for t in tasks])[0]


@dataclass
class Rollouts:
    runner: EpisodeRunner
    tasks: list[Task]
    episodes_per_task: int
    limit: asyncio.Semaphore  # episodes running at once (evaluation shares it)
    rule: RewardRule = field(default_factory=RewardRule)  # the run's: failures' score, advantages
    curriculum: Curriculum | None = None  # None: every task once, in a random order, then again
    rewards: list[float] = field(default_factory=list)  # every trained episode's, in the order they finished
    groups_made: int = 0
    signal_groups: int = 0  # groups whose rewards differ: GRPO learns from these only
    started: float | None = None  # when the first group started (time.monotonic)
    _order: list[Task] = field(default_factory=list)

    async def group(self, admin: AdminClient, task: Task) -> str:
        """One GRPO group of episodes; its group id."""
        group = f"{self.runner.run}/{task.id}/{uuid.uuid4().hex[:8]}"
        self.started = self.started or time.monotonic()
        rewards: list[float] = []

        async def one(n: int) -> None:
            async with self.limit:
                result = await self.runner.episode(admin, task, n, group)
            reward = result.session.training_reward(self.rule).value
            if reward is not None:
                rewards.append(reward)
                self.rewards.append(reward)
                if self.curriculum is not None:
                    self.curriculum.record(task.id, result.success(self.curriculum.success_at))

        self.runner.expect([task] * self.episodes_per_task)  # those that wait for room start warm
        await asyncio.gather(*(one(n) for n in range(self.episodes_per_task)))
        self.groups_made += 1
        self.signal_groups += len(set(rewards)) > 1
        return group

    def signal_per_minute(self) -> float | None:
        """Groups with a signal per minute since the first group started."""
        if self.started is None:
            return None
        return self.signal_groups / max((time.monotonic() - self.started) / 60, 1e-9)

    def next_task(self) -> Task:
        if self.curriculum is not None:
            return self.curriculum.pick(self.tasks)
        if not self._order:  # every task once, in a new random order, then again
            self._order = random.sample(self.tasks, len(self.tasks))
        return self._order.pop()

    async def groups(self, admin: AdminClient, n: int) -> list[str]:
        """`n` groups, made now."""
        return list(await asyncio.gather(*(self.group(admin, self.next_task()) for _ in range(n))))

    @staticmethod
    def _finished(running: set[asyncio.Task[None]]) -> Callable[[asyncio.Task[None]], None]:
        """A group's job is done: an error that ended it is logged, not left unretrieved (an
        episode's own faults end that episode, so this is a bug of ours)."""

        def done(job: asyncio.Task[None]) -> None:
            running.discard(job)
            if not job.cancelled() and job.exception() is not None:
                log.error("a group's rollouts failed", exc_info=job.exception())

        return done

    async def fill(self, admin: AdminClient, queue: asyncio.Queue[str], concurrency: int) -> None:
        """Keep groups coming into `queue` until cancelled (with the rollouts it started; their
        sessions stay unended); a finished group waits for room."""
        in_flight = asyncio.Semaphore(-(-concurrency // self.episodes_per_task) + 1)
        running: set[asyncio.Task[None]] = set()

        async def one(task: Task) -> None:
            try:
                await queue.put(await self.group(admin, task))
            finally:
                in_flight.release()

        try:
            while True:
                await in_flight.acquire()
                job = asyncio.create_task(one(self.next_task()))
                running.add(job)
                job.add_done_callback(self._finished(running))
        finally:  # the jobs unwind before fill ends: their episodes remove their containers
            for job in list(running):
                job.cancel()
            await asyncio.gather(*running, return_exceptions=True)


async def success_rate(
    runner: EpisodeRunner,
    tasks: list[Task],
    episodes_per_task: int,
    limit: asyncio.Semaphore,
    success_at: float,
    done: Callable[[bool], None] | None = None,
) -> float:
    """The share of episodes (`episodes_per_task` per task) whose reward reaches `success_at`;
    `done` hears of each episode's success as it finishes."""
    async with runner.admin() as admin:

        async def one(task: Task, n: int) -> bool:
            async with limit:
                result = await runner.episode(admin, task, n, f"{runner.run}/{task.id}")
            if done is not None:
                done(result.success(success_at))
            return result.success(success_at)

        runner.expect([t for t in tasks for _ in range(episodes_per_task)])
        wins = await asyncio.gather(*(one(t, n) for t in tasks for n in range(episodes_per_task)))
    return sum(wins) / max(len(wins), 1)
