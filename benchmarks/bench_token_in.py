"""Token-in against messages mode (`make bench`): agent sessions of several client families through
rl-proxy on the real vLLM CPU server with the default model, once with token-in and once in
messages mode, side by side.

Per family: the share of continuation calls (over all its sessions) that joined the previous
call's training sequence (1.0: one sequence per episode), whether the masked-in tokens are
exactly the sampled ids, training tokens merged against one sample per call, and the median
latency of a continuation call (token-in adds one /tokenize of the request). Launches vLLM (eager mode, trusting request
chat templates, as the tests do) unless --upstream names a running one.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import tempfile
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

from benchmarks.bench_episodes import bench_vllm
from benchmarks.support.sessions import (
    FORCED,
    anthropic_session,
    harness_session,
    masked_in,
    responses_session,
    sampled,
    text_session,
    think_session,
    tool_session,
)
from proxy.app import create_app
from proxy.server import AppThread
from proxy.settings import Settings
from recorder import CallRecord, Store
from recorder.episodes import Sampling
from recorder.graph import build_sequences

# Each runs one session, named by the key given (its API key; a harness's run), and answers its
# id (None: the key is the id).
FAMILIES: dict[str, Callable[[str, str, str], str | None]] = {
    "openai SDK, forced tool calls (3 calls)": lambda url, key, model: tool_session(f"{url}/v1", key, model),
    "openai SDK, tool calls streamed (3 calls)": lambda url, key, model: tool_session(f"{url}/v1", key, model, True),
    "anthropic SDK, tool_use round trip (2 calls)": anthropic_session,
    "Responses, function call by previous_response_id (3 calls)": lambda url, key, model: responses_session(
        f"{url}/v1", key, model
    ),
    "plain text at temperature 1 (4 calls)": lambda url, key, model: text_session(f"{url}/v1", key, model),
    # SmolLM2's template is append-only on text: both modes send the same prompts and sample the
    # same tokens, so the latency columns differ by what token-in costs on the real vLLM.
    "plain text, greedy (4 calls)": lambda url, key, model: text_session(f"{url}/v1", key, model, temperature=0),
    "template stripping earlier <think> (4 calls)": lambda url, key, model: think_session(f"{url}/v1", key, model),
    # The shell example's harnesses, unchanged and sandboxed, on a rename task; the proxy forces
    # their tool calls (session sampling), which SmolLM2-135M seldom makes of its own accord.
    "Claude Code, forced tool calls (4 calls)": harness_session(
        "train-claude.yaml", "--max-turns", "4", sampling=FORCED
    ),
    "Codex CLI, forced tool calls (stopped at 90 s)": harness_session("train-codex.yaml", sampling=FORCED, timeout=90),
    # Greedy, so that both modes see the same episodes: mini's own temperature (0.7) made the two
    # modes' sessions differ in which answers mini dropped, which is what decides its joins.
    "mini-swe-agent, text-based, greedy (4 steps)": harness_session(
        "collect.yaml", "-c", "agent.step_limit=4", sampling=Sampling(temperature=0)
    ),
}


def score(calls: list[CallRecord]) -> dict[str, Any]:
    calls = [c for c in calls if c.ok]  # a harness stopped at its time limit leaves its last call cut
    report = build_sequences(calls)
    chain_of = {span.seq: i for i, s in enumerate(report.sequences) for span in s.spans}
    joined = [chain_of.get(c.seq) == chain_of.get(p.seq) for p, c in pairwise(calls)]
    exact = all(masked_in(s) == sampled(s, calls) for s in report.sequences)
    latency = [c.latency_ms for c in calls[1:]]
    return {
        "joined": joined,
        "exact": exact,
        "tokens": report.tokens,
        "unmerged": report.unmerged_tokens,
        "latency": latency,
    }


def measure(
    upstream: str, model: str, sessions: int, work: Path, families: dict[str, Callable[[str, str, str], str | None]]
) -> dict[str, dict[str, dict[str, Any]]]:
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for mode in ("token-in", "messages"):
        db = str(work / f"{mode}.db")
        ids: dict[str, list[str]] = {}
        # Codex and mini ask for no limit. Codex quits on an answer cut at the cap: 384 tokens
        # leaves most forced tool calls room to end (its episodes of one call count no continuation).
        settings = Settings(upstream=upstream, db=db, messages_mode=mode == "messages", max_completion_tokens=384)
        with AppThread(create_app(settings)) as proxy:
            for f, (family, run) in enumerate(families.items()):
                for n in range(sessions):
                    key = f"{mode}-{f}-{n}"
                    ids.setdefault(family, []).append(run(proxy.url, key, model) or key)
                print(f"  {mode}: {family}: done", flush=True)

        async def read(db: str = db, mode: str = mode, ids: dict[str, list[str]] = ids) -> None:
            async with Store(db) as store:
                for family, sids in ids.items():
                    scores = [score([c async for c in store.iter_calls(sid)]) for sid in sids]
                    results.setdefault(family, {})[mode] = {
                        "joined": statistics.fmean([j for s in scores for j in s["joined"]] or [math.nan]),
                        "exact": all(s["exact"] for s in scores),
                        "tokens": sum(s["tokens"] for s in scores),
                        "unmerged": sum(s["unmerged"] for s in scores),
                        "latency": statistics.median([x for s in scores for x in s["latency"]] or [math.nan]),
                    }

        asyncio.run(read())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", help="a running vLLM (…/v1, started with --trust-request-chat-template)")
    parser.add_argument("--sessions", type=int, default=3, help="sessions per family and mode")
    parser.add_argument("--only", default="", help="the families whose name holds one of these texts (comma-separated)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rlp-bench-token-in-"))
    extra = ["--trust-request-chat-template"]
    only = args.only.lower().split(",")
    families = {name: run for name, run in FAMILIES.items() if any(o in name.lower() for o in only)}
    # 8,192 tokens: Claude Code's prompt is ~6,000.
    with bench_vllm(args.upstream, work, max_model_len=8192, extra_args=extra) as (upstream, model):
        results = measure(upstream, model, args.sessions, work, families)
    print(f"\nToken-in against messages mode ({model}, vLLM CPU, 2 cores), {args.sessions} sessions a family\n")
    print(
        "| family | continuation calls joined: token-in / messages | exact | training tokens merged / one per call "
        "(token-in) | median continuation call ms: token-in / messages |"
    )
    print("|---|---:|---|---:|---:|")
    for family, r in results.items():
        t, m = r["token-in"], r["messages"]
        print(
            f"| {family} | {t['joined']:.2f} / {m['joined']:.2f} | {'yes' if t['exact'] and m['exact'] else 'NO'} | "
            f"{t['tokens']} / {t['unmerged']} | {t['latency']:.0f} / {m['latency']:.0f} |"
        )


if __name__ == "__main__":
    main()
