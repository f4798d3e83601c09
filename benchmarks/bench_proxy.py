"""Proxy overhead benchmark (`make bench`): rl-proxy and a LiteLLM proxy side by side.

All targets answer the same request from the same fixed-latency STUB upstream
(benchmarks/support/stub_upstream.py, not vLLM), so what differs is each proxy's own cost:
  direct    -> stub
  rl-proxy  -> stub   (recording every call into SQLite before answering)
  litellm   -> stub   (LiteLLM proxy, no database, default settings)
  floor     -> stub   (the recording floor, benchmarks/support/passthrough.py: the same server
                       stack recording each call through the same store, and nothing else)
  passthrough -> stub (the same server stack forwarding bytes, recording nothing)
  nginx     -> stub   (a compiled proxy recording nothing: what one hop costs on this machine)
Those three bound what rl-proxy adds: the hop itself, the hop in this Python stack, and a
durable commit before the answer.
At each concurrency, rounds alternate between targets so that machine noise hits all targets
alike. Added latency = a target's latency minus the direct median of the same level and round.
The load generator is aiohttp in this process; servers run in their own processes; with
--proxy-cpus the proxies and floors run on CPUs of their own (benchmarks/support/cpus.py).

A second table gives the cost of translation: the same question asked of rl-proxy as Chat
Completions, Anthropic Messages and OpenAI Responses (each translated to a chat call upstream),
whole and streamed, against a direct chat call of the same kind.

A third gives the cost of token-in: 3-turn sessions (each call sends the conversation so far)
through an rl-proxy with token-in, one whose thread cache holds one session's threads (so each
continuing call nearly always finds its session's evicted by the other 15 and reads it back from
the store, as a proxy that did not serve the previous call does, then continues it), one
whose upstream makes no bridges (a second stub: the proxy cuts each from a /tokenize of the
request, as in front of a vLLM without rl-proxy's plugin) and one in messages mode, side by side;
a continuation call's latency with token-in (the stub bridges as the plugin does, and the
planning) against messages mode, and what the read and the /tokenize add.
Beside them the recording floor and the token-in floor (benchmarks/support/passthrough.py: the
same stack recording each call, and the latter rendering each continuing call on the stub first):
what that one round trip adds by itself, the least a proxy that renders on the upstream adds.
A fourth gives, over the same runs, what those calls waited for besides the upstream's answer:
token-in's planning and the commits (rl-proxy's own /metrics), the token-in floor's /tokenize
round trip and commits (its GET /waits); means, ms a call.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import statistics
import sys
import sysconfig
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.support import cpus
from benchmarks.support.load import p99
from benchmarks.support.nginx import balancer, nginx_bin
from benchmarks.support.passthrough import floor
from benchmarks.support.stack import process
from benchmarks.support.stub_upstream import MODEL
from proxy.vllm import free_port

LITELLM_KEY = "sk-bench-only"
ASK = "Say hello in five words."
BODY = {"model": MODEL, "messages": [{"role": "user", "content": ASK}], "max_tokens": 16}
API_BODIES = {  # path: request
    "chat/completions": BODY,
    "messages": {"model": MODEL, "messages": [{"role": "user", "content": ASK}], "max_tokens": 16},
    "responses": {"model": MODEL, "input": ASK, "max_output_tokens": 16},
}


async def load(url: str, concurrency: int, requests: int, key: str, body: dict | None = None) -> list[float]:
    """`requests` calls from `concurrency` workers; each call's latency in ms (a stream's: until
    its last byte)."""
    latencies: list[float] = []
    todo = iter(range(requests))
    headers = {"Authorization": f"Bearer {key}"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def worker() -> None:
            for _ in todo:
                start = time.perf_counter()
                async with session.post(url, json=body or BODY) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"{url} answered {resp.status}")
                latencies.append((time.perf_counter() - start) * 1000)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, default=0.05, help="stub upstream latency, seconds")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0, help="approximate length of one batch")
    parser.add_argument("--api-level", type=int, default=16, help="concurrency of the translation table")
    parser.add_argument(
        "--proxy-cpus",
        type=cpus.parse,
        default=set(),
        help="the proxies' own CPUs, as taskset writes them (0 or 0-3); the load and stubs get the rest",
    )
    args = parser.parse_args()
    if nginx_bin() is None:
        sys.exit("bench_proxy needs nginx, the compiled proxy it measures beside the others: apt-get install nginx")
    split = cpus.split(args.proxy_cpus)
    work = Path(tempfile.mkdtemp(prefix="rlp-bench-"))
    stub_port, rlp_port, litellm_port = free_port(), free_port(), free_port()
    stub = f"http://127.0.0.1:{stub_port}/v1"
    db = work / "bench.db"
    (work / "litellm.yaml").write_text(
        f"model_list:\n  - model_name: {MODEL}\n    litellm_params:\n      model: openai/{MODEL}\n"
        f"      api_base: {stub}\n      api_key: none\n"
    )
    py, litellm = sys.executable, str(Path(sysconfig.get_path("scripts")) / "litellm")
    nginx_cmd, nginx_url = balancer([stub_port], work)
    with (
        process(
            [py, "-m", "benchmarks.support.stub_upstream", "--port", str(stub_port), "--latency", str(args.latency)],
            f"{stub}/models",
            work / "stub.log",
        ),
        process(
            [py, "-m", "proxy.cli", "serve", "--upstream", stub, "--db", str(db), "--port", str(rlp_port)],
            f"http://127.0.0.1:{rlp_port}/healthz",
            work / "rl-proxy.log",
        ) as rlp,
        process(
            [litellm, "--config", str(work / "litellm.yaml"), "--port", str(litellm_port)],
            f"http://127.0.0.1:{litellm_port}/health/liveliness",
            work / "litellm.log",
            env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "LITELLM_MASTER_KEY": LITELLM_KEY},
        ) as litellm_proxy,
        floor(stub, work / "recording-floor.log", str(work / "recording-floor.db")) as (recording, recording_pid),
        floor(stub, work / "passthrough.log") as (passthrough, passthrough_pid),
        process(nginx_cmd, f"{nginx_url}/v1/models", work / "nginx.log") as nginx,
    ):
        cpus.pin(args.proxy_cpus, rlp.pid, litellm_proxy.pid, recording_pid, passthrough_pid, nginx.pid)
        targets = {
            "direct": f"{stub}/chat/completions",
            "rl-proxy": f"http://127.0.0.1:{rlp_port}/v1/chat/completions",
            "litellm": f"http://127.0.0.1:{litellm_port}/v1/chat/completions",
            "floor": f"{recording}/chat/completions",
            "passthrough": f"{passthrough}/chat/completions",
            "nginx": f"{nginx_url}/v1/chat/completions",
        }
        for url in targets.values():  # warm up connections and imports
            asyncio.run(load(url, 4, 40, LITELLM_KEY if url == targets["litellm"] else "warmup"))
        sent_to_rlp = 40
        rows = []
        for level in args.levels:
            requests = max(level * 4, int(args.seconds * level / args.latency))
            added: dict[str, list[float]] = {name: [] for name in targets if name != "direct"}
            raw: dict[str, list[float]] = {name: [] for name in targets}
            for round_ in range(args.rounds):
                key = f"bench-{level}-{round_}"
                got = {
                    name: asyncio.run(load(url, level, requests, LITELLM_KEY if name == "litellm" else key))
                    for name, url in targets.items()
                }
                sent_to_rlp += requests
                base = statistics.median(got["direct"])
                for name in added:
                    added[name] += [x - base for x in got[name]]
                for name, values in got.items():
                    raw[name] += values
            row = {"level": level, "requests": requests * args.rounds, "direct": statistics.median(raw["direct"])}
            for name in added:
                row[f"{name} median"] = statistics.median(added[name])
                row[f"{name} p99"] = p99(added[name])
            rows.append(row)
            print(f"  concurrency {level}: done", file=sys.stderr)
        api_rows, sent = translation_cost(stub, f"http://127.0.0.1:{rlp_port}/v1", args)
        sent_to_rlp += sent
        unbridged_port = free_port()
        unbridged = f"http://127.0.0.1:{unbridged_port}/v1"
        ports = {name: free_port() for name in ("token-in", "read back", "/tokenize", "messages")}
        stores = {name: work / f"{name.strip('/').replace(' ', '-')}.db" for name in ports}

        def proxy(name: str, *flags: str, upstream: str = stub, env: dict[str, str] | None = None) -> Any:
            """An rl-proxy of the token-in table, on a store of its own (so all start empty)."""
            command = [py, "-m", "proxy.cli", "serve", "--upstream", upstream, "--db", str(stores[name])]
            port = ports[name]
            return process(
                [*command, "--port", str(port), *flags],
                f"http://127.0.0.1:{port}/healthz",
                stores[name].with_suffix(".log"),
                env=env,
            )

        stub_args = ["--port", str(unbridged_port), "--latency", str(args.latency), "--no-bridges"]
        with (
            process(
                [py, "-m", "benchmarks.support.stub_upstream", *stub_args],
                f"{unbridged}/models",
                work / "unbridged.log",
            ),
            proxy("token-in") as token_in_proxy,
            # a thread cache that holds one session's threads (5,200 bytes): each continuing call
            # finds its own evicted by the other sessions', reads them back and continues
            proxy("read back", env={"RLP_THREAD_CACHE_MB": "0.008"}) as read_back_proxy,
            proxy("/tokenize", upstream=unbridged) as tokenize_proxy,  # an upstream that makes no bridges
            proxy("messages", "--messages-mode") as messages_proxy,
            floor(stub, work / "token-in-floor.log", str(work / "token-in-floor.db"), render=True) as (rendering, pid),
        ):
            pinned = (token_in_proxy.pid, read_back_proxy.pid, tokenize_proxy.pid, messages_proxy.pid, pid)
            cpus.pin(args.proxy_cpus, *pinned)
            watched = {
                **{
                    name: partial(proxy_waits, f"http://127.0.0.1:{ports[name]}")
                    for name in ("token-in", "read back", "/tokenize", "messages")
                },
                "token-in floor": partial(floor_waits, rendering.removesuffix("/v1")),
            }
            before = {name: read() for name, read in watched.items()}
            urls = {name: f"http://127.0.0.1:{port}/v1" for name, port in ports.items()}
            targets = urls | {"recording floor": recording, "token-in floor": rendering}
            token_in, by_round = token_in_cost(targets, args)
            waited = {name: mean_waits(before[name], read()) for name, read in watched.items()}
        sent_to_token_in = token_in.pop("sent")
        for name, store in stores.items():
            query = "select count(*), sum(seq > 1), sum(token_in) from calls"
            stored, continuing, token_in_calls = sqlite3.connect(store).execute(query).fetchone()
            if stored != sent_to_token_in:
                sys.exit(f"calls were lost: the {name} proxy recorded {stored} of {sent_to_token_in}")
            if name != "messages" and token_in_calls != continuing:  # each continuation as the thread's tokens
                lost = continuing - token_in_calls
                sys.exit(f"the {name} proxy sent {lost} of {continuing} continuations as messages")
    recorded = sqlite3.connect(db).execute("select count(*) from calls").fetchone()[0]
    if split:
        print(f"\n{split}")
    print(
        f"\nAdded latency over a direct call, ms (stub upstream: fixed {args.latency * 1000:.0f} ms, not vLLM; "
        f"{args.rounds} interleaved rounds)\n"
    )
    print(
        "| concurrency | requests/target | direct median | rl-proxy median | rl-proxy p99 | LiteLLM median "
        "| LiteLLM p99 | recording floor median | passthrough floor median | nginx median |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['level']} | {r['requests']} | {r['direct']:.1f} | {r['rl-proxy median']:.2f} | "
            f"{r['rl-proxy p99']:.2f} | {r['litellm median']:.2f} | {r['litellm p99']:.2f} | {r['floor median']:.2f} "
            f"| {r['passthrough median']:.2f} | {r['nginx median']:.2f} |"
        )
    print(
        f"\nAdded latency of each API through rl-proxy over a direct chat call of the same kind, ms "
        f"({args.api_level} concurrent clients, stub upstream)\n"
    )
    print("| API | mode | direct median | added median | added p99 |")
    print("|---|---|---:|---:|---:|")
    for api, mode, direct, median, high in api_rows:
        print(f"| {api} | {mode} | {direct:.1f} | {median:.2f} | {high:.2f} |")
    print(
        f"\nA continuation call's latency with token-in (its thread held, or read back from the store as by a "
        f"proxy that did not serve the previous call, or its bridge cut by the proxy from a /tokenize of the "
        f"request, in front of an upstream that makes none) against messages mode, ms ({args.api_level} concurrent "
        f"3-turn sessions, stub upstream, SQLite, {args.rounds} interleaved rounds); beside them the recording "
        "floor and the token-in floor (benchmarks/support/passthrough.py: recording each call, and rendering "
        "each continuing one on the upstream first), whose difference is the least a token-in round trip adds\n"
    )
    print(
        "| token-in median | token-in, thread read back, median | token-in, bridge by /tokenize, median "
        "| messages mode median | token-in added | read back added | /tokenize added | recording floor median "
        "| token-in floor median | the round trip alone added |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    t = token_in
    print(
        f"| {t['token-in']:.2f} | {t['read back']:.2f} | {t['/tokenize']:.2f} | {t['messages']:.2f} "
        f"| {t['token-in'] - t['messages']:.2f} | {t['read back'] - t['token-in']:.2f} "
        f"| {t['/tokenize'] - t['token-in']:.2f} | {t['recording floor']:.2f} | {t['token-in floor']:.2f} "
        f"| {t['token-in floor'] - t['recording floor']:.2f} |"
    )
    differences = [a - b for a, b in zip(by_round["token-in"], by_round["messages"], strict=True)]
    print(
        f"\nToken-in added round by round (each round's median less messages mode's in the same round): median "
        f"{statistics.median(differences):.2f} ms, from {min(differences):.2f} to {max(differences):.2f} over "
        f"{len(differences)} rounds"
    )
    w = waited
    print(
        "\nWhere the calls of those runs waited besides the upstream's answer, ms a call, means (rl-proxy's own "
        "/metrics: rlp_token_in_seconds of the continuing calls, rlp_commit_seconds of all; the token-in floor's "
        "GET /waits): token-in's planning is its own work, and where the proxy cuts the bridge, its /tokenize "
        "round trip\n"
    )
    print(
        "| token-in's planning | planning, thread read back | planning, bridge by /tokenize "
        "| the token-in floor's /tokenize round trip | commit, token-in | commit, messages mode "
        "| commit, token-in floor |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {w['token-in']['plan']:.2f} | {w['read back']['plan']:.2f} | {w['/tokenize']['plan']:.2f} "
        f"| {w['token-in floor']['render']:.2f} "
        f"| {w['token-in']['commit']:.2f} | {w['messages']['commit']:.2f} | {w['token-in floor']['commit']:.2f} |"
    )
    print(
        f"\nrl-proxy recorded {recorded} of {sent_to_rlp} calls sent to it, and each proxy of the token-in table "
        f"{sent_to_token_in} (SQLite, committed before answering)."
    )
    if recorded != sent_to_rlp:
        sys.exit("calls were lost")


def translation_cost(stub: str, rlp: str, args: argparse.Namespace) -> tuple[list[tuple], int]:
    """Rows of (API, mode, direct median, added median, added p99), and the calls sent to rl-proxy."""
    level = args.api_level
    requests = max(level * 4, int(args.seconds * level / args.latency))
    rows, sent = [], 0
    for stream in (False, True):
        mode = "stream" if stream else "whole"
        targets = {"direct": (f"{stub}/chat/completions", BODY)}
        targets |= {path: (f"{rlp}/{path}", body) for path, body in API_BODIES.items()}
        added: dict[str, list[float]] = {path: [] for path in API_BODIES}
        direct: list[float] = []
        for url, body in targets.values():  # litellm's translators are imported on first use
            asyncio.run(load(url, 4, 40, "warmup", {**body, "stream": stream}))
        sent += 40 * len(API_BODIES)
        for round_ in range(args.rounds):
            key = f"bench-api-{mode}-{round_}"
            got = {
                name: asyncio.run(load(url, level, requests, key, {**body, "stream": stream}))
                for name, (url, body) in targets.items()
            }
            sent += requests * len(API_BODIES)
            base = statistics.median(got["direct"])
            direct += got["direct"]
            for path in added:
                added[path] += [x - base for x in got[path]]
        for path, values in added.items():
            rows.append((path, mode, statistics.median(direct), statistics.median(values), p99(values)))
        print(f"  translation, {mode}: done", file=sys.stderr)
    return rows, sent


async def sessions(url: str, concurrency: int, count: int, tag: str) -> list[float]:
    """`count` 3-turn sessions from `concurrency` workers; the latency of each continuation call, ms."""
    latencies: list[float] = []
    todo = iter(range(count))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def worker() -> None:
            for n in todo:
                messages = [{"role": "user", "content": ASK}]
                for turn in range(3):
                    start = time.perf_counter()
                    body = {**BODY, "messages": messages}
                    async with session.post(
                        f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {tag}-{n}"}
                    ) as resp:
                        answer = await resp.json()
                    if turn:
                        latencies.append((time.perf_counter() - start) * 1000)
                    messages = [*messages, answer["choices"][0]["message"], {"role": "user", "content": "And?"}]

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


def floor_waits(root: str) -> dict[str, tuple[float, float]]:
    """What a floor's renderings and commits took so far, (seconds, count) each (its GET /waits)."""
    return {name: (w["seconds"], w["count"]) for name, w in httpx.get(f"{root}/waits").json().items()}


