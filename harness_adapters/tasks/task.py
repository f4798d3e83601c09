"""A task: what one episode is asked to do.

A task has an `id`, a `prompt` (or `instruction`), an optional `split` ("train" unless given;
"test", "eval", "heldout" and "validation" count as held out) and any other fields, which go to
`data` for the verifier. A Harbor task also carries its folder and task.toml (tasks/harbor.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HELD_OUT = ("test", "eval", "heldout", "held_out", "validation")


@dataclass(frozen=True)
class HarborTask:
    """A Harbor task's folder and its task.toml, as written (unknown fields kept)."""

    dir: Path
    config: dict[str, Any] = field(default_factory=dict)

    def _get(self, section: str, key: str, default: Any = None) -> Any:
        return self.config.get(section, {}).get(key, default)

    @property
    def agent_timeout(self) -> float | None:  # None: the run's `timeout`
        return self._get("agent", "timeout_sec")

    @property
    def verifier_timeout(self) -> float:
        return float(self._get("verifier", "timeout_sec", 600.0))

    @property
    def verifier_env(self) -> dict[str, str]:
        return dict(self._get("verifier", "env", {}))

    @property
    def cpus(self) -> float:
        return float(self._get("environment", "cpus", 1))

    @property
    def memory_mb(self) -> int:
        return int(self._get("environment", "memory_mb", 2048))

    @property
    def build_timeout(self) -> float:
        return float(self._get("environment", "build_timeout_sec", 600.0))

    @property
    def docker_image(self) -> str | None:
        return self._get("environment", "docker_image")


class TaskError(ValueError):
    """A task file that cannot be used; the message names every bad row."""


@dataclass(frozen=True)
class Task:
    id: str
    prompt: str
    split: str = "train"
    data: dict[str, Any] = field(default_factory=dict)
    harbor: HarborTask | None = None  # a Harbor task: its folder (image, tests, oracle) and task.toml

    @property
    def held_out(self) -> bool:
        return self.split in HELD_OUT


def task_from_row(row: Any, where: str) -> Task:
    if not isinstance(row, dict):
        raise TaskError(f"{where}: a task must be a JSON object, not {type(row).__name__}")
    prompt = row.get("prompt", row.get("instruction"))
    missing = [name for name, value in (("id", row.get("id")), ("prompt", prompt)) if value in (None, "")]
    if missing:
        raise TaskError(f"{where}: missing {' and '.join(repr(m) for m in missing)}")
    if not isinstance(prompt, str):
        raise TaskError(f"{where}: 'prompt' must be a string")
    data = {k: v for k, v in row.items() if k not in ("id", "prompt", "instruction", "split")}
    return Task(id=str(row["id"]), prompt=prompt, split=str(row.get("split") or "train"), data=data)
