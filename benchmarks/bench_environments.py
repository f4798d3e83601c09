"""What where an episode runs costs (`make bench-environments`, and `make bench`): one harness
(the Harbor example's agent.py making one model call, then a file written) on the host, in
bubblewrap, and in a container of a SWE task's image: its image built in the episode (cold),
the image cached, and a warm pool (`warm: 2`, the next episodes' containers started while one
runs); then episodes per minute at 4 and 16 at a time in containers, with and without the warm
pool, and as Ray tasks on a local cluster of two worker nodes (`rollouts: {engine: ray}`; the
nodes share this machine's 2 cores and its one engine, so the rows show what Ray adds, not what
more machines give). The model is a stub upstream (NOT vLLM) that answers at once, so the figures
are the environment's own cost, not the model's.

Needs a container engine: DOCKER_HOST, else Podman's service started here (tests/podman.conf).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.support.engine import engine_at, with_base_image
from benchmarks.support.ray_cluster import local_cluster
from benchmarks.support.stub_upstream import stub_app
from harness_adapters.engines import RayRollouts, engine_for
from harness_adapters.environments import BubblewrapEnvironment, ContainerEnvironment, Environment, HostEnvironment
from harness_adapters.harnesses import CommandAdapter
from harness_adapters.runner import Engine, EpisodeRunner
from harness_adapters.tasks import Task, load_tasks
from proxy.app import create_app
from proxy.server import AppThread
from proxy.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
AGENT = ROOT / "harness_adapters" / "examples" / "harbor" / "agent.py"
SWE = ROOT / "harness_adapters" / "examples" / "swe" / "tasks"
SCRIPT = 'python3 {agent} --steps 1 "$0"; echo hello > hello.txt'


def episodes(
    proxy: str, environment: Environment, tasks: list[Task], concurrency: int, work: Path, engine: Engine | None = None
) -> list[float]:
    """Run `tasks` (one episode each); the seconds between one episode's end and the next's, the
    first counted from the start (one at a time: each episode's own time)."""
    inside = isinstance(environment, ContainerEnvironment)
    agent = "/opt/rl-proxy/agent.py" if inside else str(AGENT)
    harness = CommandAdapter(["sh", "-c", SCRIPT.format(agent=agent), "{prompt}"])
    runner = EpisodeRunner(
        proxy, harness, [], "stub-model", work, "bench", 120, concurrency, environment=environment, engine=engine
    )
    ends = [time.perf_counter()]
    asyncio.run(runner.run_all(tasks, 1, lambda _: ends.append(time.perf_counter())))
    environment.close()
    return [b - a for a, b in itertools.pairwise(ends)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=8, help="one at a time, per environment")
    parser.add_argument("--levels", type=int, nargs="+", default=[4, 16])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rlp-bench-environments-"))
    [swe] = load_tasks(SWE / "rect-area")
    host_task = Task(id="hello", prompt=swe.prompt)
    mounts = {str(AGENT): "/opt/rl-proxy/agent.py"}
    rows: list[tuple[str, float, float]] = []
    with (
        engine_at() as url,
        AppThread(stub_app()) as stub,
        AppThread(create_app(Settings(upstream=f"{stub.url}/v1", db=str(work / "bench.db")))) as proxy,
    ):
        with_base_image(url)
        os.environ["DOCKER_HOST"] = url
        one = {
            "host": (HostEnvironment(), [host_task] * args.episodes),
            "bubblewrap": (BubblewrapEnvironment(), [host_task] * args.episodes),
            "container, image cached": (ContainerEnvironment(mounts=mounts), [swe] * args.episodes),
            "container, warm pool (warm: 2)": (ContainerEnvironment(mounts=mounts, warm=2), [swe] * args.episodes),
        }
        # Its image built in the episode: a copy of the task with a file of its own (a new image).
        fresh = work / "fresh" / "rect-area"
        shutil.copytree(SWE / "rect-area", fresh)
        (fresh / "environment" / "app" / "fresh.txt").write_text(str(time.time_ns()))
        [cold] = episodes(proxy.url, ContainerEnvironment(mounts=mounts), load_tasks(fresh), 1, work / "cold")
        for name, (environment, tasks) in one.items():
            times = episodes(proxy.url, environment, tasks, 1, work / name.split(",")[0])
            rows.append((name, statistics.median(times), len(times) * 60 / sum(times)))
            print(f"  {name}: done", flush=True)
        rows.insert(2, ("container, image built in the episode (cold)", cold, 60 / cold))
        flow = []
        for level in args.levels:
            for warm in (0, level):
                environment = ContainerEnvironment(mounts=mounts, warm=warm)
                start = time.perf_counter()
                episodes(proxy.url, environment, [swe] * (level * 3), level, work / f"c{level}-{warm}")
                flow.append(("this machine", level, warm, level * 3 * 60 / (time.perf_counter() - start)))
                print(f"  {level} at a time, warm {warm}: done", flush=True)
        with local_cluster(workers=2, cpus=max(args.levels) // 2) as cluster:
            rollouts = RayRollouts(address=cluster.address, env_vars={"DOCKER_HOST": url})
            for level in args.levels:
                environment = ContainerEnvironment(mounts=mounts)
                with engine_for(rollouts, environment) as engine:
                    start = time.perf_counter()
                    episodes(proxy.url, environment, [swe] * (level * 3), level, work / f"r{level}", engine)
                    flow.append(("Ray, 2 worker nodes", level, 0, level * 3 * 60 / (time.perf_counter() - start)))
                print(f"  {level} at a time on Ray: done", flush=True)
    host = rows[0][1]
    print("\nPer episode, one at a time (median; stub upstream at 0 ms, 2 cores, Podman)\n")
    print("| where | s per episode | added to the host's (s) | episodes/min |")
    print("|---|---:|---:|---:|")
    for name, seconds, per_minute in rows:
        print(f"| {name} | {seconds:.2f} | {seconds - host:+.2f} | {per_minute:.1f} |")
    print("\nContainers, several at a time (episodes: 3 x concurrency)\n")
    print("| where | at a time | warm | episodes/min |")
    print("|---|---:|---:|---:|")
    for where, level, warm, per_minute in flow:
        print(f"| {where} | {level} | {warm} | {per_minute:.1f} |")


if __name__ == "__main__":
    main()
