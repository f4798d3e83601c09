"""What every harness adapter shares: the `Endpoint` it talks to (the proxy, under the
episode's key), the `Outcome` it returns, the `Adapter` shape, and the templates and environment
of commands (which the command reward uses too).

Every adapter has the same shape: `await adapter.run(task, endpoint, workdir, timeout, box)`
returns an `Outcome` and never raises for what the harness does (a crash, a hang, an exception
in an agent): those become outcomes with status "failed" or "timeout" and a log.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from harness_adapters.tasks import Task
from recorder.episodes import HarnessStatus

if TYPE_CHECKING:
    from harness_adapters.environments import Box

OUTPUT_CHARS = 20_000  # of a harness's stdout kept as its output
FROM_FILES: set[str] = set()  # modules load_callable loaded from a file: a Ray task takes them by value


@dataclass(frozen=True)
class Endpoint:
    """Where an episode's harness talks to: the proxy (its root URL) under the episode's key."""

    url: str
    api_key: str
    model: str
    session_id: str = ""

    @property
    def openai_base_url(self) -> str:
        return f"{self.url.rstrip('/')}/v1"

    def env(self) -> dict[str, str]:
        """The variables harnesses read for their endpoint, all pointing at the proxy."""
        v1, root = self.openai_base_url, self.url.rstrip("/")
        return {
            "OPENAI_BASE_URL": v1,
            "OPENAI_API_BASE": v1,
            "OPENAI_API_KEY": self.api_key,
            "OPENAI_MODEL": self.model,
            "ANTHROPIC_BASE_URL": root,
            "ANTHROPIC_API_KEY": self.api_key,
            "ANTHROPIC_MODEL": self.model,
            "RLP_BASE_URL": root,
            "RLP_SESSION_KEY": self.api_key,
            "RLP_MODEL": self.model,
            "RLP_SESSION_ID": self.session_id,  # for POST /admin/sessions/{id}/reward
        }


@dataclass
class Outcome:
    """What a harness's run did (the episode's record in the store is recorder's EpisodeOutcome)."""

    status: HarnessStatus
    output: str = ""  # the final answer (python adapters) or the end of stdout (commands)
    error: str | None = None
    exit_code: int | None = None
    log: str | None = None  # path of the harness's log
    seconds: float = 0.0
    artifacts: list[str] = field(default_factory=list)  # files the harness left in its workdir

    def as_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("status", "output", "error", "exit_code", "log", "seconds")}


class Adapter(Protocol):
    async def run(
        self, task: Task, endpoint: Endpoint, workdir: Path, timeout: float, box: Box | None = None
    ) -> Outcome: ...


def load_callable(ref: str) -> Callable[..., Any]:
    """`package.module:name` or `path/to/file.py:name`."""
    module_ref, _, name = ref.rpartition(":")
    if not module_ref or not name:
        raise ValueError(f"{ref!r}: expected 'module:function' or 'file.py:function'")
    if module_ref.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(module_ref).stem, module_ref)
        if spec is None or spec.loader is None:
            raise ValueError(f"{ref!r}: cannot load {module_ref}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        FROM_FILES.add(spec.name)
    else:
        module = importlib.import_module(module_ref)
    found = getattr(module, name, None)
    if not callable(found):
        raise ValueError(f"{ref!r}: {module_ref} has no function {name!r}")
    return found  # type: ignore[no-any-return]


def template_values(task: Task, endpoint: Endpoint, workdir: Path | str) -> dict[str, Any]:
    """What `{name}` may stand for in a command, its environment and its files."""
    return {
        # The workdir absolute: a command runs in it, so a relative one would name a folder inside.
        **task.data,
        "task_id": task.id,
        "prompt": task.prompt,
        "workdir": workdir if isinstance(workdir, str) else str(workdir.resolve()),
        "model": endpoint.model,
        "base_url": endpoint.url,
        "openai_base_url": endpoint.openai_base_url,
        "api_key": endpoint.api_key,
    }


def command_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a harness or reward command: ours plus `extra`, with this interpreter's
    scripts directory first on PATH, so that a harness installed beside rl-proxy (`mini`, ...)
    is found when its virtualenv is not activated."""
    path = os.pathsep.join(filter(None, [sysconfig.get_path("scripts"), os.environ.get("PATH")]))
    return {**os.environ, "PATH": path, **(extra or {})}


def artifacts(workdir: Path, skip: set[str]) -> list[str]:
    return sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*") if p.is_file() and p.name not in skip)


def tail(file: BinaryIO, size: int) -> str:
    """The last `size` bytes written to an open file, as text."""
    file.seek(max(0, file.seek(0, os.SEEK_END) - size))
    return file.read().decode(errors="replace").strip()
