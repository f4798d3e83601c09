"""Rewards for an episode, each from a named source, combined by weights.

- `python`: a verifier `score(task, outcome) -> float` (sync or async), "module:function"; one
  with a `workdir` parameter also gets the episode's work directory, to inspect what it left.
- `command`: a shell command (templated like CommandAdapter's, run in the episode's workdir);
  its last output line if that is a number, else 1.0 for exit code 0 and 0.0 otherwise.
- `harness`: what the harness posted itself to `POST /admin/sessions/{id}/reward`; taken as
  posted (weight 1).
- `judge`: a rubric judged by any model litellm can reach (`judge_model`, e.g.
  "openai/gpt-4.1-mini", or "openai/<name>" with `judge_base_url` for an OpenAI-compatible
  server); it must answer with a number from 0 to 1.

The runner posts each weighted value under its source, so the session's reward is their sum
and every part stays visible in the store. A source that fails, or answers something that is
not a finite number, raises RewardError: the episode is marked failed with that error.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import re
from abc import abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from harness_adapters.harnesses.base import Endpoint, Outcome, command_env, load_callable, template_values
from harness_adapters.harnesses.command import kill_group, start_process
from harness_adapters.tasks import Task

JUDGE_PROMPT = """You grade an AI agent's work. Rubric:
{rubric}

Task:
{prompt}

The agent's final output:
{output}

Answer with one number from 0 (fails the rubric) to 1 (fully meets it), and nothing else."""


class RewardError(Exception):
    """A reward source failed or gave something that is not a finite number."""


class RewardSource(BaseModel):
    """One source of an episode's reward: its `type` names it in the config and in the store."""

    model_config = ConfigDict(extra="forbid")
    stored: ClassVar[bool] = False  # its value is in the store already (posted by the harness)
    type: str
    weight: float = 1.0

    def resolved(self, path: Callable[[str], str]) -> RewardSource:
        """This source with its file references relative to the config's directory."""
        return self

    @abstractmethod
    async def score(
        self, task: Task, outcome: Outcome, endpoint: Endpoint, workdir: Path, posted: float | None
    ) -> float:
        """This source's value for one episode (unweighted); `posted` is what the harness
        posted itself, if anything."""


class PythonReward(RewardSource):
    type: Literal["python"] = "python"
    function: str = Field(description="module:function or file.py:function")
    _verifier: Callable[..., Any] | None = PrivateAttr(None)

    def resolved(self, path: Callable[[str], str]) -> PythonReward:
        resolved = self.model_copy(update={"function": path(self.function)})
        resolved._verifier = load_callable(resolved.function)  # a wrong reference is named now
        return resolved

    async def score(
        self, task: Task, outcome: Outcome, endpoint: Endpoint, workdir: Path, posted: float | None
    ) -> float:
        if self._verifier is None:
            self._verifier = load_callable(self.function)
        wants_workdir = "workdir" in inspect.signature(self._verifier).parameters
        value = self._verifier(task, outcome, **({"workdir": workdir} if wants_workdir else {}))
        return await value if inspect.isawaitable(value) else value  # type: ignore[no-any-return]


class CommandReward(RewardSource):
    type: Literal["command"] = "command"
    command: list[str]
    timeout: float = 120.0

    async def score(
        self, task: Task, outcome: Outcome, endpoint: Endpoint, workdir: Path, posted: float | None
    ) -> float:
        argv = [arg.format_map(template_values(task, endpoint, workdir)) for arg in self.command]
        # In a process group of its own, under the harness's supervisor: at the timeout, or when
        # the episode is cancelled, the whole group is killed, a test runner it started included.
        proc = await start_process(
            argv,
            cwd=workdir,
            env=command_env(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self.timeout)
        except TimeoutError:
            raise RewardError(f"reward command timed out after {self.timeout:g} s") from None
        finally:
            kill_group(proc.pid)
            await proc.wait()
        lines = out.decode(errors="replace").strip().splitlines()
        try:
            return float(lines[-1]) if lines else float(proc.returncode == 0)
        except ValueError:
            return float(proc.returncode == 0)


class HarnessReward(RewardSource):
    type: Literal["harness"] = "harness"
    stored: ClassVar[bool] = True

    @field_validator("weight")
    @classmethod
    def as_posted(cls, weight: float) -> float:
        if weight != 1.0:
            raise ValueError("a harness reward is taken as the harness posted it: its weight must be 1")
        return weight

    async def score(
        self, task: Task, outcome: Outcome, endpoint: Endpoint, workdir: Path, posted: float | None
    ) -> float:
        if posted is None:
            raise RewardError("the harness posted no reward")
        return posted


class JudgeReward(RewardSource):
    type: Literal["judge"] = "judge"
    rubric: str
    judge_model: str
    judge_base_url: str | None = None
    judge_api_key_env: str | None = Field(None, description="the variable holding the judge's API key")
    timeout: float = 120.0

    async def score(
        self, task: Task, outcome: Outcome, endpoint: Endpoint, workdir: Path, posted: float | None
    ) -> float:
        from proxy.litellm_bridge import imported, litellm

        await imported()  # not on the event loop, where the episodes in flight run
        prompt = JUDGE_PROMPT.format(rubric=self.rubric, prompt=task.prompt, output=outcome.output[-8000:])
        key = os.environ.get(self.judge_api_key_env) if self.judge_api_key_env else None
        reply = await litellm().acompletion(
            model=self.judge_model,
            messages=[{"role": "user", "content": prompt}],
            temperature=0,
            max_tokens=16,
            api_base=self.judge_base_url,
            api_key=key,
            timeout=self.timeout,
        )
        text = reply.choices[0].message.content or ""
        found = re.search(r"-?\d+(?:\.\d+)?", text)
        if found is None:
            raise RewardError(f"the judge answered no number: {text[:200]!r}")
        return float(found.group())


# The kinds a config's `rewards:` may name, told apart by `type`.
Reward = Annotated[PythonReward | CommandReward | HarnessReward | JudgeReward, Field(discriminator="type")]


async def weighted(
    source: RewardSource, task: Task, outcome: Outcome, endpoint: Endpoint, workdir: Path, posted: float | None
) -> float:
    """The source's weighted value, or RewardError naming the source."""
    try:
        value = await source.score(task, outcome, endpoint, workdir, posted)
    except RewardError:
        raise
    except Exception as exc:
        raise RewardError(f"{source.type} reward failed: {type(exc).__name__}: {exc}") from exc
    return source.weight * finite(value, f"{source.type} reward")


def finite(value: Any, what: str) -> float:
    """The value as a float (True and False count as 1 and 0), or RewardError."""
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardError(f"{what} is not a finite number: {value!r}")
    return float(value)
