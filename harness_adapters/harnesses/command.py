"""`CommandAdapter`: any CLI harness (mini-swe-agent, Claude Code, Codex, a script), in its own
process group under a supervisor, killed whole at its timeout; or inside the episode's
container.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness_adapters.harnesses.base import (
    OUTPUT_CHARS,
    Endpoint,
    Outcome,
    artifacts,
    command_env,
    tail,
    template_values,
)
from harness_adapters.tasks import Task
from recorder.episodes import HarnessStatus

if TYPE_CHECKING:
    from harness_adapters.environments import Box


# A command harness runs under this supervisor, the leader of its process group: when the runner's
# process dies, however it dies (a Ray worker killed at a cancel's deadline, an OOM kill,
# SIGKILL), the kernel sends the supervisor SIGUSR2 (PR_SET_PDEATHSIG) and it kills the whole
# group, the harness's own children included, which would otherwise run on with no one to end
# them. SIGTERM (the runner's, at the harness's timeout) is the harness's to handle: the
# supervisor waits for it to exit. Its exit code is the harness's (128 + N for a signal N).
SUPERVISOR = r"""
import ctypes, os, signal, subprocess, sys
signal.signal(signal.SIGUSR2, lambda *_: os.killpg(0, signal.SIGKILL))
signal.signal(signal.SIGTERM, lambda *_: None)
if ctypes.CDLL(None).prctl(1, signal.SIGUSR2) != 0 or os.getppid() != int(sys.argv[1]):
    os.killpg(0, signal.SIGKILL)
try:
    harness = subprocess.Popen(sys.argv[2:])
except OSError as exc:
    sys.exit(f"cannot start {sys.argv[2]!r}: {exc}")
code = harness.wait()
sys.exit(code if code >= 0 else 128 - code)
"""


def supervised(argv: list[str]) -> list[str]:
    """`argv` under SUPERVISOR, for a new process group of its own (see there)."""
    return [sys.executable, "-I", "-c", SUPERVISOR, str(os.getpid()), *argv]  # -I: no module of the workdir


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


async def start_process(argv: list[str], **options: Any) -> asyncio.subprocess.Process:
    """`argv` under SUPERVISOR in a process group of its own (`asyncio.create_subprocess_exec`'s
    `options`), the whole group killed if the episode is cancelled while it starts (Ctrl-C,
    SIGTERM): asyncio then kills only the process it started, the supervisor, and a harness that
    had started under it ran on (`collect` stopped by SIGTERM as its episodes started left both
    harnesses running, seen in a CI run)."""
    starting = asyncio.ensure_future(
        asyncio.create_subprocess_exec(*supervised(argv), start_new_session=True, **options)
    )
    try:
        return await asyncio.shield(starting)
    except asyncio.CancelledError:
        with contextlib.suppress(OSError):
            proc = await starting
            kill_group(proc.pid)
            await proc.wait()
        raise


@dataclass
class CommandAdapter:
    """Any CLI harness: `argv`, `env` and `files` (path -> content, in the workdir) are templates
    (`{prompt}`, `{task_id}`, `{openai_base_url}`, `{api_key}`, `{model}`, `{workdir}`, task
    fields; write `{{`/`}}` for a literal brace). The proxy's address and the session key are also
    in every variable of `Endpoint.env`. The process gets its own process group: at the timeout
    the group gets SIGTERM, then SIGKILL after `grace` seconds, and whatever the harness left
    running is killed when it exits, or when the runner's process dies (SUPERVISOR).

    In a container (`box`), the command runs there instead, in the image's working directory
    (which `{workdir}` names), with only the endpoint's variables and `env`; `files` are written
    there, or where an absolute name says; its output still goes to harness.log and
    harness.stdout in the episode's workdir."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    grace: float = 5.0

    async def run(
        self, task: Task, endpoint: Endpoint, workdir: Path, timeout: float, box: Box | None = None
    ) -> Outcome:
        values = template_values(task, endpoint, box.workdir if box else workdir)
        try:
            argv = [arg.format_map(values) for arg in self.argv]
            extra = {**endpoint.env(), **{k: v.format_map(values) for k, v in self.env.items()}}
            files = {name.format_map(values): content.format_map(values) for name, content in self.files.items()}
        except (KeyError, ValueError, IndexError) as exc:
            return Outcome("failed", error=f"bad template in the command adapter: {exc!r}")
        if box is not None:
            here = {name: content.encode() for name, content in files.items() if not name.startswith("/")}
            await box.put(here)
            if placed := {name[1:]: content.encode() for name, content in files.items() if name.startswith("/")}:
                await box.put(placed, "/")
            return await self._in_box(box, argv, extra, workdir, timeout)
        for relative, content in files.items():
            target = workdir / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
        env = command_env(extra)
        log, out = workdir / "harness.log", workdir / "harness.stdout"
        start = time.monotonic()
        # Read back through the open files: the harness runs in this workdir and may delete them
        # (an agent's `rm -rf *` did, and the missing file crashed the whole training run).
        with open(log, "w+b") as err_file, open(out, "w+b") as out_file:
            try:
                proc = await start_process(
                    argv, cwd=workdir, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=out_file, stderr=err_file
                )
            except OSError as exc:
                return Outcome("failed", error=f"cannot start {argv[0]!r}: {exc}", log=str(log))
            try:
                code = await asyncio.wait_for(proc.wait(), timeout)
                status: HarnessStatus = "ok" if code == 0 else "failed"
                error = None if code == 0 else f"exited with code {code}"
            except TimeoutError:
                status, error, code = "timeout", f"killed after {timeout:g} s", None
                with contextlib.suppress(ProcessLookupError, asyncio.TimeoutError):
                    os.killpg(proc.pid, signal.SIGTERM)
                    await asyncio.wait_for(proc.wait(), self.grace)
            finally:
                kill_group(proc.pid)  # children it left behind, or all of it after a timeout
                await proc.wait()
            output = tail(out_file, OUTPUT_CHARS)
            if error and status == "failed":
                error += f"; end of log: {tail(err_file, 500)}"
        return Outcome(
            status, output, error, code, str(log), time.monotonic() - start, artifacts(workdir, {log.name, out.name})
        )

    async def _in_box(self, box: Box, argv: list[str], env: dict[str, str], workdir: Path, timeout: float) -> Outcome:
        log, out = workdir / "harness.log", workdir / "harness.stdout"
        start = time.monotonic()
        with open(log, "w+b") as err_file, open(out, "w+b") as out_file:
            try:
                code: int | None = await box.run(argv, env, out_file, err_file, timeout)
                status: HarnessStatus = "ok" if code == 0 else "failed"
                error = None if code == 0 else f"exited with code {code}; end of log: {tail(err_file, 500)}"
            except TimeoutError:  # the engine's own errors (ContainerError) end the attempt, not the agent
                status, error, code = "timeout", f"killed after {timeout:g} s", None
            output = tail(out_file, OUTPUT_CHARS)
        return Outcome(status, output, error, code, str(log), time.monotonic() - start)
