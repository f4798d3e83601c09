"""Soak and store benchmark: many sessions making multi-turn calls through `rl-proxy serve`.

The upstream is the STUB (benchmarks/support/stub_upstream.py, not vLLM) in its own process, answering after
a fixed delay: the proxy and its store are under load, not a model. Each session talks one API
(Chat Completions whole or streamed, Anthropic Messages, or Responses chained by
previous_response_id) and sends its whole history every turn, for episodes of 24 turns, one
session after another. Afterwards the store is read back and every answered call checked:
there, in order, with the client's own turn in its request, the answer's id the client got and
the stub's tokens. The proxy's RSS is sampled every second.

  python -m benchmarks.soak --seconds 150            # `make soak`: SQLite, then PostgreSQL
  python -m benchmarks.soak --bench                  # `make bench`: calls/s and added latency
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.support import cpus
from benchmarks.support.load import KINDS, Load, p99, proxy, run_load, stack, verify
from benchmarks.support.passthrough import floor
from benchmarks.support.stack import new_database


def soak(stores: list[str], sessions: int, seconds: float, latency: float) -> list[dict[str, Any]]:
    """One soak per store kind: rows for the table, with the problems found."""
    rows = []
    with stack(stores, latency) as (upstream, dbs):
        for kind, db in dbs.items():
            with proxy(upstream, db, Path(tempfile.mkdtemp()) / "proxy.log") as (base, pid):
                load = asyncio.run(run_load(base, sessions, seconds, KINDS, pid))
            problems = load.errors + verify(db, load)
            third = max(1, len(load.rss) // 3)
            rows.append(
                {
                    "store": kind,
                    "calls": len(load.answered),
                    "rate": load.rate,
                    "problems": problems,
                    "p50": statistics.median(load.latencies),
                    "p99": p99(load.latencies),
                    "rss_early": statistics.median(load.rss[third : 2 * third] or load.rss),
                    "rss_late": statistics.median(load.rss[-third:]),
                }
            )
    return rows


def bench(sessions: int, seconds: float, rounds: int, latency: float, proxy_cpus: set[int]) -> None:
    """Calls/s recorded into each store at `sessions` clients, the latency the proxy adds over a
    direct call to the stub, and the CPU its process spends a call (and of it, its main thread's:
    the event loop's); rounds alternate between targets against machine noise. Beside them the
    passthrough floor (benchmarks/support/passthrough.py: the same HTTP server and client,
    recording nothing), the most a proxy in one process of this stack can pass, the recording
    floor on each store (the same, and each call recorded through the recorder's Store before it
    is answered, and nothing else: the most a proxy of this stack that records durably can
    pass), the token-in floor (the recording floor on SQLite, each continuing call also rendered
    by the upstream's /tokenize first: the least a proxy adds that cuts the bridge itself, which
    rl-proxy does only in front of a vLLM without its plugin; the stub bridges as the plugin
    does), rl-proxy in messages mode (no token-in), what token-in costs, and rl-proxy as two
    processes (`serve --workers 2`), its CPU and its loops' summed over both. With `proxy_cpus`,
    the proxies and floors run on those CPUs and the load, the stub and PostgreSQL on the rest."""
    import psutil  # vLLM's dependency

    def seconds_of(server: psutil.Process) -> tuple[float, float]:
        """CPU seconds of the server's processes (its workers too, if any), and of their main
        threads (each one's id is its process's)."""
        processes = [server, *server.children(recursive=True)]
        loops = [next(t for t in p.threads() if t.id == p.pid) for p in processes]
        return sum(sum(p.cpu_times()[:2]) for p in processes), sum(t.user_time + t.system_time for t in loops)

    proxies = ("sqlite", "sqlite-2-workers", "sqlite-messages", "postgresql")
    floors = ("passthrough", "recording-sqlite", "recording-postgresql", "rendering-sqlite")
    samples: dict[str, list[Load]] = {name: [] for name in ("direct", *floors, *proxies)}
    cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in samples}  # ms a call: process, loop
    split = cpus.split(proxy_cpus)
    with stack(["sqlite", "postgresql"], latency) as (upstream, dbs), ExitStack() as running:
        dbs["sqlite-messages"] = str(Path(tempfile.mkdtemp()) / "messages.db")
        dbs["sqlite-2-workers"] = str(Path(tempfile.mkdtemp()) / "workers.db")
        dbs["recording-sqlite"] = str(Path(tempfile.mkdtemp()) / "floor.db")
        dbs["recording-postgresql"] = new_database(dbs["postgresql"])  # another, on the same server
        dbs["rendering-sqlite"] = str(Path(tempfile.mkdtemp()) / "rendering.db")
        bases: dict[str, tuple[str, psutil.Process | None]] = {"direct": (upstream, None)}
        for name in floors:
            db = dbs.get(name)
            log, render = Path(tempfile.mkdtemp()) / "floor.log", name.startswith("rendering")
            base, pid = running.enter_context(floor(upstream, log, db, render))
            bases[name] = (base, psutil.Process(pid))
        for kind in proxies:
            options = {"sqlite-messages": ("--messages-mode",), "sqlite-2-workers": ("--workers", "2")}.get(kind, ())
            log = Path(tempfile.mkdtemp()) / "proxy.log"
            base, pid = running.enter_context(proxy(upstream, dbs[kind], log, *options))
            bases[kind] = (base, psutil.Process(pid))
        cpus.pin(proxy_cpus, *(server.pid for _, server in bases.values() if server))
        for round_ in range(rounds):
            for name, (base, server) in bases.items():
                before = seconds_of(server) if server else (0.0, 0.0)
                load = asyncio.run(run_load(base, sessions, seconds, ("chat",), None))
                if server:
                    process, loop = (
                        1000 * (a - b) / len(load.answered) for a, b in zip(seconds_of(server), before, strict=True)
                    )
                    cpu[name].append((process, loop))
                samples[name].append(load)
            print(f"  round {round_ + 1}/{rounds} done", file=sys.stderr)
        problems = {kind: [p for load in samples[kind] for p in verify(db, load)] for kind, db in dbs.items()}
    direct = statistics.median(x for load in samples["direct"] for x in load.latencies)
    if split:
        print(f"\n{split}")
    print(
        f"\nCalls recorded per second at {sessions} concurrent clients, multi-turn chat (stub upstream: "
        f"fixed {latency * 1000:.0f} ms, not vLLM; {rounds} interleaved rounds of {seconds:.0f} s); the last "
        "columns are the CPU time (user and system) of the server's process a call, and of its event "
        "loop's thread, medians of the rounds\n"
    )
    print(
        "| target | calls/s (median of rounds; x direct) | latency median ms | p99 ms | added median ms"
        " | lost or mismatched | CPU ms a call | of it, the event loop's |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    names = {
        "direct": "direct (the stub alone)",
        "passthrough": "the passthrough floor (records nothing)",
        "recording-sqlite": "the recording floor + sqlite (records, nothing else)",
        "recording-postgresql": "the recording floor + postgresql",
        "rendering-sqlite": "the token-in floor + sqlite (records, and renders as token-in does without the plugin)",
        "sqlite-messages": "rl-proxy + sqlite, messages mode (no token-in)",
        "sqlite-2-workers": "rl-proxy + sqlite, 2 workers (`serve --workers 2`)",
    }
    rate = {name: statistics.median(load.rate for load in loads) for name, loads in samples.items()}

    def cpu_cells(rounds: list[tuple[float, float]]) -> str:
        """The process's and the loop's CPU ms a call, medians of the rounds ("-" for the stub)."""
        return " | ".join(f"{statistics.median(r[i] for r in rounds):.2f}" if rounds else "-" for i in (0, 1))

    for name, loads in samples.items():
        values = [x for load in loads for x in load.latencies]
        print(
            f"| {names.get(name, f'rl-proxy + {name}')} | {rate[name]:.0f} ({rate[name] / rate['direct']:.2f}x) | "
            f"{statistics.median(values):.1f} | {p99(values):.1f} | {statistics.median(values) - direct:.1f} | "
            f"{len(problems[name]) if name in problems else '-'} | {cpu_cells(cpu[name])} |"
        )
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
    parser.add_argument(
        "--proxy-cpus",
        type=cpus.parse,
        default=set(),
        help="bench: the proxies' own CPUs (0 or 0-3); the load the rest",
    )
    args = parser.parse_args()
    if args.bench:
        bench(args.sessions, min(args.seconds, 10.0), args.rounds, args.latency, args.proxy_cpus)
        return
    rows = soak(args.stores, args.sessions, args.seconds, args.latency)
    print(
        f"\nSoak: {args.sessions} sessions x {args.seconds:.0f} s per store, multi-turn, four APIs "
        f"(stub upstream: fixed {args.latency * 1000:.0f} ms, not vLLM)\n"
    )
    print("| store | calls | calls/s | p50 ms | p99 ms | proxy RSS, 2nd third → last third, MB | lost or mismatched |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for r in rows:
        print(
            f"| {r['store']} | {r['calls']} | {r['rate']:.0f} | {r['p50']:.1f} | {r['p99']:.1f} | "
            f"{r['rss_early']:.0f} → {r['rss_late']:.0f} | {len(r['problems'])} |"
        )
    problems = [p for r in rows for p in r["problems"]]
    for problem in problems[:20]:
        print(problem, file=sys.stderr)
    if problems:
        sys.exit(f"{len(problems)} problems")


if __name__ == "__main__":
    main()
