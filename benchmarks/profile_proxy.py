"""Where one call's milliseconds go in rl-proxy (`make bench-profile`): one client calls the
proxy in front of the STUB upstream (benchmarks/support/stub_upstream.py, not vLLM) answering
at once (or after `--latency`), while py-spy samples every thread of the proxy's process; each
sample goes to the part of its deepest frame that names one (PARTS), and a part's CPU time is
divided by the calls made meanwhile. Timed first, in interleaved rounds: the direct call to the
stub, the call through the passthrough floor (benchmarks/support/passthrough.py: the same server
stack forwarding bytes, recording nothing) and the call through rl-proxy. Last, what a hop to a
worker thread and back costs, back to back and after an idle gap.

Two shapes of call: `new` (one user message, a new thread in one session: what the overhead
benchmark sends) and `continuing` (conversations of 8 calls, each continuing the thread of the one
before, so token-in renders it; the profile's calls are 7 in 8 continuing, 1 in 8 new).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import uvloop

from benchmarks.support.passthrough import floor
from benchmarks.support.stack import process
from benchmarks.support.stub_upstream import MODEL
from proxy.vllm import free_port

ROUNDS = 4
RATE = 1000  # py-spy's samples a second
# (part, a frame that puts a sample there): a sample goes to the part of its deepest frame that
# names one (its leaf first), the first part in this order when a frame names two; py-spy's names.
PARTS = [
    ("record: SQLite commit (fsync)", r"^DefaultDialect\.do_commit "),
    ("record: insert (SQLAlchemy Core)", r"^insert_calls "),
    ("record: numbering the calls (two SELECTs, before issue 49)", r"^number_calls "),
    ("record: the writer's other work", r"\(recorder/writer\.py"),
    ("store reads (sessions, token-in's threads)", r"recent_threads|session_by_key|aiosqlite/"),
    ("token-in: render (POST /tokenize)", r"^render \(proxy/"),
    ("token-in: planning", r"^Threads\."),
    ("upstream call (aiohttp client)", r"\(aiohttp/|^open_upstream |^Upstream\.send |^Upstream\.read "),
    ("building the record", r"^Call\.record |^Call\.commit |^Store\.record"),
    ("the proxy's handler, the rest", r"\((proxy|recorder)/"),
    ("the event loop (asyncio's, or uvloop's C code), waiting too", r"\(asyncio/|\(selectors\.py"),
    ("HTTP server (uvicorn, Starlette, FastAPI)", r"\((uvicorn|starlette|fastapi)/"),
    ("a worker thread waiting for work", r"^_worker \(concurrent/futures/thread\.py"),
    ("event loop, threads, the rest", ""),
]


async def calls(
    url: str, turns: int, seconds: float | None = None, count: int | None = None
) -> tuple[list[float], int]:
    """One client's conversations of `turns` calls, each call continuing the one before (a
    session each; with `turns` 1, one session of new threads), for `seconds` or until `count`
    calls are timed: the latencies in ms of the calls after each conversation's first (all of
    them with `turns` 1), and how many calls were made."""
    latencies: list[float] = []
    made = 0
    end = time.monotonic() + seconds if seconds else None
    async with aiohttp.ClientSession() as session:
        while (end is None or time.monotonic() < end) and (count is None or len(latencies) < count):
            key = f"profile-{turns}-{made if turns > 1 else 0}"
            messages: list[dict[str, str]] = []
            for turn in range(turns):
                messages.append({"role": "user", "content": f"Question {turn} of {key}."})
                start = time.perf_counter()
                body = {"model": MODEL, "messages": messages, "max_tokens": 16}
                async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
                    reply = await resp.json()
                    if resp.status != 200:
                        raise RuntimeError(f"{url} answered {resp.status}: {reply}")
                made += 1
                if turns == 1 or turn > 0:
                    latencies.append((time.perf_counter() - start) * 1000)
                answer = reply["choices"][0]["message"]
                messages.append({"role": "assistant", "content": answer["content"]})
    return latencies, made


def breakdown(raw: Path, calls_made: int) -> list[tuple[str, float]]:
    """CPU ms a call for each part, from py-spy's raw (collapsed) samples at RATE a second."""
    found: collections.Counter[str] = collections.Counter()
    held = ""  # a sample's start, when a frame's name holds a newline (SQLAlchemy's, SQL text)
    for line in raw.read_text().split("\n"):
        stack, _, n = (held + line).rpartition(" ")
        if not n.isdigit():
            held += line + " "
            continue
        held = ""
        found[_part(stack.split(";"))] += int(n)
    return [(name, found[name] * 1000 / RATE / calls_made) for name, _ in PARTS]


