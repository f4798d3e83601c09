"""Agent sessions the token-in tests and benchmark drive through a proxy: each call sends the whole
conversation again, as a harness does."""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import anthropic
from openai import OpenAI

from benchmarks.support.samples import ADD_TOOL, FORCE_ADD
from harness_adapters.config import CollectConfig, load_config
from harness_adapters.harnesses import CommandAdapter, command_env
from harness_adapters.runner import EpisodeRunner
from harness_adapters.tasks import load_tasks
from recorder import CallRecord
from recorder.episodes import Sampling
from recorder.trajectories import TrainingSequence
from trainer.config import TrainConfig

ASK = [{"role": "user", "content": "Add 2 and 3 with the add tool, then add 4 to the result."}]
ADD = {"name": "add", "description": "Add two integers.", "input_schema": ADD_TOOL["function"]["parameters"]}


def tool_session(url: str | list[str] | Callable[[int], str], key: str, model: str, stream: bool = False) -> None:
    """Three calls of the openai SDK: two forced `add` calls answered with tool results, then one
    free answer, each call sending the whole conversation again as a harness does; with several
    URLs (proxies), call n goes to the n-th, as a load balancer would send them; or to what
    `url(n)` answers."""
    urls = [url] if isinstance(url, str) else url
    messages: list[dict[str, Any]] = list(ASK)
    for turn in range(3):
        base = url(turn) if callable(url) else urls[turn % len(urls)]
        client = OpenAI(base_url=base, api_key=key, max_retries=0)
        kwargs: Any = dict(
            model=model,
            messages=messages,
            tools=[ADD_TOOL],
            max_tokens=80,
            temperature=0,
            tool_choice=FORCE_ADD if turn < 2 else "auto",
        )
        if stream:
            with client.chat.completions.stream(**kwargs) as streamed:
                final = streamed.get_final_completion()
        else:
            final = client.chat.completions.create(**kwargs)
        message = final.choices[0].message
        messages.append(message.model_dump(exclude_none=True, exclude={"parsed"}))
        messages += [{"role": "tool", "tool_call_id": t.id, "content": "5"} for t in message.tool_calls or []]


def anthropic_session(url: str, key: str, model: str) -> None:
    """A forced `add` tool_use, its tool_result, and the answer after it (the anthropic SDK)."""
    claude = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
    ask: list[dict[str, Any]] = [{"role": "user", "content": "Use the add tool to add 2 and 3."}]
    greedy: Any = {"extra_body": {"temperature": 0}, "tools": [ADD], "model": model}
    forced = {"type": "tool", "name": "add"}
    with claude.messages.stream(max_tokens=60, messages=ask, tool_choice=forced, **greedy) as s:  # type: ignore[arg-type]
        reply = s.get_final_message()
    [use] = [b for b in reply.content if b.type == "tool_use"]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "5"}
    follow = [*ask, {"role": "assistant", "content": [use.model_dump()]}, {"role": "user", "content": [result]}]
    claude.messages.create(max_tokens=12, messages=follow, **greedy)


def responses_session(url: str, key: str, model: str) -> None:
    """A forced function call through the Responses API, its output sent with
    `previous_response_id`, then one more turn the same way."""
    client = OpenAI(base_url=url, api_key=key, max_retries=0)
    tool = {
        "type": "function",
        "name": "add",
        "description": "Add two integers.",
        "parameters": ADD_TOOL["function"]["parameters"],
    }
    first = client.responses.create(
        model=model,
        input="Use the add tool to add 2 and 3.",
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "add"},
        max_output_tokens=80,
        temperature=0,
    )
    [called] = [item for item in first.output if item.type == "function_call"]
    result = {"type": "function_call_output", "call_id": called.call_id, "output": "5"}
    second = client.responses.create(
        model=model,
        previous_response_id=first.id,
        input=[result],
        tools=[tool],  # type: ignore[list-item]
        max_output_tokens=16,
        temperature=0,
    )
    client.responses.create(
        model=model,
        previous_response_id=second.id,
        input="And 4 more?",
        tools=[tool],  # type: ignore[list-item]
        max_output_tokens=16,
        temperature=0,
    )


def text_session(url: str, key: str, model: str, turns: int = 4, temperature: float = 1.0) -> None:
    """Plain multi-turn chat, at temperature 1 unless told."""
    client = OpenAI(base_url=url, api_key=key, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Tell me about the sea."}]
    for _ in range(turns):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=temperature)  # type: ignore[arg-type]
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "Go on."},
        ]


THINK_TEMPLATE = (Path(__file__).parent / "think_template.jinja").read_text()
# SmolLM2's template, except that earlier assistant turns lose their <think> blocks (as Qwen3's
# does), sent with each request; the answers are made to think by a regex.
THINKING = {
    "chat_template": THINK_TEMPLATE,
    "structured_outputs": {"regex": r"<think>[a-z ]{4,40}</think>[A-Za-z ,.]{4,40}"},
}


def think_session(url: str, key: str, model: str) -> None:
    """Four turns whose answers think first; the harness sends them back whole or stripped of
    their thinking, turn about."""
    client = OpenAI(base_url=url, api_key=key, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Think, then name a colour."}]
    for turn in range(4):
        reply = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=60,
            temperature=0,  # type: ignore[call-overload]
            extra_body=THINKING,
        )
        answer = reply.choices[0].message.content
        assert "</think>" in answer and reply.choices[0].finish_reason == "stop", answer
        shown = answer if turn % 2 else answer.split("</think>")[-1].strip()
        messages += [{"role": "assistant", "content": shown}, {"role": "user", "content": "And another?"}]


