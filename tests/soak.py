"""Soak and store benchmark: many sessions making multi-turn calls through `rl-proxy serve`.

The upstream is the STUB (tests/stub_upstream.py, not vLLM) in its own process, answering after
a fixed delay: the proxy and its store are under load, not a model. Each session talks one API
(Chat Completions whole or streamed, Anthropic Messages, or Responses chained by
previous_response_id) and sends its whole history every turn, for episodes of 24 turns, one
session after another. Afterwards the store is read back and every answered call checked:
there, in order, with the client's own turn in its request, the answer's id the client got and
the stub's tokens. The proxy's RSS is sampled every second.

  python -m tests.soak --seconds 150            # `make soak`: SQLite, then PostgreSQL
  python -m tests.soak --bench                  # `make bench`: calls/s and added latency
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from proxy.backend import free_port
from tests.bench_proxy import p99, process
from tests.conftest import new_database, read_store
from tests.postgres import temp_postgres
from tests.stub_upstream import COMPLETION, MODEL

KINDS = ("chat", "chat-stream", "messages", "responses")
TURNS = 24  # per episode (session)


@dataclass
class Load:
    """What the clients saw: (session, turn, reply id) per answered call, latencies, errors,
    and the proxy's RSS in MB once a second."""

    answered: list[tuple[str, int, str]] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    rss: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return len(self.answered) / self.seconds


def request(kind: str, ask: str, history: list[Any], previous: str | None) -> tuple[str, dict[str, Any]]:
    if kind == "responses":
        body = {"model": MODEL, "input": ask, "max_output_tokens": 16}
        return "responses", body | ({"previous_response_id": previous} if previous else {})
    history.append({"role": "user", "content": ask})
    if kind == "messages":
        return "messages", {"model": MODEL, "messages": history, "max_tokens": 16}
    return "chat/completions", {"model": MODEL, "messages": history, "max_tokens": 16, "stream": kind == "chat-stream"}


def reply(kind: str, raw: bytes) -> tuple[str, str]:
    """The answer's id and text, as the client reads them."""
    if kind == "chat-stream":
        chunks = [orjson.loads(line[5:]) for line in raw.splitlines() if line.startswith(b"data: {")]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        return chunks[0]["id"], text
    data = orjson.loads(raw)
    if kind == "messages":
        return data["id"], data["content"][0]["text"]
    if kind == "responses":
        return data["id"], data["output"][0]["content"][0]["text"]
    return data["id"], data["choices"][0]["message"]["content"]


async def converse(http: aiohttp.ClientSession, base: str, worker: str, kind: str, until: float, load: Load) -> None:
    """Episodes of TURNS turns, one after another (an agent's context does not grow forever)."""
    episode = turn = 0
    while time.monotonic() < until:
        if turn % TURNS == 0:
            episode, turn, history, previous = episode + 1, 0, [], None
            session = f"{worker}-{episode}"
        turn += 1
        path, body = request(kind, f"{session} turn {turn}", history, previous)
        start = time.perf_counter()
        try:
            async with http.post(f"{base}/{path}", json=body, headers={"x-api-key": session}) as resp:
                raw = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            load.errors.append(f"{session} turn {turn}: {exc!r}")
            return
        if resp.status != 200:
            load.errors.append(f"{session} turn {turn}: {resp.status} {raw[:300]!r}")
            return
        load.latencies.append((time.perf_counter() - start) * 1000)
        previous, text = reply(kind, raw)
        if kind != "responses":
            history.append({"role": "assistant", "content": text})
        load.answered.append((session, turn, previous))


async def run_load(base: str, sessions: int, seconds: float, kinds: tuple[str, ...], pid: int | None) -> Load:
    """`sessions` concurrent conversations for `seconds` (each finishes the call it is in)."""
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
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=sessions), timeout=timeout) as http:
        run = f"{time.monotonic_ns() % 10**8:x}"
        await asyncio.gather(*(converse(http, base, f"soak-{run}-{i}", kinds[i % len(kinds)], until, load)
                               for i in range(sessions)))  # fmt: skip
    load.seconds = time.monotonic() - started
    sampler.cancel()
    return load


def verify(db: str, load: Load) -> list[str]:
    """Every answered call in the store, whole and in its place; problems as sentences."""

    async def calls(store: Any) -> list[Any]:
        return [c async for c in store.iter_calls()]

    by_turn = {(c.session_id, c.seq): c for c in read_store(db, calls)}
    problems = []
    for session, turn, reply_id in load.answered:
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
        cmd = [sys.executable, "-m", "tests.stub_upstream", "--port", str(port), "--latency", str(latency)]
        stack.enter_context(process(cmd, f"http://127.0.0.1:{port}/v1/models", work / "stub.log"))
        dbs = {}
        for kind in stores:
            if kind == "sqlite":
                dbs[kind] = str(work / "soak.db")
            else:
                dbs[kind] = new_database(stack.enter_context(temp_postgres()).url)
        yield f"http://127.0.0.1:{port}/v1", dbs


