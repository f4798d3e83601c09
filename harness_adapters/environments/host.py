"""The harness as a process on this machine (`host`), or inside bubblewrap (`bubblewrap`): every
path read-only but the episode's work directory; the network is shared, so the proxy on
loopback is reachable.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict

from harness_adapters.tasks import Task

if TYPE_CHECKING:
    from harness_adapters.environments.box import Box

BUBBLEWRAP = [
    *("bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"),
    *("--bind", "{workdir}", "{workdir}", "--die-with-parent", "--chdir", "{workdir}", "--"),
]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HostEnvironment(Strict):
    """The harness as a process on this machine."""

    type: Literal["host"] = "host"

    def wrap(self, argv: list[str]) -> list[str]:
        return argv

    @contextlib.asynccontextmanager
    async def episode(
        self, task: Task, workdir: Path, proxy_url: str | None = None, key: str = ""
    ) -> AsyncIterator[Box | None]:
        yield None

    def expect(self, tasks: list[Task]) -> None:
        """Episodes of `tasks` (one entry each) are to come: an environment that prepares ahead
        (a container's warm pool) starts on them."""

    def close(self) -> None:
        pass


class BubblewrapEnvironment(HostEnvironment):
    """The harness in bubblewrap: every path read-only but the episode's work directory."""

    type: Literal["bubblewrap"] = "bubblewrap"  # type: ignore[assignment]

    def wrap(self, argv: list[str]) -> list[str]:
        return [*BUBBLEWRAP, *argv]
