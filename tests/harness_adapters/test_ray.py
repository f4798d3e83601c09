"""Episodes as Ray tasks on a local Ray cluster of several nodes (tests/conftest.py ray_cluster),
with the real vLLM behind the proxy: the episodes spread over the nodes and are all recorded;
container episodes keep each other's containers, and a node lost mid-run loses no episode,
trains none twice and leaves no container; SIGTERM of the driver leaves no Ray task and no
harness process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest

from benchmarks.support.ray_cluster import NODE, worker_nodes
from benchmarks.support.stack import Upstream, read_store
from harness_adapters.collect import collect
from harness_adapters.config import CollectConfig, load_config
from harness_adapters.engines import RayRollouts, engine_for
from recorder.episodes import RewardRule
from tests.support.containers import left

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
EXAMPLE = Path(__file__).resolve().parents[2] / "harness_adapters" / "examples" / "arithmetic"
HARBOR = Path(__file__).resolve().parents[2] / "harness_adapters" / "examples" / "harbor"
CLI_AGENT = Path(__file__).with_name("cli_agent.py")


def _tasks(tmp_path: Path, n: int) -> str:
    rows = (EXAMPLE / "tasks.jsonl").read_text().splitlines()[:n]
    (tmp_path / "tasks.jsonl").write_text("\n".join(rows) + "\n")
    return str(tmp_path / "tasks.jsonl")


def test_collect_spreads_its_episodes_over_the_nodes_and_records_them_all(
    vllm: Upstream, ray_cluster: Any, tmp_path: Path
) -> None:
    """The shipped arithmetic config (a Python agent loaded from a file: it travels by value)."""
    config = load_config(EXAMPLE / "collect.yaml", CollectConfig)
    rollouts = RayRollouts(address=ray_cluster.address, num_cpus=1)
    update = {"tasks": _tasks(tmp_path, 4), "episodes_per_task": 2, "out": str(tmp_path / "out"), "rollouts": rollouts}
    config = config.model_copy(update=update)
    config.proxy.upstream = vllm.url
    results, path, db = collect(config, progress=False)
    assert len(results) == 8 and all(r.status == "ok" and r.calls >= 1 for r in results), [r.error for r in results]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert {line["node"] for line in lines} == worker_nodes(ray_cluster)  # both worker nodes ran episodes
    assert db is not None
    stored = read_store(db, lambda s: s.list_sessions())
    assert sorted(s.id for s in stored) == sorted(r.session_id for r in results)


def test_container_episodes_keep_each_others_containers_and_a_lost_nodes_container_goes(
    vllm: Upstream, ray_cluster: Any, container_engine: Any, tmp_path: Path
) -> None:
    """Issue 45: two quick and two slow container episodes over the two worker nodes (one engine,
    Podman's, behind both). The quick ones end while the slow ones run (before, the first episode
    to end removed every container of the run: the others ended failed, and trained); then the
    node of a running slow one is lost (its raylet and workers: Ray's remove_node without
    grace). Its attempt runs again under a new session that names the lost one, every episode
    scores its tests' 1, the lost sessions end as lost and never train, each group trains
    exactly once, and no container stays (the lost one's is reaped)."""
    tasks = tmp_path / "tasks"
    for name in ("quick", "slow"):
        shutil.copytree(HARBOR / "tasks" / "hello-file", tasks / name)
    script = (
        'python3 /opt/rl-proxy/agent.py --steps 1 "$1"; if [ "$0" = slow ]; then sleep 25; fi; echo hello >hello.txt'
    )
    argv = ["sh", "-c", script, "{task_id}", "{prompt}"]
    config = CollectConfig.model_validate(
        {"run": "ray-containers", "tasks": str(tasks), "split": "all", "episodes_per_task": 2, "concurrency": 4,
         "out": str(tmp_path / "out"), "harness": {"type": "command", "argv": argv},
         "environment": {"type": "container", "mounts": {str(HARBOR / "agent.py"): "/opt/rl-proxy/agent.py"}},
         "rollouts": {"engine": "ray", "address": ray_cluster.address, "num_cpus": 1,
                      "env_vars": {"DOCKER_HOST": os.environ["DOCKER_HOST"]}},
         "proxy": {"upstream": vllm.url}}
    )  # fmt: skip
    out: dict[str, Any] = {}
    driver = threading.Thread(target=lambda: out.update(results=collect(config, progress=False)[0]))
    driver.start()
    db = str(tmp_path / "out" / "rl-proxy.db")
    deadline = time.monotonic() + 240
    try:
        while True:  # the quick ones ended, the slow ones made their call and sleep
            sessions = _sessions(db)
            quick = [s for s in sessions if s.task_id == "quick" and s.status == "ok"]
            slow = [s for s in sessions if s.task_id == "slow" and s.status == "active" and s.calls > 0]
            if len(quick) == 2 and len(slow) == 2:
                break
            assert driver.is_alive() and time.monotonic() < deadline, [(s.task_id, s.status) for s in sessions]
            time.sleep(0.5)
        ray_cluster.remove_node(_node_running_an_episode(ray_cluster), allow_graceful=False)
        driver.join(300)
    finally:
        ray_cluster.add_node(num_cpus=2, **NODE)  # for the tests after this one
    results = out["results"]
    assert [(r.task.id, r.status, r.reward) for r in sorted(results, key=lambda r: r.task.id)] == [
        ("quick", "ok", 1.0), ("quick", "ok", 1.0), ("slow", "ok", 1.0), ("slow", "ok", 1.0)
    ], [r.error for r in results]  # fmt: skip
    sessions = {s.id: s for s in _sessions(db)}
    lost = [s for s in sessions.values() if ((s.outcome and s.outcome.error) or "").startswith("lost: ")]
    assert lost and all(s.task_id == "slow" and s.status == "ended" for s in lost)
    rerun = [s.metadata.get("replaces") for s in sessions.values() if s.metadata.get("replaces")]
    assert sorted(rerun) == sorted(s.id for s in lost)  # each lost attempt run again, once
    trained = [s for s in sessions.values() if s.training_reward(RewardRule()).why == ""]
    assert sorted(s.id for s in trained) == sorted(r.session_id for r in results)  # the lost never train
    groups = [s.group_id for s in trained]
    assert all(groups.count(g) == 2 for g in groups)  # each group complete, exactly once
    assert left(container_engine) == []


def _node_running_an_episode(cluster: Any) -> Any:
    """The worker node whose raylet started a worker that runs an episode (`ray::_play`)."""
    raylets = {node.all_processes["raylet"][0].process.pid: node for node in cluster.list_all_nodes()}
    for process in psutil.process_iter(["cmdline"]):
        if (process.info["cmdline"] or [""])[0].startswith("ray::_play"):
            for parent in process.parents():
                if parent.pid in raylets and raylets[parent.pid] is not cluster.head_node:
                    return raylets[parent.pid]
    raise AssertionError("no worker process runs an episode")


def _sessions(db: str) -> list[Any]:
    return read_store(db, lambda s: s.list_sessions()) if Path(db).exists() else []


@pytest.mark.timeout(400)
def test_sigterm_of_the_driver_leaves_no_ray_task_and_no_harness(
    vllm: Upstream, ray_cluster: Any, tmp_path: Path
) -> None:
    marker = "rlp-ray-sigterm-marker"
    hang = f'"{sys.executable}" -c "import time; time.sleep(600)" {marker}'  # the harness's own child
    argv = ["sh", "-c", f'"{sys.executable}" {CLI_AGENT} "$0" && {hang}', "{prompt}"]
    config = {
        "run": "ray-sigterm", "tasks": _tasks(tmp_path, 2), "out": str(tmp_path / "out"),
        "harness": {"type": "command", "argv": argv},
        "rollouts": {"engine": "ray", "address": ray_cluster.address, "num_cpus": 1},
        "proxy": {"upstream": vllm.url},
    }  # fmt: skip
    (tmp_path / "collect.yaml").write_text(orjson.dumps(config).decode())
    job = subprocess.Popen(
        [sys.executable, "-m", "trainer.cli", "collect", str(tmp_path / "collect.yaml")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while len(_harnesses(marker)) < 2:  # both episodes' harnesses are running, on the worker nodes
        assert job.poll() is None and time.monotonic() < deadline, job.stdout.read() if job.stdout else ""
        time.sleep(0.5)
    job.send_signal(signal.SIGTERM)
    output, _ = job.communicate(timeout=120)
    assert job.returncode == 130, output[-2000:]
    deadline = time.monotonic() + 30
    while _harnesses(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _harnesses(marker) == []
    import ray

    ray.init(address=ray_cluster.address)
    try:  # every CPU of the cluster is free again: no task of the driver's is left running
        deadline = time.monotonic() + 30
        while (
            ray.available_resources().get("CPU") != ray.cluster_resources().get("CPU") and time.monotonic() < deadline
        ):
            time.sleep(0.5)
        assert ray.available_resources().get("CPU") == ray.cluster_resources().get("CPU") == 4
    finally:
        ray.shutdown()


def _harnesses(marker: str) -> list[str]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        if marker in line and "pytest" not in line:
            found.append(line)
    return found


def test_a_progress_line_neither_waits_on_nor_fails_with_a_placement_that_does_not_answer(ray_cluster: Any) -> None:
    """The progress line is written on the run's event loop: a placement actor that hangs holds
    the loop 5 s at most, and one that is gone is said so; neither ends the run."""
    import ray

    class Stuck:
        def counts(self) -> dict[str, int]:
            time.sleep(60)
            return {}

    with engine_for(RayRollouts(address=ray_cluster.address)) as engine:
        assert engine is not None
        ray.get(engine.placement.counts.remote())  # the actor started, however long that took
        assert engine.describe() == "running 0 (none), queued 0"
        engine.placement = ray.remote(Stuck).options(num_cpus=0).remote()
        began = time.monotonic()
        assert "did not answer" in engine.describe()
        assert time.monotonic() - began < 15
        ray.kill(engine.placement)
        assert engine.describe().startswith("episodes per node: unknown (")