def _part(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, pattern in PARTS[:-1]:
            if re.search(pattern, frame):
                return name
    return PARTS[-1][0]


async def thread_hops(gap: float, count: int = 200) -> float:
    """The median microseconds of a hop to a worker thread and back, as the writer's durable
    commit takes one (recorder/writer.py), each after `gap` seconds idle: an idle thread's CPU
    may have to be woken."""
    loop, worker = asyncio.get_running_loop(), ThreadPoolExecutor(1)
    took = []
    for _ in range(count):
        await asyncio.sleep(gap)
        start = time.perf_counter()
        await loop.run_in_executor(worker, int)
        took.append((time.perf_counter() - start) * 1e6)
    worker.shutdown()
    return statistics.median(took)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="how long py-spy samples each shape")
    parser.add_argument("--latency", type=float, default=0.0, help="the stub's latency, seconds (bench_proxy's: 0.05)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rlp-profile-"))
    stub_port, rlp_port = free_port(), free_port()
    stub = f"http://127.0.0.1:{stub_port}/v1"
    py = sys.executable
    serve = [py, "-m", "proxy.cli", "serve", "--upstream", stub, "--db", str(work / "p.db"), "--port", str(rlp_port)]
    with (
        process(
            [py, "-m", "benchmarks.support.stub_upstream", "--port", str(stub_port), "--latency", str(args.latency)],
            f"{stub}/models",
            work / "stub.log",
        ),
        floor(stub, work / "passthrough.log") as (passthrough, _),
        process(serve, f"http://127.0.0.1:{rlp_port}/healthz", work / "rl-proxy.log") as proxy,
    ):
        targets = {
            "direct": f"{stub}/chat/completions",
            "passthrough": f"{passthrough}/chat/completions",
            "rl-proxy": f"http://127.0.0.1:{rlp_port}/v1/chat/completions",
        }
        rows = []
        for shape, turns in (("new", 1), ("continuing", 8)):
            latencies: dict[str, list[float]] = {name: [] for name in targets}
            for url in targets.values():
                asyncio.run(calls(url, turns, count=50))  # warm up
            for _ in range(ROUNDS):  # interleaved, so that noise hits all three alike
                for name, url in targets.items():
                    latencies[name] += asyncio.run(calls(url, turns, count=100))[0]
            medians = {name: statistics.median(values) for name, values in latencies.items()}
            raw = work / f"{shape}.txt"
            spy = [str(Path(py).parent / "py-spy"), "record", "--pid", str(proxy.pid), "--rate", str(RATE)]
            spy += ["--duration", str(int(args.seconds)), "--format", "raw", "--nonblocking", "-o", str(raw)]
            sampling = subprocess.Popen(spy, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            made = asyncio.run(calls(targets["rl-proxy"], turns, seconds=args.seconds))[1]
            if sampling.wait(60) != 0 or not raw.exists():
                raise SystemExit("py-spy could not sample the proxy (it needs ptrace: run as root or allow it)")
            rows.append((shape, medians, made, breakdown(raw, made)))
            print(f"  {shape}: done", file=sys.stderr)
    for shape, medians, made, parts in rows:
        floored, added = (medians[name] - medians["direct"] for name in ("passthrough", "rl-proxy"))
        print(
            f"\n{shape} calls, 1 client, stub upstream at {args.latency * 1000:g} ms, "
            f"medians of {ROUNDS} interleaved rounds of 100: "
            f"direct {medians['direct']:.2f} ms; the passthrough floor adds {floored:.2f}, rl-proxy {added:.2f}. "
            f"rl-proxy's CPU ms a call by part (py-spy, {made} calls sampled):\n"
        )
        print("| part | CPU ms a call |")
        print("|---|---:|")
        for name, ms in parts:
            print(f"| {name} | {ms:.3f} |")
        print(f"| all | {sum(ms for _, ms in parts):.3f} |")
    idle = max(args.latency, 0.05)
    hops = [uvloop.run(thread_hops(gap)) for gap in (0.0, idle)]
    print(
        f"\nA hop to a worker thread and back (the durable commit's, on the writer's thread), median of "
        f"200: {hops[0]:.0f} us back to back, {hops[1]:.0f} us after {idle * 1000:g} ms idle"
    )


if __name__ == "__main__":
    main()
