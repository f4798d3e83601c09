"""Rewards for an episode, each from a named source, combined by weights.

- `python`: a verifier `score(task, outcome) -> float` (sync or async), "module:function".
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
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from harness_adapters.episode import Endpoint, Outcome, command_env, load_callable, template_values
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


@dataclass
class Reward:
    type: Literal["python", "command", "harness", "judge"]
    weight: float = 1.0
    function: str | None = None  # python
    command: list[str] | None = None  # command
    timeout: float = 120.0  # command, judge
    rubric: str | None = None  # judge
    judge_model: str | None = None
    judge_base_url: str | None = None
    judge_api_key: str | None = None

    def __post_init__(self) -> None:
        needed = {"python": self.function, "command": self.command, "judge": self.rubric and self.judge_model}
        if self.type in needed and not needed[self.type]:
            what = {"python": "'function'", "command": "'command'", "judge": "'rubric' and 'judge_model'"}[self.type]
            raise ValueError(f"a {self.type} reward needs {what}")
        if self.type == "harness" and self.weight != 1.0:
            raise ValueError("a harness reward is taken as the harness posted it: its weight must be 1")
        self._verifier = load_callable(self.function) if self.type == "python" and self.function else None

    async def score(self, task: Task, outcome: Outcome, endpoint: Endpoint, workdir: Path) -> float:
        """This source's value for one episode (unweighted)."""
        try:
            if self.type == "python":
                value = self._verifier(task, outcome)  # type: ignore[misc]
                value = await value if inspect.isawaitable(value) else value
            elif self.type == "command":
                value = await self._command(task, endpoint, workdir)
            elif self.type == "judge":
                value = await self._judge(task, outcome)
            else:
                raise RewardError("harness rewards are read from the store, not scored")
        except RewardError:
            raise
        except Exception as exc:
            raise RewardError(f"{self.type} reward failed: {type(exc).__name__}: {exc}") from exc
        return finite(value, f"{self.type} reward")

    async def _command(self, task: Task, endpoint: Endpoint, workdir: Path) -> float:
        argv = [arg.format_map(template_values(task, endpoint, workdir)) for arg in self.command or []]
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=workdir, env=command_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self.timeout)
        except TimeoutError:
            proc.kill()
            raise RewardError(f"reward command timed out after {self.timeout:g} s") from None
        lines = out.decode(errors="replace").strip().splitlines()
        try:
            return float(lines[-1]) if lines else float(proc.returncode == 0)
        except ValueError:
            return float(proc.returncode == 0)

    async def _judge(self, task: Task, outcome: Outcome) -> float:
        from proxy.litellm_bridge import litellm

        prompt = JUDGE_PROMPT.format(rubric=self.rubric, prompt=task.prompt, output=outcome.output[-8000:])
        reply = await litellm().acompletion(
            model=self.judge_model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=16,
            api_base=self.judge_base_url, api_key=self.judge_api_key, timeout=self.timeout,
        )  # fmt: skip
        text = reply.choices[0].message.content or ""
        found = re.search(r"-?\d+(?:\.\d+)?", text)
        if found is None:
            raise RewardError(f"the judge answered no number: {text[:200]!r}")
        return float(found.group())


def finite(value: Any, what: str) -> float:
    """The value as a float (True and False count as 1 and 0), or RewardError."""
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardError(f"{what} is not a finite number: {value!r}")
    return float(value)
