"""Episodes in containers, on a real engine (Podman's Docker-compatible service, started once per
test run by the container_engine fixture, or the engine at DOCKER_HOST) with the tasks' base
image built from Debian's packages: the Harbor example's tasks, each episode in a fresh container
of its task's image, its harness inside it talking to the real vLLM through the proxy, scored by
the task's own tests; nothing left behind by a timeout or a SIGTERM."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from benchmarks.support.stack import Upstream
from harness_adapters.collect import collect
from harness_adapters.config import CollectConfig, load_config
from harness_adapters.environments import OWNER
from recorder.episodes import RewardRule

HARBOR = Path(__file__).resolve().parents[2] / "harness_adapters" / "examples" / "harbor"
CLI = [sys.executable, "-m", "trainer.cli"]


def _left(engine: Any) -> list[str]:
    """The containers any rl-proxy run started that are still there."""
    return [c.name for c in engine.containers.list(all=True, filters={"label": OWNER})]


def _task_like(tasks: Path, source: str, name: str, test: str | None = None, timeout: float | None = None) -> None:
    shutil.copytree(tasks / source, tasks / name)
    if test is not None:
        (tasks / name / "tests" / "test.sh").write_text(test)
    if timeout is not None:
        toml = tasks / name / "task.toml"
        toml.write_text(toml.read_text().replace("timeout_sec = 120.0", f"timeout_sec = {timeout}"))
        with open(tasks / name / "environment" / "Dockerfile", "a") as dockerfile:
            dockerfile.write("RUN touch slow\n")


def test_tasks_check_tells_a_solution_from_nothing(container_engine: Any, tmp_path: Path) -> None:
    tasks = shutil.copytree(HARBOR / "tasks", tmp_path / "tasks")
    _task_like(tasks, "hello-file", "always-one", test="#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    _task_like(tasks, "hello-file", "broken")
    with open(tasks / "broken" / "environment" / "Dockerfile", "a") as dockerfile:
        dockerfile.write("RUN exit 3\n")
    check = [*CLI, "tasks", "check", str(tasks), "--json", "--logs", str(tmp_path / "logs")]
    done = subprocess.run(check, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr  # one task is not ok
    results = {r["task"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert {name: (r["oracle_reward"], r["noop_reward"], r["ok"]) for name, r in results.items()} == {
        "always-one": (1.0, 1.0, False),
        "broken": (None, None, False),
        "count-lines": (1.0, 0.0, True),
        "fix-add": (2.0, 0.0, True),  # two named rewards, each 1
        "hello-file": (1.0, 0.0, True),
    }
    assert "the tests cannot tell a solution from nothing" in results["always-one"]["error"]
    assert "broken/environment failed" in results["broken"]["error"] and "exit 3" in results["broken"]["error"]
    assert (tmp_path / "logs" / "fix-add" / "oracle" / "verifier" / "reward.json").is_file()  # the logs are kept
    again = subprocess.run([*check[:5], str(tasks / "hello-file")], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "building image" not in again.stderr, again.stderr  # built once, cached
    assert _left(container_engine) == []


@pytest.mark.vllm
def test_each_episode_runs_in_a_fresh_container_and_the_tasks_tests_score_it(
    vllm: Upstream, container_engine: Any, tmp_path: Path
) -> None:
    """The shipped collect config with a harness that makes one model call (the example's agent,
    one step), then writes hello.txt, reads its own limits and leaves a file in
    /logs/agent: the hello task always scores 1, the others 0, so the tests saw what the harness
    did inside the container (in the image's WORKDIR, /app)."""
    tasks = shutil.copytree(HARBOR / "tasks", tmp_path / "tasks")
    _task_like(tasks, "hello-file", "slow", timeout=20)  # [agent] timeout_sec = 20: its one call first
    _task_like(tasks, "hello-file", "broken")
    with open(tasks / "broken" / "environment" / "Dockerfile", "a") as dockerfile:
        dockerfile.write("RUN exit 3\n")
    script = (
        'echo $PWD > /logs/agent/trace.txt; python3 /opt/rl-proxy/agent.py --steps 1 "$0"; echo hello > hello.txt; '
        "echo limits $(cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max)"
        " $(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us 2>/dev/null || cut -d' ' -f1 /sys/fs/cgroup/cpu.max); "
        "if [ -e slow ]; then sleep 600; fi"
    )
    config = load_config(HARBOR / "collect.yaml", CollectConfig)
    harness = config.harness.model_copy(update={"argv": ["sh", "-c", script, "{prompt}"]})
    config = config.model_copy(
        update={
            "tasks": str(tasks),
            "split": "all",
            "episodes_per_task": 1,
            "out": str(tmp_path / "out"),
            "harness": harness,
        }
    )
    config.proxy.upstream = vllm.url
    results, _, _ = collect(config, progress=False)
    by_task = {r.task.id: r for r in results}
    assert by_task["slow"].status == "timeout" and by_task["slow"].error == "killed after 20 s"
    # An image that does not build: the harness never ran, and the episode is not trained (a
    # "failed" one would be, with the run's failure reward).
    broken = by_task.pop("broken")
    assert broken.status == "no_calls" and "exit 3" in (broken.error or ""), broken.error
    assert broken.session.training_reward(RewardRule()).why == "unscored"
    scored = {
        name: (r.status, r.reward, [(p.source, p.value) for p in r.session.outcome.parts])  # type: ignore[union-attr]
        for name, r in by_task.items()
        if name != "slow"
    }
    assert scored == {
        "count-lines": ("ok", 0.0, [("tests", 0.0)]),
        "fix-add": ("ok", 0.0, [("tests.positive", 0.0), ("tests.negative", 0.0)]),
        "hello-file": ("ok", 1.0, [("tests", 1.0)]),
    }, {name: r.error for name, r in by_task.items()}
    for result in by_task.values():
        assert result.calls >= 1  # the harness in the container reached the proxy
        workdir = tmp_path / "out" / "episodes" / result.session_id
        # What it left in /logs/agent was copied out, from a container killed at its timeout too.
        assert (workdir / "agent" / "trace.txt").read_text() == "/app\n"
        if result.status == "ok":
            assert (workdir / "verifier" / "test-stdout.txt").is_file()  # the tests' logs, collected
            # The task's memory_mb (512) and cpus (1: 100,000 us of every 100,000) were the container's limits.
            assert f"limits {512 * 2**20} 100000" in (workdir / "harness.stdout").read_text()
    assert _left(container_engine) == []


@pytest.mark.vllm
@pytest.mark.timeout(400)
def test_sigterm_of_collect_removes_every_container_it_started(
    vllm: Upstream, container_engine: Any, tmp_path: Path
) -> None:
    config = {
        "run": "sigterm-containers",
        "tasks": str(HARBOR / "tasks"),
        "out": str(tmp_path / "out"),
        "harness": {
            "type": "command",
            "argv": ["sh", "-c", 'python3 /opt/rl-proxy/agent.py --steps 1 "$0"; sleep 600', "{prompt}"],
        },
        "environment": {"type": "container", "mounts": {str(HARBOR / "agent.py"): "/opt/rl-proxy/agent.py"}},
        "proxy": {"upstream": vllm.url},
    }
    (tmp_path / "collect.yaml").write_text(orjson.dumps(config).decode())  # JSON is YAML
    job = subprocess.Popen(
        [*CLI, "collect", str(tmp_path / "collect.yaml")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 240
    while len(container_engine.containers.list(filters={"label": OWNER})) < 3:  # every task's episode is on
        assert job.poll() is None and time.monotonic() < deadline, job.stdout.read() if job.stdout else ""
        time.sleep(0.5)
    job.send_signal(signal.SIGTERM)
    output, _ = job.communicate(timeout=120)
    assert job.returncode == 130, output[-2000:]
    assert _left(container_engine) == []