@contextmanager
def proxy(upstream: str, db: str, log: Path) -> Iterator[tuple[str, int]]:
    port = free_port()
    cmd = [sys.executable, "-m", "proxy.cli", "serve", "--upstream", upstream, "--db", db, "--port", str(port)]
    with process(cmd, f"http://127.0.0.1:{port}/healthz", log) as proc:
        yield f"http://127.0.0.1:{port}/v1", proc.pid


def soak(stores: list[str], sessions: int, seconds: float, latency: float) -> list[dict[str, Any]]:
    """One soak per store kind: rows for the table, with the problems found."""
    rows = []
    with stack(stores, latency) as (upstream, dbs):
        for kind, db in dbs.items():
            with proxy(upstream, db, Path(tempfile.mkdtemp()) / "proxy.log") as (base, pid):
                load = asyncio.run(run_load(base, sessions, seconds, KINDS, pid))
            problems = load.errors + verify(db, load)
            third = max(1, len(load.rss) // 3)
            rows.append({
                "store": kind, "calls": len(load.answered), "rate": load.rate, "problems": problems,
                "p50": statistics.median(load.latencies), "p99": p99(load.latencies),
                "rss_early": statistics.median(load.rss[third:2 * third] or load.rss),
                "rss_late": statistics.median(load.rss[-third:]),
            })  # fmt: skip
    return rows


def bench(sessions: int, seconds: float, rounds: int, latency: float) -> None:
    """Calls/s recorded into each store at `sessions` clients, and the latency the proxy adds
    over a direct call to the stub; rounds alternate between targets against machine noise."""
    samples: dict[str, list[Load]] = {"direct": [], "sqlite": [], "postgresql": []}
    with stack(["sqlite", "postgresql"], latency) as (upstream, dbs), ExitStack() as running:
        bases = {"direct": upstream}
        for kind, db in dbs.items():
            bases[kind], _ = running.enter_context(proxy(upstream, db, Path(tempfile.mkdtemp()) / "proxy.log"))
        for round_ in range(rounds):
            for name, base in bases.items():
                samples[name].append(asyncio.run(run_load(base, sessions, seconds, ("chat",), None)))
            print(f"  round {round_ + 1}/{rounds} done", file=sys.stderr)
        problems = {kind: [p for load in samples[kind] for p in verify(db, load)] for kind, db in dbs.items()}
    direct = statistics.median(x for load in samples["direct"] for x in load.latencies)
    print(f"\nCalls recorded per second at {sessions} concurrent clients, multi-turn chat (stub upstream: "
          f"fixed {latency * 1000:.0f} ms, not vLLM; {rounds} interleaved rounds of {seconds:.0f} s)\n")  # fmt: skip
    print("| target | calls/s (median of rounds) | latency median ms | p99 ms | added median ms | lost or mismatched |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, loads in samples.items():
        values = [x for load in loads for x in load.latencies]
        lost = "-" if name == "direct" else str(len(problems[name]))
        print(f"| {name if name == 'direct' else f'rl-proxy + {name}'} | "
              f"{statistics.median(load.rate for load in loads):.0f} | {statistics.median(values):.1f} | "
              f"{p99(values):.1f} | {statistics.median(values) - direct:.1f} | {lost} |")  # fmt: skip
    if any(problems.values()):
        sys.exit(f"calls were lost or mismatched: {problems}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=150.0, help="per store (soak) or per round (bench: 10)")
    parser.add_argument("--latency", type=float, default=0.02, help="stub upstream latency, seconds")
    parser.add_argument("--stores", nargs="+", default=["sqlite", "postgresql"], choices=["sqlite", "postgresql"])
    parser.add_argument("--bench", action="store_true", help="the store benchmark table instead of the soak")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.bench:
        bench(args.sessions, min(args.seconds, 10.0), args.rounds, args.latency)
        return
    rows = soak(args.stores, args.sessions, args.seconds, args.latency)
    print(f"\nSoak: {args.sessions} sessions x {args.seconds:.0f} s per store, multi-turn, four APIs "
          f"(stub upstream: fixed {args.latency * 1000:.0f} ms, not vLLM)\n")  # fmt: skip
    print("| store | calls | calls/s | p50 ms | p99 ms | proxy RSS, 2nd third → last third, MB | lost or mismatched |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['store']} | {r['calls']} | {r['rate']:.0f} | {r['p50']:.1f} | {r['p99']:.1f} | "
              f"{r['rss_early']:.0f} → {r['rss_late']:.0f} | {len(r['problems'])} |")  # fmt: skip
    problems = [p for r in rows for p in r["problems"]]
    for problem in problems[:20]:
        print(problem, file=sys.stderr)
    if problems:
        sys.exit(f"{len(problems)} problems")


if __name__ == "__main__":
    main()
