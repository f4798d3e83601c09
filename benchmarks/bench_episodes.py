"""Episode throughput (`make bench`): the shipped arithmetic example through rl-proxy on the
real vLLM CPU server with the default model, at 1, 4 and 16 concurrent episodes.

Launches vLLM (eager mode, as the tests do) unless --upstream names a running one.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from harness_adapters.harnesses import PythonAdapter, load_callable
from harness_adapters.rewards import PythonReward
from harness_adapters.runner import EpisodeRunner
from harness_adapters.tasks import load_tasks
from proxy.app import create_app
from proxy.server import AppThread
from proxy.settings import Settings

EXAMPLE = Path(__file__).resolve().parents[1] / "harness_adapters" / "examples" / "arithmetic"


def measure(upstream: str, model: str, levels: list[int], per_level: int, work: Path) -> list[dict[str, float]]:
    agent = f"{EXAMPLE / 'agent.py'}"
    adapter = PythonAdapter(load_callable(f"{agent}:agent"))
    rewards = [PythonReward(function=f"{agent}:score")]
    tasks = load_tasks(EXAMPLE / "tasks.jsonl", "train")
    rows = []
    with AppThread(create_app(Settings(upstream=upstream, db=str(work / "bench.db")))) as proxy:
        for level in levels:
            episodes = max(per_level, level * 2)
            chosen = [tasks[i % len(tasks)] for i in range(episodes)]
            runner = EpisodeRunner(
                proxy.url,
                adapter,
                rewards,
                model,
                work / f"c{level}",
                f"bench-c{level}",
                timeout=300,
                concurrency=level,
            )
            start = time.perf_counter()
            results = asyncio.run(runner.run_all(chosen, 1))
            seconds = time.perf_counter() - start
            calls = sum(r.calls for r in results)
            wins = sum(r.success(1.0) for r in results)
            rows.append(
                {
                    "level": level,
                    "episodes": episodes,
                    "seconds": seconds,
                    "per_minute": episodes * 60 / seconds,
                    "calls_per_s": calls / seconds,
                    "success": wins / episodes,
                }
            )
            print(f"  {level} concurrent episodes: done", flush=True)
    return rows


@contextmanager
def bench_vllm(
    upstream: str | None, work: Path, max_model_len: int, extra_args: list[str] | None = None, lora_rank: int = 0
) -> Iterator[tuple[str, str]]:
    """(base URL, served model): the running vLLM given, or one launched here (eager mode)."""
    if upstream:
        import httpx

        yield upstream, httpx.get(f"{upstream}/models").json()["data"][0]["id"]
        return
    from proxy.model import resolve_model
    from proxy.vllm import VllmServer

    path, model = resolve_model("default")
    print("starting vLLM (eager) ...", flush=True)
    with VllmServer(
        path,
        model,
        log_file=work / "vllm.log",
        max_model_len=max_model_len,
        extra_args=["--enforce-eager", *(extra_args or [])],
        lora_rank=lora_rank,
    ) as server:
        server.wait_ready(900)
        yield server.base_url, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", help="a running vLLM (…/v1) instead of launching one")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--episodes", type=int, default=12, help="episodes per level (at least 2 x concurrency)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rlp-bench-episodes-"))
    with bench_vllm(args.upstream, work, max_model_len=4096) as (upstream, model):
        rows = measure(upstream, model, args.levels, args.episodes, work)
    print(f"\nEpisode throughput: the arithmetic example ({model}, vLLM CPU, 2 cores), through rl-proxy\n")
    print("| concurrent episodes | episodes | seconds | episodes/min | model calls/s | success |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['level']} | {r['episodes']} | {r['seconds']:.1f} | {r['per_minute']:.1f} | "
            f"{r['calls_per_s']:.2f} | {r['success']:.0%} |"
        )


if __name__ == "__main__":
    main()
