"""Harnesses that run in this process:
- `PythonAdapter`: `async def agent(client, task)` given a ready `AsyncOpenAI` client.
- `AgentsSdkAdapter`: an OpenAI Agents SDK `Agent`, run with a model bound to the proxy.
- `LangChainAdapter`: a LangChain/LangGraph runnable built around a `ChatOpenAI` on the proxy.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness_adapters.harnesses.base import Endpoint, Outcome, artifacts
from harness_adapters.tasks import Task

if TYPE_CHECKING:
    from harness_adapters.environments import Box


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
        "ok", output=_answer_text(result), seconds=time.monotonic() - start, artifacts=artifacts(workdir, set())
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
