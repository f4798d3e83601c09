"""One episode's running container (`Box`): run commands in it, put files in, fetch its logs,
and run the task's tests on a clean slate after the agent. What fails in the engine is a
ContainerError (the infrastructure's, never the agent's); tests that wrote no usable reward a
TestsError.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import os
import shlex
import shutil
import tarfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

from harness_adapters.tasks import Task

if TYPE_CHECKING:
    from docker.models.containers import Container

T = TypeVar("T")

LOGS = "/logs"  # the container's /logs/agent and /logs/verifier are copied into the episode's work directory


class ContainerError(RuntimeError):
    """No container engine, an image that cannot be built, a container that cannot start."""


class BuildError(ContainerError):
    """A task's image that does not build (cached for the run: not tried again)."""


class TestsError(Exception):
    """The task's tests wrote no usable reward, or did not finish: the agent's doing, not the
    infrastructure's (the runner scores the episode as failed)."""


@dataclass
class Box:
    """One episode's running container: run commands in it, put files in it, verify it. The
    engine's own failures (a container gone, a connection lost) raise ContainerError: they are
    the infrastructure's, never the agent's."""

    container: Container
    workdir: str  # the image's working directory: where the harness runs
    logs: Path  # the episode's work directory on the host: /logs/agent and /logs/verifier are copied there
    proxy_url: str | None = None  # the proxy as the harness inside reaches it

    async def run(
        self, argv: list[str], env: dict[str, str], out: BinaryIO, err: BinaryIO, timeout: float, stop: bool = True
    ) -> int:
        """Run `argv` in the container; its exit code. At the timeout every process in the
        container is killed (the container stays, for the tests) and TimeoutError raised; with
        `stop` False (the kill itself), ContainerError: the container no longer answers."""
        api = self.container.client.api

        def execute() -> int:
            created = api.exec_create(self.container.id, argv, environment=env, workdir=self.workdir)
            for stdout, stderr in api.exec_start(created["Id"], stream=True, demux=True):
                out.write(stdout or b"")
                err.write(stderr or b"")
            return int(api.exec_inspect(created["Id"])["ExitCode"] or 0)

        running = asyncio.ensure_future(engine_call(execute))
        done, _ = await asyncio.wait({running}, timeout=timeout)
        if not done and not stop:
            raise ContainerError(f"the container did not run {argv[0]!r} in {timeout:g} s")
        if not done:
            await self.stop_agent()
            with contextlib.suppress(Exception):  # its stream ends with its processes
                await asyncio.wait_for(asyncio.shield(running), 30)
            raise TimeoutError
        return running.result()

    async def stop_agent(self, then: str = "true") -> None:
        """Kill every process in the container but its PID 1 (the shell's `kill` spares the shell):
        what the harness left running (a background job that would rewrite the reward after the
        tests) ends before they run; then the shell runs `then`, in the same exec."""
        with open(os.devnull, "wb") as out:
            await self.run(["sh", "-c", f"kill -9 -1 2>/dev/null; {then}"], {}, out, out, 60, stop=False)

    async def put(self, files: dict[str, bytes], at: str | None = None) -> None:
        """Write files (relative path -> content) under `at` (default: the working directory), made first."""
        target = at or self.workdir
        await self.shell(f"mkdir -p {shlex.quote(target)}", 60)
        await self.copy(files, target)

    async def copy(self, files: dict[str, bytes], target: str) -> None:
        """Write files (relative path -> content) into the folder `target`, which exists."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            for name, content in files.items():
                entry = tarfile.TarInfo(name)
                entry.size, entry.mode, entry.mtime = len(content), 0o755, int(time.time())
                archive.addfile(entry, io.BytesIO(content))
        if not await engine_call(self.container.put_archive, target, buffer.getvalue()):
            raise ContainerError(f"cannot copy files into {target}")

    def fetch(self, part: str) -> None:
        """Copy the container's /logs/<part> into the episode's work directory as <part>, over
        the API (so a remote engine works too)."""
        stream, _ = self.container.get_archive(f"{LOGS}/{part}")
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as archive:
            archive.extractall(self.logs, filter="data")  # the archive holds the folder by its name

    async def shell(self, script: str, timeout: float, env: dict[str, str] | None = None, log: str = "") -> int:
        """`sh -c script`, its output appended to `log` (a file under the episode's work
        directory) when given."""
        target = self.logs / log if log else Path(os.devnull)
        if log:
            target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "ab") as out:
            return await self.run(["sh", "-c", script], env or {}, out, out, timeout)

    async def verify(self, task: Task) -> dict[str, float]:
        """Run the task's tests (Harbor: tests/test.sh, copied to /tests) after the agent, on a
        clean slate: the agent's processes killed, /tests and /logs/verifier emptied (whatever the
        agent put there); the named rewards the tests wrote to /logs/verifier/reward.json, or
        {"reward": value} from reward.txt; TestsError when they wrote neither, or did not finish."""
        spec = task.harbor
        if spec is None:
            return {}
        shutil.rmtree(self.logs / "verifier", ignore_errors=True)
        await self.stop_agent(f"rm -rf /tests {LOGS}/verifier; mkdir -p /tests {LOGS}/verifier")
        await self.copy(folder_files(spec.dir / "tests"), "/tests")
        try:
            await self.shell(
                "bash /tests/test.sh", spec.verifier_timeout, spec.verifier_env, "verifier/test-stdout.txt"
            )
        except TimeoutError:
            raise TestsError(f"the tests did not finish in {spec.verifier_timeout:g} s") from None
        await engine_call(self.fetch, "verifier")
        return read_reward(self.logs / "verifier")


def folder_files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by its path relative to it."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# The container engine's calls run on threads of their own. A harness's exec holds its thread for
# the whole episode: on asyncio's default pool (the CPUs + 4 threads) no more episodes than that
# ran at once, and a timeout's kill or a container's removal waited for one of them to end.
ENGINE_THREADS = ThreadPoolExecutor(max_workers=256, thread_name_prefix="container-engine")


def on_engine_thread(work: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """`work(*args)` submitted now to a thread of the engine's (awaited, it is its result)."""
    return asyncio.get_running_loop().run_in_executor(ENGINE_THREADS, work, *args)


