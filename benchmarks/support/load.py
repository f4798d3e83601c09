"""The load generator of the soaks (benchmarks/soak.py, benchmarks/soak_scale.py) and of the
tests that run them briefly: many sessions making multi-turn calls through `rl-proxy serve` on
the STUB upstream (not vLLM), each on one API (Chat Completions, Anthropic Messages, Responses
chained by previous_response_id, text Completions; whole or streamed), a failed call sent again
as a harness would, and the check that every answered call is in the store, whole and in its
place."""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from benchmarks.support.postgres import temp_postgres
from benchmarks.support.stack import new_database, process, read_store
from benchmarks.support.stub_upstream import COMPLETION, MODEL
from proxy.vllm import free_port

KINDS = ("chat", "chat-stream", "messages", "responses")  # the one-proxy soak's
ALL_KINDS = tuple(
    f"{api}{mode}" for api in ("chat", "messages", "responses", "completions") for mode in ("", "-stream")
)
PATHS = {"chat": "chat/completions", "messages": "messages", "responses": "responses", "completions": "completions"}
TURNS = 24  # per episode (session)
RETRY_AFTER = 0.5  # seconds a client waits before sending a failed call again
LATE = 120.0  # seconds past its end that a session may go on to make its `min_turns` calls


@dataclass
class Load:
    """What the clients saw: (session, turn, kind, reply id) per answered call, latencies (ms,
    from a call's first try to its answer), failed tries by what was seen, errors (calls that
    failed every try), and the proxy's RSS in MB once a second."""

    answered: list[tuple[str, int, str, str]] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    rss: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return len(self.answered) / self.seconds


def request(kind: str, ask: str, history: list[Any], previous: str | None) -> tuple[str, dict[str, Any]]:
    api, stream = kind.removesuffix("-stream"), kind.endswith("-stream")
    body: dict[str, Any] = {"model": MODEL, "stream": stream}
    if api == "responses":
        body |= {"input": ask, "max_output_tokens": 16} | ({"previous_response_id": previous} if previous else {})
    elif api == "completions":
        history.append(ask)
        body |= {"prompt": "\n".join(history), "max_tokens": 16}
    else:
        history.append({"role": "user", "content": ask})
        body |= {"messages": history, "max_tokens": 16}
    return PATHS[api], body


def reply(kind: str, raw: bytes) -> tuple[str, str]:
    """The answer's id and text as the client reads them; raises on an answer cut short."""
    api = kind.removesuffix("-stream")
    if not kind.endswith("-stream"):
        data = orjson.loads(raw)
        text = {
            "chat": lambda: data["choices"][0]["message"]["content"],
            "completions": lambda: data["choices"][0]["text"],
            "messages": lambda: data["content"][0]["text"],
            "responses": lambda: data["output"][0]["content"][0]["text"],
        }[api]()
        return str(data["id"]), str(text)
    events = [orjson.loads(line[6:]) for line in raw.splitlines() if line.startswith(b"data: {")]
    if api in ("chat", "completions"):
        if b"data: [DONE]" not in raw:
            raise ValueError("stream cut short")
        choices = [e["choices"][0] for e in events if e.get("choices")]
        return events[0]["id"], "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices)
    if api == "messages":
        if not any(e["type"] == "message_stop" for e in events):
            raise ValueError("stream cut short")
        start = next(e for e in events if e["type"] == "message_start")
        deltas = [e["delta"].get("text") or "" for e in events if e["type"] == "content_block_delta"]
        return start["message"]["id"], "".join(deltas)
    done = next(e["response"] for e in events if e["type"] == "response.completed")
    return done["id"], done["output"][0]["content"][0]["text"]


async def converse(
    http: aiohttp.ClientSession,
    base: str,
    worker: str,
    kind: str,
    until: float,
    load: Load,
    tries: int = 1,
    min_turns: int = 0,
) -> None:
    """Sessions of TURNS turns, one after another, until `until` (an agent's context does not
    grow forever), and on to `min_turns` calls on a slow machine, for LATE seconds more at most.
    A failed call is sent again after RETRY_AFTER, `tries` times in all, as a harness retries;
    one that fails them all is an error and ends the worker."""
    episode = turn = calls = 0
    history: list[Any] = []
    previous = session = None
    while (now := time.monotonic()) < until or (calls < min_turns and now < until + LATE):
        if turn % TURNS == 0:
            episode, turn, history, previous = episode + 1, 0, [], None
            session = f"{worker}-{episode}"
        turn += 1
        path, body = request(kind, f"{session} turn {turn}", history, previous)
        start = time.perf_counter()
        for attempt in range(tries):
            try:
                async with http.post(f"{base}/{path}", json=body, headers={"x-api-key": str(session)}) as resp:
                    raw = await resp.read()
                if resp.status == 200:
                    previous, text = reply(kind, raw)
                    break
                seen, failed = f"HTTP {resp.status}", f"{resp.status} {raw[:300]!r}"
            except (TimeoutError, aiohttp.ClientError) as exc:
                seen, failed = type(exc).__name__, repr(exc)
            except (ValueError, KeyError, IndexError, StopIteration):
                seen = failed = "answer cut short"
            load.failures[seen] += 1
            if attempt < tries - 1:
                await asyncio.sleep(RETRY_AFTER)
        else:
            load.errors.append(f"{session} turn {turn}: {failed}")
            return
        calls += 1
        load.latencies.append((time.perf_counter() - start) * 1000)
        load.answered.append((str(session), turn, kind, previous))
        if kind.startswith("completions"):
            history.append(text)
        elif not kind.startswith("responses"):
            history.append({"role": "assistant", "content": text})


