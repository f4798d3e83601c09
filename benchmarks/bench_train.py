"""Training loop figures (`make bench`): the hot-swap pause (median of 5, with streams in
flight), asynchronous against synchronous wall-clock for the same number of trained samples
on the arithmetic example, and the trainer's tokens per second.

Launches vLLM (eager mode, as the tests do) unless --upstream names a running one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from benchmarks.bench_episodes import bench_vllm
from harness_adapters.config import load_config
from proxy.app import create_app
from proxy.model import resolve_model
from proxy.server import AppThread
from proxy.settings import Settings
from trainer.config import TrainConfig
from trainer.run import train
from trainer.weight_sync import hot_swap

EXAMPLE = Path(__file__).resolve().parents[1] / "harness_adapters" / "examples" / "arithmetic"


def swap_pauses(upstream: str, model: str, work: Path, rounds: int = 5) -> list[float]:
    """Swap between the default weights and a saved copy, 8 streams in flight each time."""
    base = Path(resolve_model("default")[0])
    root = upstream.removesuffix("/v1")

    async def main(proxy_url: str) -> list[float]:
        client = AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key="bench-swap", max_retries=0)
        messages = [{"role": "user", "content": "Tell me a long story."}]

        async def stream() -> None:
            answer = await client.chat.completions.create(model=model, messages=messages, max_tokens=64, stream=True)
            async for _ in answer:
                pass

        pauses = []
        for n in range(rounds):
            streams = [asyncio.create_task(stream()) for _ in range(8)]
            await asyncio.sleep(1.0)
            pauses.append(await hot_swap([root], base, f"bench-{n}", base))
            await asyncio.gather(*streams)
        await hot_swap([root], base, "0", base)
        return pauses

    with AppThread(create_app(Settings(upstream=upstream, db=str(work / "swap.db")))) as proxy:
        return asyncio.run(main(proxy.url))


def train_run(upstream: str, mode: str, steps: int, work: Path) -> dict[str, Any]:
    """The example for `steps` steps in `mode`, no evaluation; seconds from the first step's start."""
    config = load_config(EXAMPLE / "train.yaml", TrainConfig)
    config.out = str(work / mode)
    config.proxy.upstream, config.proxy.vllm_args = upstream, []
    config.train = config.train.model_copy(update={"steps": steps, "mode": mode})
    config.eval = None
    summary = train(config, progress=False)
    rows = [json.loads(line) for line in summary.metrics.read_text().splitlines()]
    asyncio.run(
        hot_swap(
            [upstream.removesuffix("/v1")], Path(resolve_model("default")[0]), "0", Path(resolve_model("default")[0])
        )
    )
    return {
        "mode": mode,
        "steps": len(rows),
        "samples": summary.state.samples,
        "seconds": rows[-1]["time"],
        "tokens_per_s": statistics.median(r["sequence_tokens_per_s"] for r in rows),
        "sampled_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
        "train_s": statistics.median(r["train_s"] for r in rows),
        "wait_s": statistics.median(r["wait_s"] for r in rows),
        "skipped": summary.state.skipped_equal,
        "stale": summary.state.dropped_stale,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", help="a running vLLM (…/v1) instead of launching one")
    parser.add_argument("--steps", type=int, default=6, help="steps of each training run")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rlp-bench-train-"))

    def measure(upstream: str, model: str) -> tuple[list[float], list[dict[str, Any]]]:
        pauses = swap_pauses(upstream, model, work)
        print("  swaps: done", flush=True)
        runs = []
        for mode in ("async", "sync"):
            runs.append(train_run(upstream, mode, args.steps, work))
            print(f"  {mode} training: done", flush=True)
        return pauses, runs

    with bench_vllm(args.upstream, work, max_model_len=2048) as (upstream, model):
        pauses, runs = measure(upstream, model)
    print(
        f"\nHot swap ({model}, vLLM CPU): pause with 8 streams in flight, 5 swaps: "
        f"median {statistics.median(pauses):.2f} s, max {max(pauses):.2f} s\n"
    )
    print(f"Training the arithmetic example, {args.steps} steps of 16 episodes, 2 CPU cores:\n")
    print(
        "| mode | steps | samples | wall-clock s | median step: train s / waiting s | trainer tokens/s "
        "(all / sampled) | groups skipped | episodes stale |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        print(
            f"| {r['mode']} | {r['steps']} | {r['samples']} | {r['seconds']:.0f} | {r['train_s']:.0f} / "
            f"{r['wait_s']:.0f} | {r['tokens_per_s']:.0f} / {r['sampled_tokens_per_s']:.0f} | {r['skipped']} | "
            f"{r['stale']} |"
        )
    per_sample = {r["mode"]: r["seconds"] / r["samples"] for r in runs}
    print(
        f"\nwall-clock per trained sample: async {per_sample['async']:.2f} s, sync {per_sample['sync']:.2f} s "
        f"(async/sync speed: {per_sample['sync'] / per_sample['async']:.2f}x)"
    )


if __name__ == "__main__":
    main()
