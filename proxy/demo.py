"""`make demo`: a short look at the proxy alone (the main job is `make train`): vLLM + proxy on
the embedded default, one recorded agent session driven by the real openai SDK, then where the
data went.

The session is a small tool-using episode: the model is asked to add two numbers with a tool,
the tool's result goes back, and the final answer is streamed. A reward (1 if the answer holds
the right number) is posted through the admin API, as a harness or verifier would.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
from openai import OpenAI

from proxy.app import create_app
from proxy.server import AppThread, backend_for
from proxy.settings import Settings

ADD_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers and return the sum.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def _add(arguments: str) -> str:
    try:
        args = json.loads(arguments)
        values = list(args.values()) if isinstance(args, dict) else list(args)
        return str(sum(int(v) for v in values))
    except (ValueError, TypeError):
        return f'error: add takes {{"a": <integer>, "b": <integer>}}, not {arguments}'


def episode(client: OpenAI, model: str, a: int, b: int) -> str:
    """One agent episode through the proxy; returns the final answer."""
    messages: list[Any] = [
        {"role": "system", "content": "You are a careful assistant. Use the add tool for sums."},
        {"role": "user", "content": f"What is {a} + {b}?"},
    ]
    first = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[ADD_TOOL],
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=48,
        temperature=0,
    )
    reply = first.choices[0].message
    messages.append(reply.model_dump(exclude_none=True))
    for call in reply.tool_calls or []:
        arguments = call.function.arguments if call.type == "function" else ""
        result = _add(arguments)
        print(f"  tool call add({arguments}) -> {result}")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=48,
        temperature=0,
        stream=True,
    )
    answer = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    print(f"  answer (streamed): {answer!r}")
    return answer


def run_demo(settings: Settings) -> int:
    with backend_for(settings) as (settings, _vllm), AppThread(create_app(settings)) as proxy:
        session = f"demo-{int(time.time())}"
        key = f"run=demo,task=add-17-25,group=add-17-25,id={session}"
        print(f"proxy on {proxy.url}/v1; session key {key!r}")
        client = OpenAI(base_url=f"{proxy.url}/v1", api_key=key)
        model = settings.served_model_name or client.models.list().data[0].id
        answer = episode(client, model, 17, 25)
        reward = 1.0 if "42" in answer else 0.0
        httpx.post(f"{proxy.url}/admin/sessions/{session}/reward", json={"value": reward, "source": "demo"})
        info = httpx.get(f"{proxy.url}/admin/sessions/{session}").json()
    print(f"\nrecorded session {session}: {info['calls']} calls, reward {info['reward']}")
    print(f"database: {settings.db}")
    db = settings.db
    print("inspect:  rl-proxy sessions show", session, f"--db '{db}'")
    print("export:   rl-proxy export --format jsonl --out calls.jsonl", f"--db '{db}'")
    return 0 if info["calls"] >= 2 else 1
