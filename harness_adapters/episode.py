"""One episode: a harness run once on one task, talking to the proxy under its own session.

Every adapter has the same shape: `await adapter.run(task, endpoint, workdir, timeout)` returns
an `Outcome` and never raises for what the harness does (a crash, a hang, an exception in an
agent): those become outcomes with status "failed" or "timeout" and a log.

Adapters:
- `CommandAdapter`: any CLI harness, in its own process group, killed whole at its timeout.
- `PythonAdapter`: `async def agent(client, task)` given a ready `AsyncOpenAI` client.
- `AgentsSdkAdapter`: an OpenAI Agents SDK `Agent`, run with a model bound to the proxy.
- `LangChainAdapter`: a LangChain/LangGraph runnable built around a `ChatOpenAI` on the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import os
import signal
import sys
import sysconfig
import time
import traceback
from collections.abc import Awaitable, Callable
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


def _artifacts(workdir: Path, skip: set[str]) -> list[str]:
    return sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*") if p.is_file() and p.name not in skip)


def _tail(file: BinaryIO, size: int) -> str:
    """The last `size` bytes written to an open file, as text."""
    file.seek(max(0, file.seek(0, os.SEEK_END) - size))
    return file.read().decode(errors="replace").strip()


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


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


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
    there; its output still goes to harness.log and harness.stdout in the episode's workdir."""

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
            await box.put({name: content.encode() for name, content in files.items()})
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
                proc = await asyncio.create_subprocess_exec(
                    *supervised(argv),
                    cwd=workdir,
                    env=env,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out_file,
                    stderr=err_file,
                    start_new_session=True,
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
                _kill_group(proc.pid)  # children it left behind, or all of it after a timeout
                await proc.wait()
            output = _tail(out_file, OUTPUT_CHARS)
            if error and status == "failed":
                error += f"; end of log: {_tail(err_file, 500)}"
        return Outcome(
            status, output, error, code, str(log), time.monotonic() - start, _artifacts(workdir, {log.name, out.name})
        )

    async def _in_box(self, box: Box, argv: list[str], env: dict[str, str], workdir: Path, timeout: float) -> Outcome:
        log, out = workdir / "harness.log", workdir / "harness.stdout"
        start = time.monotonic()
        with open(log, "w+b") as err_file, open(out, "w+b") as out_file:
            try:
                code: int | None = await box.run(argv, env, out_file, err_file, timeout)
                status: HarnessStatus = "ok" if code == 0 else "failed"
                error = None if code == 0 else f"exited with code {code}; end of log: {_tail(err_file, 500)}"
            except TimeoutError:  # the engine's own errors (ContainerError) end the attempt, not the agent
                status, error, code = "timeout", f"killed after {timeout:g} s", None
            output = _tail(out_file, OUTPUT_CHARS)
        return Outcome(status, output, error, code, str(log), time.monotonic() - start)


async def _guarded(work: Callable[[], Awaitable[Any]], timeout: float, workdir: Path) -> Outcome:
    """Run an in-process agent with a timeout; an exception (also in building it) becomes a
    failed outcome whose log holds the traceback."""
    start = time.monotonic()
    try:
        result = await asyncio.wait_for(work(), timeout)
    except TimeoutError:
        return Outcome("timeout", error=f"cancelled after {timeout:g} s", seconds=time.monotonic() - start)
    except Exception as exc:
        log = workdir / "agent.log"
        log.write_text(traceback.format_exc())
        return Outcome("failed", error=f"{type(exc).__name__}: {exc}", log=str(log), seconds=time.monotonic() - start)
    return Outcome(
        "ok", output=_answer_text(result), seconds=time.monotonic() - start, artifacts=_artifacts(workdir, set())
    )


def _answer_text(result: Any) -> str:
    if isinstance(result, dict) and result.get("messages"):  # a LangGraph state
        result = result["messages"][-1]
    content = getattr(result, "final_output", getattr(result, "content", result))
    return content if isinstance(content, str) else str(content)


def _client(endpoint: Endpoint) -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=endpoint.openai_base_url, api_key=endpoint.api_key)


@dataclass
class PythonAdapter:
    """`async def agent(client, task)`: `client` is an `AsyncOpenAI` on the proxy under the
    episode's session; it returns the final answer. An agent with a `model` parameter also gets
    the served model's name (any name works: the proxy maps it to the policy)."""

    agent: Callable[..., Awaitable[Any]]

    async def run(
        self, task: Task, endpoint: Endpoint, workdir: Path, timeout: float, box: Box | None = None
    ) -> Outcome:
        client = _client(endpoint)
        extra = {"model": endpoint.model} if "model" in inspect.signature(self.agent).parameters else {}
        try:
            return await _guarded(lambda: self.agent(client, task, **extra), timeout, workdir)
        finally:
            await client.close()


@dataclass
class AgentsSdkAdapter:
    """An OpenAI Agents SDK agent: `make_agent(task) -> Agent`, run on `task.prompt` with its
    model replaced by one on the proxy (Responses, or Chat Completions with api="chat")."""

    make_agent: Callable[[Task], Any]
    api: str = "responses"
    max_turns: int = 10

    async def run(
        self, task: Task, endpoint: Endpoint, workdir: Path, timeout: float, box: Box | None = None
    ) -> Outcome:
        from agents import Runner, set_tracing_disabled
        from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel
        from agents.models.openai_responses import OpenAIResponsesModel

        set_tracing_disabled(True)
        kind = OpenAIChatCompletionsModel if self.api == "chat" else OpenAIResponsesModel
        client = _client(endpoint)
        try:
            model = kind(model=endpoint.model, openai_client=client)

            def start() -> Awaitable[Any]:
                agent = self.make_agent(task).clone(model=model)
                return Runner.run(agent, task.prompt, max_turns=self.max_turns)

            return await _guarded(start, timeout, workdir)
        finally:
            await client.close()


@dataclass
class LangChainAdapter:
    """A LangChain or LangGraph agent: `make_agent(llm, task)` returns a runnable given a
    `ChatOpenAI` on the proxy; it is invoked with the task's prompt as a user message (in a
    `{"messages": [...]}` state for a graph)."""

    make_agent: Callable[[Any, Task], Any]
    use_responses_api: bool = False

    async def run(
        self, task: Task, endpoint: Endpoint, workdir: Path, timeout: float, box: Box | None = None
    ) -> Outcome:
        from langchain_openai import ChatOpenAI
        from pydantic import SecretStr

        llm = ChatOpenAI(
            base_url=endpoint.openai_base_url,
            api_key=SecretStr(endpoint.api_key),
            model=endpoint.model,
            use_responses_api=self.use_responses_api,
        )

        def start() -> Awaitable[Any]:
            runnable = self.make_agent(llm, task)
            messages = [("user", task.prompt)]
            # A LangGraph agent takes its state ({"messages": [...]}), a model or chain the messages.
            graph = "messages" in runnable.get_input_jsonschema().get("properties", {})
            return runnable.ainvoke({"messages": messages} if graph else messages)  # type: ignore[no-any-return]

        return await _guarded(start, timeout, workdir)