def proxy_waits(root: str) -> dict[str, tuple[float, float]]:
    """What rl-proxy's planning of continuing calls and its commits took so far, (seconds, count)
    each (its /metrics)."""
    samples = {
        (s.name, s.labels.get("outcome")): s.value
        for family in text_string_to_metric_families(httpx.get(f"{root}/metrics").text)
        for s in family.samples
    }

    def wait(name: str, outcome: str | None = None) -> tuple[float, float]:
        return samples.get((f"{name}_sum", outcome), 0.0), samples.get((f"{name}_count", outcome), 0.0)

    return {"plan": wait("rlp_token_in_seconds", "continued"), "commit": wait("rlp_commit_seconds")}


def mean_waits(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """The mean of each wait between two readings, ms."""
    return {
        name: 1000 * (after[name][0] - before[name][0]) / max(1.0, after[name][1] - before[name][1]) for name in after
    }


def token_in_cost(targets: dict[str, str], args: argparse.Namespace) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Each target's median continuation latency over all rounds, and its median in each round;
    the targets' order is reversed every other round, so that none is always the first after a
    pause or the last behind the others' writes."""
    level = args.api_level
    count = max(level * 2, int(args.seconds * level / args.latency / 3))
    got: dict[str, list[float]] = {name: [] for name in targets}
    rounds: dict[str, list[float]] = {name: [] for name in targets}
    for round_ in range(args.rounds):
        for name, url in list(targets.items())[:: -1 if round_ % 2 else 1]:
            latencies = asyncio.run(sessions(url, level, count, f"bench-ti-{name.replace(' ', '-')}-{round_}"))
            got[name] += latencies
            rounds[name].append(statistics.median(latencies))
    print("  token-in: done", file=sys.stderr)
    medians = {name: statistics.median(values) for name, values in got.items()}
    return {**medians, "sent": 3 * count * args.rounds}, rounds


if __name__ == "__main__":
    main()
