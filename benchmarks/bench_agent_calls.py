"""The proxy's own CPU on agent-sized calls (`make bench-agent-calls`): one client continues a
coding agent's conversation through `rl-proxy serve` for `--turns` turns (a user or tool text of
about 2.8 KB a turn, then the model's answer), in front of the STUB upstream (not vLLM) making
prompts as long as a real template's (an id per 4 bytes of text: 118k ids at 160 turns) and
bridging token-in's threads as rl-proxy's vLLM plugin does. At each sampled turn, the CPU the
proxy's process spent on that one call (every thread's, and its event loop's alone, from
/proc's per-thread schedstat, in ns) and the time it added over the same request sent directly
to the stub as chat; medians over `--sessions` sessions: chat with token-in and in messages mode,
and Anthropic's Messages (Claude Code's API) with token-in.

A short chat (the overhead and store benchmarks' load) costs the proxy about 1 ms a call; here
the prompt's ids cross the proxy's event loop whole, several times a call.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import string
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path
from random import Random
from typing import Any

import aiohttp
import orjson

from benchmarks.support.load import proxy
from benchmarks.support.stack import process
from benchmarks.support.stub_upstream import MODEL
from proxy.vllm import free_port

BYTES_A_TOKEN = 4
SAMPLED = (10, 40, 80, 160)  # turns at which a call is measured
PATHS = {"chat": "chat/completions", "messages": "messages"}


def cpu_ns(pid: int) -> dict[int, int]:
    """Each thread's CPU time so far, ns (the first field of /proc's schedstat)."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            times[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
    return times


def spent(pid: int, before: dict[int, int]) -> tuple[float, float]:
    """ms of CPU since `before`: every thread's, and the event loop's (the main thread's)."""
    after = cpu_ns(pid)
    total = sum(ns - before.get(tid, 0) for tid, ns in after.items())
    return total / 1e6, (after[pid] - before.get(pid, 0)) / 1e6


async def post(http: aiohttp.ClientSession, url: str, key: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    start = time.perf_counter()
    async with http.post(url, data=orjson.dumps(body), headers=headers) as resp:
        raw = await resp.read()
        if resp.status != 200:
            raise SystemExit(f"{url} answered {resp.status}: {raw[:300]!r}")
    return orjson.loads(raw), (time.perf_counter() - start) * 1000


async def session(
    base: str, stub: str, pid: int, key: str, turns: int, rng: Random, api: str
) -> dict[int, dict[str, float]]:
    """One conversation of `turns` calls on `api` (chat or Anthropic's messages); at each sampled
    turn: the proxy's CPU a call, its loop's, the latency it added over the same conversation
    sent to the stub as chat, the history's KB and the prompt's ids."""

    def text(n: int) -> str:
        return "".join(rng.choice(string.ascii_letters + string.digits + ' \n"{}()=:.,') for _ in range(n))

    system = text(6000)
    messages: list[dict[str, Any]] = []
    seen: dict[int, dict[str, float]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        for turn in range(1, turns + 1):
            messages.append({"role": "user", "content": text(2800)})
            chat = {"model": MODEL, "messages": [{"role": "system", "content": system}, *messages], "max_tokens": 16}
            body = chat if api == "chat" else {"model": MODEL, "system": system, "messages": messages, "max_tokens": 16}
            before = cpu_ns(pid)
            answer, through = await post(http, f"{base}/{PATHS[api]}", key, body)
            process_ms, loop_ms = spent(pid, before)
            if turn in SAMPLED:
                direct, alone = await post(http, f"{stub}/chat/completions", key, chat | {"return_token_ids": True})
                seen[turn] = {
                    "cpu": process_ms,
                    "loop": loop_ms,
                    "added": through - alone,
                    "kb": len(orjson.dumps(body)) / 1000,
                    "tokens": len(direct["prompt_token_ids"]),
                }
            reply = answer["choices"][0]["message"] if api == "chat" else {"content": answer["content"]}
            messages.append({**reply, "role": "assistant"})
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=max(SAMPLED))
    parser.add_argument("--sessions", type=int, default=3)
    args = parser.parse_args()
    modes = {  # (the API, rl-proxy's options)
        "chat, token-in (bridged upstream)": ("chat", ()),
        "chat, messages mode": ("chat", ("--messages-mode",)),
        "Anthropic Messages, token-in": ("messages", ()),
    }
    found: dict[str, dict[int, list[dict[str, float]]]] = {m: defaultdict(list) for m in modes}
    work = Path(tempfile.mkdtemp(prefix="rlp-agent-calls-"))
    port = free_port()
    stub_cmd = [sys.executable, "-m", "benchmarks.support.stub_upstream", "--port", str(port)]
    stub_cmd += ["--bytes-a-token", str(BYTES_A_TOKEN)]
    stub = f"http://127.0.0.1:{port}/v1"
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, work)
        stack.enter_context(process(stub_cmd, f"{stub}/models", work / "stub.log"))
        proxies = {
            mode: stack.enter_context(proxy(stub, str(work / f"{n}.db"), work / f"proxy-{n}.log", *options))
            for n, (mode, (_, options)) in enumerate(modes.items())
        }
        for s in range(args.sessions):  # the modes take turns, against the machine's drift
            for mode, (base, pid) in proxies.items():
                api = modes[mode][0]
                seen = asyncio.run(session(base, stub, pid, f"agent-{s}", args.turns, Random(s), api))
                for turn, figures in seen.items():
                    found[mode][turn].append(figures)
            print(f"  session {s + 1}/{args.sessions} done", file=sys.stderr, flush=True)
        stored = {mode: sum(f.stat().st_size for f in work.glob(f"{n}.db*")) for n, mode in enumerate(modes)}
    print(
        f"\nThe proxy's CPU on one call of a coding agent's conversation, by its length (STUB upstream, "
        f"an id per {BYTES_A_TOKEN} bytes; medians of {args.sessions} sessions)\n\n"
        "| turns | history KB | prompt ids | mode | CPU ms a call, all threads | of it, the event loop's "
        "| added latency ms |\n|---:|---:|---:|---|---:|---:|---:|"
    )
    for turn in sorted({t for by_turn in found.values() for t in by_turn}):
        for mode, by_turn in found.items():

            def median(name: str, rows: list[dict[str, float]] = by_turn[turn]) -> float:
                return statistics.median(r[name] for r in rows)

            print(
                f"| {turn} | {median('kb'):.0f} | {median('tokens'):,.0f} | {mode} | {median('cpu'):.2f} "
                f"| {median('loop'):.2f} | {median('added'):.2f} |"
            )
    print(f"\nThe store, MB a session of {args.turns} turns (each call's request and prompt ids kept whole):")
    for mode, size in stored.items():
        print(f"- {mode}: {size / args.sessions / 1e6:.0f}")


if __name__ == "__main__":
    main()
