"""`rl-proxy tasks check`: each Harbor task's oracle (solution/solve.sh) against doing nothing,
in fresh containers, scored by the task's tests. A task whose tests cannot tell a solution
from nothing would train on noise.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness_adapters.environments.box import ContainerError, TestsError, folder_files
from harness_adapters.environments.containers import ContainerEnvironment, say
from harness_adapters.tasks import Task


@dataclass
class CheckResult:
    """A task's oracle against doing nothing: a task is ok when its solution scores 1 on every
    named reward and an untouched environment 0 on every one."""

    task: str
    oracle_reward: float | None = None
    noop_reward: float | None = None
    ok: bool = False
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("task", "oracle_reward", "noop_reward", "ok", "error")}


async def check_task(environment: ContainerEnvironment, task: Task, logs: Path) -> CheckResult:
    """Build the task's image, run its oracle then its tests in one container, and its tests
    alone in another (logs under `logs/oracle` and `logs/noop`)."""
    spec = task.harbor
    assert spec is not None
    if not (spec.dir / "solution" / "solve.sh").is_file():
        return CheckResult(task.id, error="no solution/solve.sh: nothing to check the tests against")
    try:
        async with environment.episode(task, logs / "oracle") as box:
            await box.put(folder_files(spec.dir / "solution"), "/solution")
            env = {str(k): str(v) for k, v in spec.config.get("solution", {}).get("env", {}).items()}
            code = await box.shell("bash /solution/solve.sh", spec.agent_timeout or 600.0, env, "agent/oracle.txt")
            oracle = await box.verify(task)
        async with environment.episode(task, logs / "noop") as box:
            noop = await box.verify(task)
    except (ContainerError, TestsError) as exc:
        return CheckResult(task.id, error=str(exc))
    except TimeoutError:
        return CheckResult(task.id, error=f"the oracle did not finish in {spec.agent_timeout or 600.0:g} s")
    result = CheckResult(task.id, sum(oracle.values()), sum(noop.values()))
    result.ok = all(v == 1 for v in oracle.values()) and all(v == 0 for v in noop.values())
    if not result.ok:
        result.error = f"the oracle (solve.sh exited {code}) scored {oracle}, doing nothing scored {noop}"
        if all(v == 1 for v in oracle.values()):
            result.error += ": the tests cannot tell a solution from nothing"
    return result


async def check_tasks(
    environment: ContainerEnvironment, tasks: list[Task], logs: Path, concurrency: int = 2
) -> list[CheckResult]:
    limit = asyncio.Semaphore(concurrency)

    async def one(task: Task) -> CheckResult:
        async with limit:
            result = await check_task(environment, task, logs / task.id)
        verdict = "ok" if result.ok else "NOT OK"
        say(f"{task.id}: {verdict} (oracle {result.oracle_reward}, nothing {result.noop_reward})")
        return result

    try:
        return list(await asyncio.gather(*(one(t) for t in tasks)))
    finally:
        environment.close()
