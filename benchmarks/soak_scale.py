"""The scale soak (`make soak-scale`): many concurrent multi-turn sessions through several
`rl-proxy serve` processes on one PostgreSQL, behind nginx as the load balancer (round robin, so
the calls of one session move from proxy to proxy), while faults are injected: one proxy is
SIGKILLed and started again, the proxies' database connections are terminated for a while
(some in the middle of a COMMIT), and PostgreSQL itself crashes and restarts.

The upstream is the STUB (benchmarks/support/stub_upstream.py, not vLLM), so that the proxies are
what is measured. Each session talks one API (Chat Completions, Anthropic Messages, Responses
chained by previous_response_id, text Completions), whole or streamed, and sends its whole
history every turn; a call that fails (a killed proxy, the database down) is sent again after a
pause, as a harness retries. Afterwards the store is read back: every answered call must be
there once, whole, and every continuing chat call must have joined its thread (token-in) though
its previous turn was served by another proxy.

  python -m benchmarks.soak_scale                      # make soak-scale: 1,000 sessions, 4 proxies
  python -m benchmarks.soak_scale --sessions 40 --proxies 2 --seconds 20   # a short run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psycopg

from benchmarks.support.load import ALL_KINDS, Load, converse, p99
from benchmarks.support.nginx import balancer
from benchmarks.support.postgres import Server, temp_postgres
from benchmarks.support.stack import new_database, process, read_store
from benchmarks.support.stub_upstream import COMPLETION
from proxy.vllm import free_port
from recorder import Store

TRIES = 60  # of a call, by a client, before it gives up
CACHE_MB = 8  # each proxy's thread and Responses caches


@dataclass
class Run(Load):
    """What the clients saw (`errors`: calls that failed every try), and what was done to the
    deployment."""

    memory: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # proxy: (second, RSS MB)
    faults: list[str] = field(default_factory=list)
    caches: list[dict[str, dict[str, int]]] = field(default_factory=list)  # each proxy's, at the end


class Proxies:
    """`rl-proxy serve` processes on fixed ports (the load balancer's list), each restartable."""

    def __init__(self, upstream: str, db: str, count: int, work: Path) -> None:
        self.upstream, self.db, self.work = upstream, db, work
        self.ports = [free_port() for _ in range(count)]
        self.victim = count // 2  # the one SIGKILLed
        self.procs: list[subprocess.Popen[bytes]] = [self._spawn(i) for i in range(count)]
        for i in range(count):
            self.wait(i)

    def _spawn(self, i: int) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "proxy.cli", "serve", "--upstream", self.upstream, "--db", self.db]
        # Small caches, so that they fill early and evict through the run (an evicted thread is
        # read back from the store): memory must level off at their budgets.
        env = {**os.environ, "RLP_THREAD_CACHE_MB": str(CACHE_MB), "RLP_RESPONSE_CACHE_MB": str(CACHE_MB)}
        with open(self.work / f"proxy-{i}.log", "ab") as log:
            argv = [*cmd, "--port", str(self.ports[i])]
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

    def caches(self) -> list[dict[str, dict[str, int]]]:
        """Each proxy's caches, as its /healthz shows them."""
        return [httpx.get(f"http://127.0.0.1:{p}/healthz", timeout=10).json()["caches"] for p in self.ports]

    def wait(self, i: int) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.procs[i].poll() is not None:
                raise RuntimeError(f"proxy {i} exited; see {self.work / f'proxy-{i}.log'}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.ports[i]}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"proxy {i} did not start")

    def restart(self, i: int) -> None:
        self.procs[i] = self._spawn(i)
        self.wait(i)

    def stop(self) -> None:
        """SIGTERM: each answers and records what it has in flight, then exits."""
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def rss(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next(int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmRSS"))


def terminate_backends(db: str) -> tuple[int, int]:
    """Cut every proxy connection to the database: (how many, how many in a COMMIT or INSERT)."""
    query = """
        SELECT pg_terminate_backend(pid), coalesce(query ~* '^\\s*(commit|insert)' AND state <> 'idle', false)
        FROM pg_stat_activity
        WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
    """
    with psycopg.connect(db, autocommit=True) as conn:
        rows = conn.execute(query).fetchall()
    return len(rows), sum(1 for _, writing in rows if writing)


async def inject(proxies: Proxies, pg: Server, db: str, seconds: float, started: float, run: Run) -> None:
    """At a quarter of the run: SIGKILL proxy 1 and start it again. From 45% to 55%: cut the
    proxies' database connections every 0.2 s. At 70%: PostgreSQL crashes and restarts."""

    async def at(share: float) -> None:
        await asyncio.sleep(max(0.0, started + share * seconds - time.monotonic()))

    def now() -> float:
        return time.monotonic() - started

    await at(0.25)
    victim = proxies.victim
    proxies.procs[victim].kill()
    killed = now()
    await asyncio.to_thread(proxies.procs[victim].wait)
    await asyncio.to_thread(proxies.restart, victim)
    run.faults.append(f"proxy {victim} SIGKILLed at {killed:.0f} s, serving again {now() - killed:.1f} s later")
    await at(0.45)
    cut = writing = 0
    first = now()
    while now() < 0.55 * seconds:
        n, w = await asyncio.to_thread(terminate_backends, db)
        cut, writing = cut + n, writing + w
        await asyncio.sleep(0.2)
    run.faults.append(
        f"{cut} database connections terminated from {first:.0f} s to {now():.0f} s ({writing} in a COMMIT or INSERT)"
    )
    await at(0.7)
    down = now()
    await asyncio.to_thread(pg.ctl, "stop")  # -m immediate: a crash
    await asyncio.to_thread(pg.ctl, "start")
    run.faults.append(f"PostgreSQL crashed at {down:.0f} s and was accepting connections {now() - down:.1f} s later")


async def load(
    base: str,
    sessions: int,
    seconds: float,
    pids: Callable[[], list[int]],
    run: Run,
    kinds: tuple[str, ...] = ALL_KINDS,
    min_turns: int = 0,
) -> None:
    """`sessions` concurrent clients for `seconds` (and `min_turns` calls each at least), each on
    one of `kinds`; RSS of each proxy every 2 s."""
    started = time.monotonic()

    async def sample() -> None:
        while True:
            for i, pid in enumerate(pids()):
                mb = rss(pid)
                if mb is not None:
                    run.memory.setdefault(i, []).append((time.monotonic() - started, mb))
            await asyncio.sleep(2.0)

    sampler = asyncio.create_task(sample())
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=sessions), timeout=timeout) as http:
        tag = f"{time.monotonic_ns() % 10**8:x}"
        until = started + seconds
        await asyncio.gather(
            *(
                converse(http, base, f"scale-{tag}-{i}", kinds[i % len(kinds)], until, run, TRIES, min_turns)
                for i in range(sessions)
            )
        )
    run.seconds = time.monotonic() - started
    sampler.cancel()


@dataclass
class Verified:
    recorded: int = 0  # calls recorded (each try that reached the store)
    lost: list[str] = field(default_factory=list)  # answered, not in the store
    duplicated: list[str] = field(default_factory=list)  # answered once, recorded more than once
    mismatched: list[str] = field(default_factory=list)
    undelivered: int = 0  # recorded, answered ok, but no client got the answer (a cut connection)
    continuing: int = 0  # answered chat calls after a session's first (Completions aside: text, no thread)
    joined: int = 0  # of those, token-in
    why_not: Counter[str] = field(default_factory=Counter)  # the others' thread_start


def asked(request: dict[str, Any]) -> str:
    if "prompt" in request:
        return str(request["prompt"]).rsplit("\n", 1)[-1]
    if "input" in request:
        return str(request["input"])
    return str(request["messages"][-1]["content"])


def verify(db: str, run: Run) -> Verified:
    """Read the store back: every answered call there once, whole, in its place."""

    async def scan(store: Store) -> dict[str, list[tuple[str, bool, bool, str | None]]]:
        by_reply: dict[str, list[tuple[str, bool, bool, str | None]]] = {}
        async for call in store.iter_calls():
            whole = call.ok and all(c.token_ids == COMPLETION and len(c.logprobs) == 8 for c in call.completions)
            reply_id = str((call.response or {}).get("id"))
            by_reply.setdefault(reply_id, []).append((asked(call.request), whole, call.token_in, call.thread_start))
        return by_reply

    by_reply = read_store(db, scan)
    found = Verified(recorded=sum(len(v) for v in by_reply.values()))
    delivered = set()
    for session, turn, kind, reply_id in run.answered:
        delivered.add(reply_id)
        calls = by_reply.get(reply_id, [])
        if not calls:
            found.lost.append(f"{session} turn {turn} ({kind})")
            continue
        if len(calls) > 1:
            found.duplicated.append(f"{session} turn {turn} ({kind}): {len(calls)} records")
        text, whole, token_in, why = calls[0]
        if text != f"{session} turn {turn}" or not whole:
            found.mismatched.append(f"{session} turn {turn} ({kind}) recorded as {text!r}, whole={whole}")
        if turn > 1 and not kind.startswith("completions"):
            found.continuing += 1
            found.joined += token_in
            if not token_in:
                found.why_not[str(why)[:90]] += 1
    found.undelivered = sum(1 for r, calls in by_reply.items() if r not in delivered and any(c[1] for c in calls))
    return found


def plot(run: Run, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for i, samples in sorted(run.memory.items()):
        ax.plot([t for t, _ in samples], [mb for _, mb in samples], label=f"proxy {i}")
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("RSS, MB")
    ax.set_ylim(bottom=0)
    ax.set_title("rl-proxy scale soak: memory per proxy (faults: see the table)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def scale_soak(
    sessions: int, count: int, seconds: float, latency: float, min_turns: int = 0
) -> tuple[Run, Verified, float]:
    """The run and what the store holds; and the median latency of the stub called directly."""
    work = Path(tempfile.mkdtemp(prefix="rlp-scale-"))
    run = Run()
    with ExitStack() as stack:
        pg = stack.enter_context(temp_postgres())
        db = new_database(pg.url)
        stub_port = free_port()
        stub = [sys.executable, "-m", "benchmarks.support.stub_upstream", "--port", str(stub_port)]
        stub_url = f"http://127.0.0.1:{stub_port}/v1"
        stack.enter_context(process([*stub, "--latency", str(latency)], f"{stub_url}/models", work / "stub.log"))
        direct = Run()
        asyncio.run(load(stub_url, sessions, 5.0, list, direct, ("chat",)))  # the stub alone, same concurrency
        proxies = Proxies(stub_url, db, count, work)
        stack.callback(proxies.stop)
        cmd, lb = balancer(proxies.ports, work)
        stack.enter_context(process(cmd, f"{lb}/healthz", work / "nginx.log"))
        print(f"{count} proxies behind nginx at {lb}, {sessions} sessions for {seconds:.0f} s", file=sys.stderr)

        async def main() -> None:
            started = time.monotonic()
            faults = asyncio.create_task(inject(proxies, pg, db, seconds, started, run))
            progress = asyncio.create_task(report(run, started, seconds))
            await load(f"{lb}/v1", sessions, seconds, lambda: [p.pid for p in proxies.procs], run, min_turns=min_turns)
            await faults
            progress.cancel()

        asyncio.run(main())
        run.caches = proxies.caches()
        proxies.stop()
        print("reading the store back", file=sys.stderr)
        verified = verify(db, run)
    return run, verified, statistics.median(direct.latencies)


async def report(run: Run, started: float, seconds: float) -> None:
    """A line every 10 s: progress when the output is not a terminal too."""
    while True:
        await asyncio.sleep(10)
        at = time.monotonic() - started
        print(
            f"  {at:.0f}/{seconds:.0f} s: {len(run.answered)} calls answered, "
            f"{sum(run.failures.values())} tries failed",
            file=sys.stderr,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--proxies", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=240.0)
    parser.add_argument("--latency", type=float, default=0.02, help="stub upstream latency, seconds")
    parser.add_argument("--plot", type=Path, help="memory per proxy over time, as a PNG")
    args = parser.parse_args()
    run, v, direct = scale_soak(args.sessions, args.proxies, args.seconds, args.latency)
    joined = v.joined / v.continuing if v.continuing else 0.0
    print(
        f"\nScale soak: {args.sessions} sessions, {args.proxies} proxies behind nginx (round robin), "
        f"PostgreSQL, {run.seconds:.0f} s, four APIs whole and streamed (stub upstream: fixed "
        f"{args.latency * 1000:.0f} ms, not vLLM)\n"
    )
    print(
        "| calls answered | calls/s | recorded | lost | duplicated | mismatched | recorded, never delivered "
        "| continuing calls joined | p50 ms | p99 ms | added p50 ms | tries failed, sent again |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    failed = ", ".join(f"{n} {what}" for what, n in run.failures.most_common()) or "none"
    print(
        f"| {len(run.answered)} | {len(run.answered) / run.seconds:.0f} | {v.recorded} | {len(v.lost)} | "
        f"{len(v.duplicated)} | {len(v.mismatched)} | {v.undelivered} | {joined:.4f} ({v.joined}/{v.continuing}) | "
        f"{statistics.median(run.latencies):.0f} | {p99(run.latencies):.0f} | "
        f"{statistics.median(run.latencies) - direct:.0f} | {failed} |"
    )
    print("\nFaults: " + "; ".join(run.faults) + ".")
    if v.why_not:
        print("Continuing calls not joined, by why: " + "; ".join(f"{n} {why}" for why, n in v.why_not.most_common(5)))
    print("\n| proxy | RSS MB, first sample | middle third (median) | last third (median) | max |")
    print("|---:|---:|---:|---:|---:|")
    flat = True
    for i, samples in sorted(run.memory.items()):
        mb = [m for _, m in samples]
        third = max(1, len(mb) // 3)
        middle, last = statistics.median(mb[third : 2 * third] or mb), statistics.median(mb[-third:])
        restarted = i == args.proxies // 2  # a new process from a quarter of the run: not compared
        flat = flat and (restarted or last <= 1.15 * middle)
        name = f"{i} (SIGKILLed, restarted)" if restarted else str(i)
        print(f"| {name} | {mb[0]:.0f} | {middle:.0f} | {last:.0f} | {max(mb):.0f} |")
    print("\nCaches at the end (/healthz), MB held of the budget, and entries:")
    for i, caches in enumerate(run.caches):
        shown = ", ".join(
            f"{name} {c['bytes'] / 2**20:.1f} of {c['budget'] / 2**20:.0f} ({c['entries']})"
            for name, c in caches.items()
        )
        print(f"  proxy {i}: {shown}")
    if args.plot:
        plot(run, args.plot)
        print(f"\nmemory plot: {args.plot}")
    for problem in (v.lost + v.duplicated + v.mismatched + run.errors)[:20]:
        print(problem, file=sys.stderr)
    missed = [
        what
        for what, bad in (
            ("calls lost", v.lost),
            ("calls duplicated", v.duplicated),
            ("calls mismatched", v.mismatched),
            ("clients gave up", run.errors),
            ("joined share under 0.99", joined < 0.99),
            ("memory not flat (last third over 1.15 x the middle)", not flat),
        )
        if bad
    ]
    if missed:
        sys.exit("targets missed: " + "; ".join(missed))


if __name__ == "__main__":
    main()
