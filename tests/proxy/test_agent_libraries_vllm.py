"""Agent libraries, unchanged, through the proxy on the real vLLM CPU server: the OpenAI Agents
SDK and a LangGraph agent on langchain-openai, each over Chat Completions and over Responses,
running a tool and answering. Every model call they make is recorded with its tokens.

SmolLM2-135M does not call tools on its own, so the first turn forces the tool (the Agents SDK
then resets tool_choice itself). Strict tool schemas: without them this vLLM build lets the model
write arguments such as `[1, 2, 3]`, which LangChain cannot even parse.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from benchmarks.support.stack import RunningProxy, Upstream

pytestmark = pytest.mark.vllm

TASK = "Use the add tool to add 2 and 3."


def assert_every_call_recorded(proxy: RunningProxy, key: str, api: str, model_calls: int) -> list[dict[str, Any]]:
    """The session's calls: as many as the library made, all complete; the tool arguments
    the model wrote, as recorded."""
    calls = proxy.calls(key)
    assert len(calls) == model_calls and [c.seq for c in calls] == list(range(1, model_calls + 1))
    for call in calls:
        assert call.ok and call.api == api and call.prompt_token_ids
        tokens = call.completions[0]
        assert tokens.token_ids and len(tokens.logprobs) == len(tokens.token_ids)
    # Each turn's prompt holds the turn before (the tool result added to it).
    assert len(calls[1].prompt_token_ids) > len(calls[0].prompt_token_ids)
    response = calls[0].response or {}
    if api == "chat.completions":
        return [json.loads(t["function"]["arguments"]) for t in response["choices"][0]["message"]["tool_calls"]]
    return [json.loads(item["arguments"]) for item in response["output"] if item["type"] == "function_call"]


@pytest.mark.parametrize("api", ["openai.responses", "chat.completions"])
def test_openai_agents_sdk_runs_a_tool_agent(proxy: RunningProxy, vllm: Upstream, api: str) -> None:
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel
    from agents.models.openai_responses import OpenAIResponsesModel
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    seen: list[tuple[int, int]] = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        seen.append((a, b))
        return a + b

    key = f"agents-{api}"
    client = AsyncOpenAI(base_url=proxy.v1, api_key=key, max_retries=0)
    kind = OpenAIResponsesModel if api == "openai.responses" else OpenAIChatCompletionsModel
    agent = Agent(
        name="adder",
        tools=[add],
        model=kind(model="gpt-4.1", openai_client=client),
        model_settings=ModelSettings(temperature=0, max_tokens=60, tool_choice="add"),
    )
    result = asyncio.run(Runner.run(agent, TASK, max_turns=4))
    assert isinstance(result.final_output, str) and result.final_output
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    arguments = assert_every_call_recorded(proxy, key, api, model_calls=2)
    assert [(a["a"], a["b"]) for a in arguments] == seen  # the tool ran with what the model wrote
    assert proxy.calls(key)[0].rewrites["model"] == ["gpt-4.1", vllm.model]


@pytest.mark.parametrize("api", ["openai.responses", "chat.completions"])
def test_langgraph_agent_on_langchain_openai(proxy: RunningProxy, vllm: Upstream, api: str) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    key = f"langgraph-{api}"
    llm = ChatOpenAI(
        base_url=proxy.v1,
        api_key=key,
        model=vllm.model,
        temperature=0,
        max_tokens=60,
        max_retries=0,
        use_responses_api=api == "openai.responses",
    )

    def agent(state: MessagesState) -> dict[str, Any]:
        first = not any(isinstance(m, ToolMessage) for m in state["messages"])
        model = llm.bind_tools([add], tool_choice="add" if first else "auto", strict=True)
        return {"messages": [model.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([add]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    out = graph.compile().invoke({"messages": [HumanMessage(TASK)]}, {"recursion_limit": 8})
    kinds = [type(m).__name__ for m in out["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    [arguments] = assert_every_call_recorded(proxy, key, api, model_calls=2)
    assert out["messages"][2].content == str(arguments["a"] + arguments["b"])