ROOT = Path(__file__).resolve().parents[2]
SHELL = ROOT / "harness_adapters" / "examples" / "shell"
HARNESS_BIN = ROOT / ".harnesses" / "node_modules" / ".bin"  # Claude Code and Codex (make install)
FORCED = Sampling(tool_choice="required")  # SmolLM2-135M seldom calls a tool of its own accord


def harness_session(
    config: str,
    *extra: str,
    sampling: Sampling | None = None,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> Callable[..., str | None]:
    """A session of a real CLI harness, as the shell example's `config` runs it (in its sandbox),
    on a rename task, with `extra` arguments and `env` variables; returns a family's runner
    (proxy URL, run name, model, and `stop`, an optional threading.Event), which answers the
    session id. A harness that never stops by itself (Codex under forced tool calls) is stopped at
    `timeout`, or once `stop` is set (the runner then answers None: find the session by its run
    name); the call cut then fails as "client disconnected"."""
    task = next(t for t in load_tasks(SHELL / "tasks.jsonl") if t.id == "rename-3")
    adapter = load_config(SHELL / config, TrainConfig if config.startswith("train") else CollectConfig).adapter()
    assert isinstance(adapter, CommandAdapter)
    path = f"{HARNESS_BIN}{os.pathsep}{command_env()['PATH']}"
    adapter = replace(adapter, argv=[*adapter.argv, *extra], env={**adapter.env, "PATH": path, **(env or {})})

    def run(url: str, key: str, model: str, stop: threading.Event | None = None) -> str | None:
        workdir = Path(tempfile.mkdtemp(prefix="rlp-harness-"))
        runner = EpisodeRunner(url, adapter, [], model, workdir, key, timeout=timeout, sampling=sampling)

        async def play() -> str | None:
            episode = asyncio.ensure_future(runner.run_all([task], 1))
            while not episode.done() and not (stop is not None and stop.is_set()):
                await asyncio.wait({episode}, timeout=1)
            if not episode.done():  # stopped: the harness's process group is killed
                episode.cancel()
                await asyncio.gather(episode, return_exceptions=True)
                return None
            [result] = episode.result()
            assert result.calls, f"{config}: no call reached the proxy: {result.outcome}"
            return result.session_id

        return asyncio.run(play())

    return run


def masked_in(sequence: TrainingSequence) -> list[int]:
    """The ids a training sequence trains on (loss mask 1)."""
    return [t for t, m in zip(sequence.input_ids, sequence.loss_mask, strict=True) if m]


def sampled(sequence: TrainingSequence, calls: list[CallRecord]) -> list[int]:
    """The ids its calls sampled, span by span: what `masked_in` must equal."""
    by_seq = {c.seq: c for c in calls}
    return [t for span in sequence.spans for t in by_seq[span.seq].completions[0].token_ids]


# Claude Code's own general-purpose subagent, given only Bash and Read and two turns, so that a
# subagent started under a forced Agent call cannot start one in turn, and ends.
SUBAGENT = """---
name: general-purpose
description: General-purpose agent for researching questions and running commands.
tools: Bash, Read
maxTurns: 2
---
You are a helpful agent. Do the task you are given with your tools, then answer in one sentence.
"""
# A short system prompt and three tools: Claude Code's own prompt is 7,600 of SmolLM2's 8,192
# tokens, which leaves its compaction call (the whole conversation again) no room.
CLAUDE_ARGS = [
    "--model",
    "claude-sonnet-4-5",
    "--system-prompt",
    "You are a coding agent. Use your tools, then answer.",
]


def claude_code_branching(
    base_url: str, key: str, home: Path, task: str, timeout: float = 600, compact: bool = True
) -> list[str]:
    """One Claude Code session that branches as real ones do, in three runs of `claude -p` on one
    proxy session (`key`, whose sampling forces the `Agent` tool where offered): the task, where
    the main loop starts subagents (2 turns); `/compact`, Claude Code's compaction (Agent is not
    offered, so the summary is free text); and "Go on." after it, from the summary (1 turn).
    Without `compact`, the first run alone. Returns what each run printed."""
    project = home / "project"
    (project / ".claude" / "agents").mkdir(parents=True, exist_ok=True)
    (project / ".claude" / "agents" / "general-purpose.md").write_text(SUBAGENT)
    (project / "notes.txt").write_text("remember the milk\n")
    env = {
        **os.environ,
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": key,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    session = str(uuid.uuid4())
    # And the most each call may sample. An Agent call takes about 60 tokens; a subagent's answer
    # runs to the cap and Claude Code asks it to go on three times, so the cap sets the time
    # (200: 8 calls of 13 s on 2 cores). A summary cut short fails the compaction (a 135M
    # model's ran past 1,000 tokens in some runs; then the test checks the rest).
    runs = [
        ([task, "--session-id", session, "--tools", "Agent,Bash,Read", "--max-turns", "2"], 120),
        (["/compact Summarize in one short sentence.", "--resume", session, "--tools", "Bash,Read"], 400),
        (["Go on.", "--resume", session, "--tools", "Bash,Read", "--max-turns", "1"], 120),
    ]
    printed = []
    for args, most in runs if compact else runs[:1]:
        done = subprocess.run(
            [str(HARNESS_BIN / "claude"), "-p", *args, *CLAUDE_ARGS],
            env={**env, "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(most)},
            cwd=project,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        printed.append(done.stdout + done.stderr)
    return printed
