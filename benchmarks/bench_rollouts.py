"""The rollouts engines (`make bench-rollouts`, in `make bench`): Ray's own cost per episode
against the local engine, and episodes per minute of the arithmetic example, local against Ray
with 1 and 2 worker nodes; everything on this machine, side by side in one run.

1. Engine cost: `--episodes` (1,000) episodes of a stub harness that makes one call and returns,
   through the proxy in front of a stub upstream (NOT vLLM: it answers at once), 16 at a time.
2. Throughput: the arithmetic example (its Python agent and verifier) on the real vLLM CPU
   server, `--arith` episodes per engine, 8 at a time.

A local Ray cluster (benchmarks/support/ray_cluster.py) has its worker nodes on these same 2
cores, so Ray's numbers show its overhead, not more machines.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_episodes import EXAMPLE, bench_vllm
from benchmarks.support.ray_cluster import local_cluster
from benchmarks.support.stub_upstream import stub_app
from harness_adapters.engines import LocalRollouts, RayRollouts, engine_for
from harness_adapters.harnesses import PythonAdapter, load_callable
from harness_adapters.rewards import PythonReward
from harness_adapters.runner import EpisodeRunner
from harness_adapters.tasks import Task, load_tasks
from proxy.app import create_app
from proxy.server import AppThread
from proxy.settings import Settings


async def one_call(client: Any, task: Any, model: str) -> str:
    """The stub harness: one call, then done."""
    answer = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": task.prompt}])
    return answer.choices[0].message.content or ""


def run(
    upstream: str, model: str, engine: LocalRollouts | RayRollouts, adapter: Any, rewards: list[Any],
    tasks: list[Task], concurrency: int, work: Path, name: str,
) -> dict[str, float]:  # fmt: skip
    """Every task once through a proxy of its own; its wall time and episodes per minute."""
    with (
        AppThread(create_app(Settings(upstream=upstream, db=str(work / f"{name}.db")))) as proxy,
        engine_for(engine) as ray_engine,
    ):
        runner = EpisodeRunner(
            proxy.url, adapter, rewards, model, work / name, name, 300, concurrency, engine=ray_engine
        )
        start = time.perf_counter()
        done = 0

        def tick(_: Any) -> None:
            nonlocal done
            done += 1
            if done % max(len(tasks) // 4, 1) == 0:
                print(f"    {name}: {done}/{len(tasks)}", flush=True)

        results = asyncio.run(runner.run_all(tasks, 1, tick))
        seconds = time.perf_counter() - start
    ok = sum(r.status == "ok" for r in results)
    wins = sum(r.success(1.0) for r in results)
    return {"episodes": len(results), "ok": ok, "seconds": seconds, "per_minute": len(results) * 60 / seconds,
            "ms_each": seconds * 1000 / len(results), "success": wins / len(results)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", help="a running vLLM (…/v1) instead of launching one")
    parser.add_argument("--episodes", type=int, default=1000, help="stub episodes per engine")
    parser.add_argument("--arith", type=int, default=32, help="arithmetic episodes per engine")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rlp-bench-rollouts-"))
    stub_tasks = [Task(f"t{i}", "Say hi.") for i in range(args.episodes)]
    examples = load_tasks(EXAMPLE / "tasks.jsonl", "train")
    arith_tasks = [Task(f"{t.id}#{i}", t.prompt, t.split, t.data) for i, t in enumerate(examples * 8)][: args.arith]
    agent = f"{EXAMPLE / 'agent.py'}"
    arith = (PythonAdapter(load_callable(f"{agent}:agent")), [PythonReward(function=f"{agent}:score")])
    stub = (PythonAdapter(one_call), [])
    cost: dict[str, dict[str, float]] = {}
    speed: dict[str, dict[str, float]] = {}
    with AppThread(stub_app()) as upstream:
        print(f"engine cost: {args.episodes} stub episodes each (stub upstream, NOT vLLM)", flush=True)
        cost["local"] = run(
            f"{upstream.url}/v1", "stub-model", LocalRollouts(), *stub, stub_tasks, 16, work, "stub-local"
        )
        with local_cluster(workers=2, cpus=8) as cluster:
            ray = RayRollouts(address=cluster.address, num_cpus=1)
            cost["ray, 2 nodes"] = run(f"{upstream.url}/v1", "stub-model", ray, *stub, stub_tasks, 16, work, "stub-ray")
    with bench_vllm(args.upstream, work, max_model_len=4096) as (url, model):
        print(f"throughput: {args.arith} arithmetic episodes each (vLLM CPU, {model})", flush=True)
        speed["local"] = run(url, model, LocalRollouts(), *arith, arith_tasks, 8, work, "arith-local")
        for workers in (1, 2):
            with local_cluster(workers=workers, cpus=8 // workers) as cluster:
                ray = RayRollouts(address=cluster.address, num_cpus=1)
                name = f"ray, {workers} node{'s' * (workers > 1)}"
                speed[name] = run(url, model, ray, *arith, arith_tasks, 8, work, f"arith-ray{workers}")
    print(f"\nEngine cost per episode ({args.episodes} episodes of a stub harness, one call each, 16 at a time)\n")
    table(cost, "ms per episode (wall / episodes)", lambda r: f"{r['ms_each']:.0f}")
    extra = cost["ray, 2 nodes"]["ms_each"] - cost["local"]["ms_each"]
    print(f"\nRay's own cost: {extra:.0f} ms per episode more than the local engine, on 2 cores")
    print(f"\nArithmetic example ({args.arith} episodes, 8 at a time, vLLM CPU, 2 cores)\n")
    table(speed, "success", lambda r: f"{r['success']:.0%}")


def table(rows: dict[str, dict[str, float]], last: str, value: Any) -> None:
    """A markdown table of runs, one per engine, with `last` as its last column."""
    print(f"| engine | episodes ok | seconds | episodes/min | {last} |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        ok = f"{r['ok']:.0f}/{r['episodes']:.0f}"
        print(f"| {name} | {ok} | {r['seconds']:.1f} | {r['per_minute']:.1f} | {value(r)} |")


if __name__ == "__main__":
    main()
