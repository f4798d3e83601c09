"""GRPO groups of episodes, as a trainer takes them: one task, `episodes_per_task` episodes,
each its own session with the group's id. Also evaluation: a success rate over tasks.

`Rollouts` produces group ids and leaves the episodes in the store (the proxy recorded every
call, the runner posted the rewards); the trainer reads them back from there. `fill` keeps
groups coming into a bounded queue (async training: when the queue is full, finished rollouts
hold their slot, so no new one starts); `groups` makes some now (sync training).
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from harness_adapters.runner import EpisodeRunner
from harness_adapters.tasks import Task
from proxy.admin_client import AdminClient
from recorder.episodes import RewardRule


@dataclass
class Rollouts:
    runner: EpisodeRunner
    tasks: list[Task]
    episodes_per_task: int
    limit: asyncio.Semaphore  # episodes running at once (evaluation shares it)
    rule: RewardRule = field(default_factory=RewardRule)  # the run's: failures' score, advantages
    rewards: list[float] = field(default_factory=list)  # every trained episode's, in the order they finished
    _order: list[Task] = field(default_factory=list)

    async def group(self, admin: AdminClient, task: Task) -> str:
        """One GRPO group of episodes; its group id."""
        group = f"{self.runner.run}/{task.id}/{uuid.uuid4().hex[:8]}"

        async def one(n: int) -> None:
            async with self.limit:
                result = await self.runner.episode(admin, task, n, group)
            reward = result.session.training_reward(self.rule).value
            if reward is not None:
                self.rewards.append(reward)

        await asyncio.gather(*(one(n) for n in range(self.episodes_per_task)))
        return group

    def next_task(self) -> Task:
        if not self._order:  # every task once, in a new random order, then again
            self._order = random.sample(self.tasks, len(self.tasks))
        return self._order.pop()

    async def groups(self, admin: AdminClient, n: int) -> list[str]:
        """`n` groups, made now."""
        return list(await asyncio.gather(*(self.group(admin, self.next_task()) for _ in range(n))))

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
                job.add_done_callback(running.discard)
        finally:
            for job in list(running):
                job.cancel()


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

        wins = await asyncio.gather(*(one(t, n) for t in tasks for n in range(episodes_per_task)))
    return sum(wins) / max(len(wins), 1)