async def run_load(
    base: str, sessions: int, seconds: float, kinds: tuple[str, ...], pid: int | None, min_turns: int = 0
) -> Load:
    """`sessions` concurrent conversations for `seconds` (each finishes the call it is in), each
    of `min_turns` calls at least."""
    load = Load()
    until = time.monotonic() + seconds
    started = time.monotonic()

    async def sample() -> None:
        while pid is not None:
            rss = next(
                line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS")
            )
            load.rss.append(int(rss.split()[1]) / 1024)
            await asyncio.sleep(1.0)

    sampler = asyncio.create_task(sample())
    timeout = aiohttp.ClientTimeout(total=120)
    run = f"{time.monotonic_ns() % 10**8:x}"

    async def client(i: int) -> None:
        # A connection of its own, as each agent has its own HTTP client: so a session's calls
        # reach one worker of `serve --workers N`, as they reach one proxy behind a sticky balancer.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), timeout=timeout) as http:
            await converse(http, base, f"soak-{run}-{i}", kinds[i % len(kinds)], until, load, min_turns=min_turns)

    await asyncio.gather(*(client(i) for i in range(sessions)))
    load.seconds = time.monotonic() - started
    sampler.cancel()
    return load


def verify(db: str, load: Load) -> list[str]:
    """Every answered call in the store, whole and in its place; problems as sentences."""

    async def calls(store: Any) -> list[Any]:
        return [c async for c in store.iter_calls()]

    by_turn = {(c.session_id, c.seq): c for c in read_store(db, calls)}
    problems = []
    for session, turn, _, reply_id in load.answered:
        call = by_turn.get((session, turn))
        if call is None:
            problems.append(f"lost: {session} turn {turn}")
            continue
        asked = call.request.get("input") or call.request["messages"][-1]["content"]
        whole = call.ok and all(c.token_ids == COMPLETION and len(c.logprobs) == 8 for c in call.completions)
        if asked != f"{session} turn {turn}" or (call.response or {}).get("id") != reply_id or not whole:
            problems.append(f"mismatched: {session} turn {turn} recorded as {asked!r}, ok={call.ok}")
    return problems


@contextmanager
def stack(stores: list[str], latency: float) -> Iterator[tuple[str, dict[str, str]]]:
    """The stub upstream and a database URL per store kind."""
    work = Path(tempfile.mkdtemp(prefix="rlp-soak-"))
    port = free_port()
    with ExitStack() as stack:
        cmd = [sys.executable, "-m", "benchmarks.support.stub_upstream", "--port", str(port), "--latency", str(latency)]
        stack.enter_context(process(cmd, f"http://127.0.0.1:{port}/v1/models", work / "stub.log"))
        dbs = {}
        for kind in stores:
            if kind == "sqlite":
                dbs[kind] = str(work / "soak.db")
            else:
                dbs[kind] = new_database(stack.enter_context(temp_postgres()).url)
        yield f"http://127.0.0.1:{port}/v1", dbs


@contextmanager
def proxy(upstream: str, db: str, log: Path, *options: str) -> Iterator[tuple[str, int]]:
    """`rl-proxy serve` in front of `upstream` (with `options`, say --messages-mode), warmed up."""
    port = free_port()
    serve = ["serve", "--upstream", upstream, "--db", db, "--port", str(port), *options]
    cmd = [sys.executable, "-m", "proxy.cli", *serve]
    with process(cmd, f"http://127.0.0.1:{port}/healthz", log) as proc:
        base = f"http://127.0.0.1:{port}/v1"
        # A call of each kind first: the first Messages or Responses call loads litellm's
        # translators (about 75 MB, once), which a soak must not count as growth.
        warm = asyncio.run(run_load(base, len(ALL_KINDS), 0, ALL_KINDS, None, min_turns=1))
        if warm.errors:
            raise RuntimeError(f"the proxy's first calls failed: {warm.errors[:3]}")
        yield base, proc.pid


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]
