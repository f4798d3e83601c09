"""Run episodes: N per task, at most `concurrency` at a time, each in its own session and
workdir, then scored and closed. Talks to the proxy only through its admin API, so the proxy
may be in this process or anywhere else.

Each episode: create a session (`run`, `task_id`, `group_id` = run/task: the GRPO group) ->
run the harness -> count its calls (none: reported as "no_calls", by name, and never scored:
the harness ignored the proxy's address) -> score it (each reward source posted under its
name) -> end the session with its status and outcome.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from harness_adapters.episode import Adapter, Endpoint, Outcome
from harness_adapters.rewards import RewardError, RewardSource, weighted
from harness_adapters.tasks import Task


@dataclass
class EpisodeResult:
    task: Task
    episode: int
    session_id: str
    outcome: Outcome
    calls: int
    reward: float | None  # None: not scored (the episode failed)
    status: str  # "ok", "failed", "timeout" or "no_calls"
    error: str | None = None

    def success(self, at: float) -> bool:
        return self.status == "ok" and self.reward is not None and self.reward >= at

    def as_json(self) -> dict[str, Any]:
        return {
            "task_id": self.task.id, "episode": self.episode, "session_id": self.session_id, "status": self.status,
            "reward": self.reward, "calls": self.calls, "error": self.error, "outcome": self.outcome.as_json(),
        }  # fmt: skip


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
    sampling: dict[str, Any] | None = None  # set by the proxy on every call, whatever the harness asks

    def admin(self) -> httpx.AsyncClient:
        """A client of the proxy's admin API (use it in `async with`)."""
        headers = {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}
        # Connections idle for less than any server keeps them (uvicorn's default: 5 s).
        limits = httpx.Limits(keepalive_expiry=2.0)
        return httpx.AsyncClient(base_url=self.proxy_url, headers=headers, timeout=60, limits=limits)

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

            work = [one(task, n) for task in tasks for n in range(episodes_per_task)]
            return list(await asyncio.gather(*work))

    async def episode(self, admin: httpx.AsyncClient, task: Task, n: int, group: str | None = None) -> EpisodeResult:
        """One episode, in the GRPO group `group` (default: run/task)."""
        group = group or f"{self.run}/{task.id}"
        asked = {"run": self.run, "task_id": task.id, "group_id": group, "metadata": {"episode": n},
                 "sampling": self.sampling}  # fmt: skip
        created = await admin.post("/admin/sessions", json=asked)
        created.raise_for_status()
        session = created.json()
        workdir = self.workdir / session["id"]
        workdir.mkdir(parents=True, exist_ok=True)
        endpoint = Endpoint(self.proxy_url, session["key"], self.model, session["id"])
        outcome = await self.adapter.run(task, endpoint, workdir, self.timeout)
        info = (await admin.get(f"/admin/sessions/{session['id']}")).json()
        status, error, reward = outcome.status, outcome.error, None
        if info["calls"] == 0:
            status = "no_calls"
            error = "the harness made no call through the proxy (a wrong base URL, or a variable it ignores?)" + (
                f"; it {outcome.status}: {outcome.error}" if outcome.error else "")  # fmt: skip
        elif status == "ok":
            try:
                reward = await self.score(admin, session["id"], task, outcome, endpoint, workdir, info["reward"])
            except RewardError as exc:
                status, error = "failed", str(exc)
        ended = {"status": status, "outcome": {**outcome.as_json(), "error": error, "reward": reward}}
        await admin.post(f"/admin/sessions/{session['id']}/end", json=ended)
        return EpisodeResult(task, n, session["id"], outcome, info["calls"], reward, status, error)

    async def score(
        self, admin: httpx.AsyncClient, session_id: str, task: Task, outcome: Outcome, endpoint: Endpoint,
        workdir: Path, posted: float | None,
    ) -> float:  # fmt: skip
        """Score with every source first (nothing is posted if one fails), then post each part."""
        parts = [(source, await weighted(source, task, outcome, endpoint, workdir, posted)) for source in self.rewards]
        for i, (source, value) in enumerate(parts):
            if not source.stored:  # its id: posted again (a retry), it still counts once
                reward = {"value": value, "source": source.type, "id": f"runner-{i}"}
                answer = await admin.post(f"/admin/sessions/{session_id}/reward", json=reward)
                answer.raise_for_status()
        return sum(value for _, value in parts)


def summary(results: list[EpisodeResult], success_at: float) -> list[dict[str, Any]]:
    """One row per task: episodes, successes, mean reward, and what went wrong."""
    rows = []
    for task_id in dict.fromkeys(r.task.id for r in results):
        mine = [r for r in results if r.task.id == task_id]
        rewards = [r.reward for r in mine if r.reward is not None]
        rows.append({
            "task": task_id, "episodes": len(mine), "success": sum(r.success(success_at) for r in mine),
            "mean_reward": statistics.fmean(rewards) if rewards else None,
            "failed": sum(r.status == "failed" for r in mine), "timeout": sum(r.status == "timeout" for r in mine),
            "no_calls": sum(r.status == "no_calls" for r in mine),
        })  # fmt: skip
    return rows


def write_results(results: list[EpisodeResult], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as out:
        for r in results:
            out.write(json.dumps(r.as_json()) + "\n")