async def engine_call(work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` on a thread of the engine's, its failures raised as ContainerError."""
    import docker
    import requests

    try:
        return await on_engine_thread(work, *args)
    except (docker.errors.DockerException, requests.RequestException, OSError) as exc:
        raise ContainerError(f"the container engine failed: {type(exc).__name__}: {exc}") from exc


def read_reward(folder: Path) -> dict[str, float]:
    """The rewards the tests wrote: reward.json (name -> number) or reward.txt (one number)."""
    as_json, as_text = folder / "reward.json", folder / "reward.txt"
    try:
        if as_json.is_file():
            named = json.loads(as_json.read_text())
            if not isinstance(named, dict) or not named:
                raise TestsError("reward.json must be an object of named numbers")
            rewards = {str(k): float(v) for k, v in named.items()}
        elif as_text.is_file():
            rewards = {"reward": float(as_text.read_text().strip())}
        else:
            out = folder / "test-stdout.txt"
            tail = out.read_text(errors="replace")[-500:] if out.is_file() else ""
            raise TestsError(
                f"the tests wrote no reward ({LOGS}/verifier/reward.txt or reward.json); end of their output: {tail!r}"
            )
    except (TypeError, ValueError) as exc:  # JSONDecodeError is a ValueError; float("x") too
        raise TestsError(f"the tests wrote an unreadable reward: {exc}") from exc
    bad = [name for name, value in rewards.items() if not math.isfinite(value)]
    if bad:
        raise TestsError(f"the tests wrote rewards that are not finite numbers: {', '.join(bad)}")
    return rewards
