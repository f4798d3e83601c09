"""Episodes in containers, on a real engine (Podman's Docker-compatible service, started once per
test run by the container_engine fixture, or the engine at DOCKER_HOST) with the tasks' base
image built from Debian's packages: the Harbor example's tasks, each episode in a fresh container
of its task's image, its harness inside it talking to the real vLLM through the proxy, scored by
the task's own tests; nothing left behind by a timeout or a SIGTERM."""

from __future__ import annotations

import asyncio
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
import pytest

from benchmarks.support.stack import Upstream, read_store
from harness_adapters.collect import collect
from harness_adapters.config import CollectConfig, load_config
from harness_adapters.environments.box import ContainerError
from harness_adapters.environments.containers import BASE_IMAGE, OWNER, ContainerEnvironment
from harness_adapters.harnesses import CommandAdapter
from harness_adapters.runner import BUILD_FAILED, EpisodeRunner
from harness_adapters.tasks import Task, load_tasks
from recorder.episodes import RewardRule
from tests.support.containers import left

HARBOR = Path(__file__).resolve().parents[2] / "harness_adapters" / "examples" / "harbor"
HOSTILE = Path(__file__).with_name("hostile_agent.py")
CLI = [sys.executable, "-m", "trainer.cli"]


def _task_like(tasks: Path, source: str, name: str, test: str | None = None, timeout: float | None = None) -> None:
    shutil.copytree(tasks / source, tasks / name)
    if test is not None:
        (tasks / name / "tests" / "test.sh").write_text(test)
    if timeout is not None:
        toml = tasks / name / "task.toml"
        toml.write_text(toml.read_text().replace("timeout_sec = 120.0", f"timeout_sec = {timeout}"))
        with open(tasks / name / "environment" / "Dockerfile", "a") as dockerfile:
            dockerfile.write("RUN touch slow\n")


def test_a_task_whose_folder_went_since_it_was_read_is_refused_by_name(tmp_path: Path) -> None:
    """It was "cannot start a container of None" from the engine (a Ray node given the driver's path)."""
    shutil.copytree(HARBOR / "tasks" / "hello-file", tmp_path / "hello-file")
    [task] = load_tasks(tmp_path / "hello-file")
    shutil.rmtree(tmp_path / "hello-file")
    with pytest.raises(ContainerError, match=r"task hello-file: no .*/environment/Dockerfile and no docker_image"):
        asyncio.run(ContainerEnvironment().image_for(task))


def test_tasks_check_tells_a_solution_from_nothing(container_engine: Any, tmp_path: Path) -> None:
    tasks = shutil.copytree(HARBOR / "tasks", tmp_path / "tasks")
    _task_like(tasks, "hello-file", "always-one", test="#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    _task_like(tasks, "hello-file", "broken")
    with open(tasks / "broken" / "environment" / "Dockerfile", "a") as dockerfile:
        dockerfile.write("RUN exit 3\n")
    _task_like(tasks, "hello-file", "malformed")  # a row of its own, not a refusal of the whole dataset
    (tasks / "malformed" / "task.toml").write_text("[verifier]\ntimeout_sec = nan\n")
    (tasks / ".git").mkdir()  # no task
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
        "malformed": (None, None, False),
    }
    assert (
        results["malformed"]["error"] == "malformed: task.toml: verifier.timeout_sec must be from 1 to 86400, not nan"
    )
    assert "the tests cannot tell a solution from nothing" in results["always-one"]["error"]
    assert "broken/environment failed" in results["broken"]["error"] and "exit 3" in results["broken"]["error"]
    assert (tmp_path / "logs" / "fix-add" / "oracle" / "verifier" / "reward.json").is_file()  # the logs are kept
    again = subprocess.run([*check[:5], str(tasks / "hello-file")], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "building image" not in again.stderr, again.stderr  # built once, cached
    assert left(container_engine) == []


@pytest.mark.vllm
def test_each_episode_runs_in_a_fresh_container_and_the_tasks_tests_score_it(
    vllm: Upstream, container_engine: Any, tmp_path: Path
) -> None:
    """The shipped collect config with a harness that makes one model call (the example's agent,
    one step), then writes hello.txt, reads its own limits and leaves a file in /logs/agent: the
    hello task always scores 1, the others 0, so the tests saw what the harness did inside the
    container (in the image's WORKDIR, /app). hello.txt is written before the agent too: the agent
    runs the command the model sampled, for up to 60 s, and in CI the slow task's 45 s ran out
    before the harness had solved it (it scored 0)."""
    tasks = shutil.copytree(HARBOR / "tasks", tmp_path / "tasks")
    _task_like(tasks, "hello-file", "slow", timeout=45)  # [agent] timeout_sec = 45
    _task_like(tasks, "hello-file", "exits-1")
    with open(tasks / "exits-1" / "environment" / "Dockerfile", "a") as dockerfile:
        dockerfile.write("RUN touch fails\n")
    _task_like(tasks, "hello-file", "entrypoint")  # an ENTRYPOINT that is no exec: rl-proxy's sleep stays PID 1
    with open(tasks / "entrypoint" / "environment" / "Dockerfile", "a") as dockerfile:
        dockerfile.write('ENTRYPOINT ["/bin/sh", "-c", "sleep infinity & wait"]\n')
    _task_like(tasks, "hello-file", "broken")
    with open(tasks / "broken" / "environment" / "Dockerfile", "a") as dockerfile:
        dockerfile.write("RUN exit 3\n")
    script = (
        "echo $PWD > /logs/agent/trace.txt; echo hello > hello.txt; "
        'python3 /opt/rl-proxy/agent.py --steps 1 "$0"; echo hello > hello.txt; '
        "echo limits $(cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max)"
        " $(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us 2>/dev/null || cut -d' ' -f1 /sys/fs/cgroup/cpu.max); "
        "if [ -e slow ]; then sleep 600; fi; if [ -e fails ]; then exit 1; fi"
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
    # Solved, then timed out or exited 1 (issue 45): the tests score the container whatever ended
    # the harness, and its own status stays beside the reward.
    harness = {name: r.session.outcome.harness for name, r in by_task.items() if r.session.outcome}
    assert (harness["slow"], by_task["slow"].error) == ("timeout", "killed after 45 s")
    assert harness["exits-1"] == "failed" and harness["hello-file"] == "ok"
    # An image that does not build: the harness never ran; an infrastructure fault, named, not
    # run again (it would fail alike) and not trained (a "failed" one would be, with the run's
    # failure reward).
    broken = by_task.pop("broken")
    assert broken.status == "ended" and broken.error and broken.error.startswith(BUILD_FAILED), broken.error
    assert "exit 3" in broken.error and broken.retried == []
    assert broken.session.training_reward(RewardRule()).why == "unscored"
    scored = {
        name: (r.status, r.reward, [(p.source, p.value) for p in r.session.outcome.parts])  # type: ignore[union-attr]
        for name, r in by_task.items()
    }
    assert scored == {
        "count-lines": ("ok", 0.0, [("tests", 0.0)]),
        "fix-add": ("ok", 0.0, [("tests.positive", 0.0), ("tests.negative", 0.0)]),
        "hello-file": ("ok", 1.0, [("tests", 1.0)]),
        "slow": ("ok", 1.0, [("tests", 1.0)]),
        "exits-1": ("ok", 1.0, [("tests", 1.0)]),
        "entrypoint": ("ok", 1.0, [("tests", 1.0)]),
    }, {name: r.error for name, r in by_task.items()}
    for result in by_task.values():
        assert result.calls >= 1  # the harness in the container reached the proxy
        workdir = tmp_path / "out" / "episodes" / result.session_id
        # What it left in /logs/agent was copied out, from a container killed at its timeout too.
        assert (workdir / "agent" / "trace.txt").read_text() == "/app\n"
        assert (workdir / "verifier" / "test-stdout.txt").is_file()  # the tests' logs, collected
        if result.task.id != "slow":
            # The task's memory_mb (512) and cpus (1: 100,000 us of every 100,000) were the container's limits.
            assert f"limits {512 * 2**20} 100000" in (workdir / "harness.stdout").read_text()
    assert left(container_engine) == []


def test_the_runs_sweep_is_not_undone_by_a_container_its_episode_removed_meanwhile(container_engine: Any) -> None:
    """Seen in CI (issue 46): `collect` SIGTERMed exited 1, not 130. At the run's end its sweep
    listed its containers while a cancelled episode was still removing its own, and Podman
    answered the sweep's inspect of that one "no such container" (HTTP 500), which escaped the
    interrupted run. The fault injected here: one container removed right after the sweep's list."""
    environment = ContainerEnvironment()
    labels = {OWNER: environment._owner}
    made = [container_engine.containers.create(BASE_IMAGE, ["true"], labels=labels) for _ in range(2)]
    api = environment.client().api
    listed = api.containers

    def list_then_lose_one(*args: Any, **kwargs: Any) -> Any:
        found = listed(*args, **kwargs)
        container_engine.api.remove_container(made[0].id, force=True)  # its episode got there first
        return found

    api.containers = list_then_lose_one
    environment.close()
    assert left(container_engine) == []


def test_more_harnesses_than_cpus_run_in_their_containers_at_once(container_engine: Any, tmp_path: Path) -> None:
    """A harness's exec holds a thread for its whole episode. On asyncio's default pool (the CPUs
    + 4 threads: 6 here) no more harnesses than that ran at once, and the next waited for one to
    end, its timeout's kill too. Here the CPUs + 5 execs each wait until all have begun."""
    n = (os.cpu_count() or 1) + 5
    environment = ContainerEnvironment(image=BASE_IMAGE)
    wait_for_all = f"touch /tmp/begun-$$; until [ $(ls /tmp | grep -c begun-) -ge {n} ]; do sleep 0.1; done"

    async def main() -> list[int]:
        async with environment.episode(Task("t", "p"), tmp_path) as box:
            assert box is not None
            with open(os.devnull, "wb") as out:
                execs = [box.run(["sh", "-c", wait_for_all], {}, out, out, 30) for _ in range(n)]
                return list(await asyncio.gather(*execs))

    try:
        assert asyncio.run(main()) == [0] * n
    finally:
        environment.close()
    assert left(container_engine) == []


def test_a_container_still_starting_when_the_run_ends_is_removed_too(
    container_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen in CI (issue 46): `train`, SIGTERMed with warm containers on, left one behind (and the
    eight container tests after it failed on it). asyncio.run's clean-up was cut short (see
    test_cli.py's SIGTERM test) before it joined the thread still starting a warm container, the
    run's sweep came first, and the container, made after the sweep, stayed. The fault injected
    here: the engine's start held until the sweep is done."""
    from docker.models.containers import ContainerCollection

    run, entered, swept = ContainerCollection.run, threading.Event(), threading.Event()

    def after_the_sweep(self: ContainerCollection, **settings: Any) -> Any:
        entered.set()
        swept.wait(60)
        return run(self, **settings)

    monkeypatch.setattr(ContainerCollection, "run", after_the_sweep)
    environment = ContainerEnvironment()
    settings = dict(image=BASE_IMAGE, entrypoint=["sleep", "infinity"], detach=True, labels={OWNER: environment._owner})
    failed: list[BaseException] = []

    def start() -> None:
        try:
            asyncio.run(environment.start(Task("t", "p"), settings))
        except ContainerError as exc:
            failed.append(exc)

    starting = threading.Thread(target=start)
    starting.start()
    assert entered.wait(60)
    environment.close()
    swept.set()
    starting.join(60)
    assert left(container_engine) == []
    assert len(failed) == 1, "the episode that wanted the container learns that the run is over"


@pytest.mark.vllm
@pytest.mark.timeout(500)
@pytest.mark.parametrize(("command", "running"), [("collect", 3), ("train", 2)])
def test_sigterm_removes_every_container_it_started(
    vllm: Upstream, container_engine: Any, tmp_path: Path, command: str, running: int
) -> None:
    """`collect` and `train` (issue 45) on the shipped Harbor config, the harness calling the
    model once and then sleeping: SIGTERM with `running` episodes on in containers (and, for
    train, two warm ones started ahead) exits 130 and leaves no container."""
    import yaml

    config = yaml.safe_load((HARBOR / f"{command}.yaml").read_text())
    config.update(
        run=f"sigterm-{command}", tasks=str(HARBOR / "tasks"), out=str(tmp_path / "out"),
        harness={"type": "command",
                 "argv": ["sh", "-c", 'python3 /opt/rl-proxy/agent.py --steps 1 "$0"; sleep 600', "{prompt}"]},
        environment={"type": "container", "mounts": {str(HARBOR / "agent.py"): "/opt/rl-proxy/agent.py"}},
        proxy={"upstream": vllm.url},
    )  # fmt: skip
    if command == "train":  # and containers started ahead for the episodes waiting for room
        config["eval"], config["environment"]["warm"] = None, 2
        running += 2
    (tmp_path / "run.yaml").write_text(orjson.dumps(config).decode())  # JSON is YAML
    job = subprocess.Popen(
        [*CLI, command, str(tmp_path / "run.yaml")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 300
    while len(container_engine.containers.list(filters={"label": OWNER})) < running:
        assert job.poll() is None and time.monotonic() < deadline, job.stdout.read() if job.stdout else ""
        time.sleep(0.5)
    job.send_signal(signal.SIGTERM)
    output, _ = job.communicate(timeout=120)
    assert job.returncode == 130, output[-4000:]
    assert left(container_engine) == []


def test_a_warm_pool_starts_the_next_episodes_containers_and_leaves_none(
    container_engine: Any, make_proxy: Any, stub: str, tmp_path: Path
) -> None:
    """`warm: 2`, one episode at a time: while one runs, the next ones' containers are started,
    and they begin in them (scored by the task's tests as any); containers started for episodes
    that never came are removed at the end. The model is a stub upstream (NOT vLLM)."""
    [task] = load_tasks(HARBOR / "tasks" / "hello-file")
    environment = ContainerEnvironment(warm=2, mounts={str(HARBOR / "agent.py"): "/opt/rl-proxy/agent.py"})
    harness = CommandAdapter(
        ["sh", "-c", 'python3 /opt/rl-proxy/agent.py --steps 1 "$0"; echo hello > hello.txt', "{prompt}"]
    )
    runner = EpisodeRunner(
        make_proxy(stub).url, harness, [], "stub-model", tmp_path, "warm", 60, 1, environment=environment
    )
    results = asyncio.run(runner.run_all([task], 4))
    assert [(r.status, r.reward) for r in results] == [("ok", 1.0)] * 4, [r.error for r in results]
    assert environment.warm_taken >= 2  # the first episode's own container may be the only cold one

    async def announce_and_wait() -> int:  # episodes announced, then never run
        environment.expect([task] * 2)
        while len(container_engine.containers.list(filters={"label": OWNER})) < 2:
            await asyncio.sleep(0.2)
        return len(container_engine.containers.list(filters={"label": OWNER}))

    assert asyncio.run(asyncio.wait_for(announce_and_wait(), 60)) == 2
    environment.close()
    assert left(container_engine) == []


@pytest.mark.vllm
def test_a_hostile_agent_reaches_its_model_and_nothing_else_and_cannot_write_its_reward(
    vllm: Upstream, container_engine: Any, tmp_path: Path
) -> None:
    """Issue 45: from inside its container, an agent that has not solved count-lines plants
    reward.json and reward.txt, its own tests/test.sh and a job that rewrites the reward, and
    tries the proxy's admin API (list, reward), another session, and vLLM. Its model calls go
    through (under its own session); nothing else does; the task's tests score it 0."""
    config = CollectConfig.model_validate(
        {"run": "hostile", "tasks": str(HARBOR / "tasks" / "count-lines"), "split": "all", "episodes_per_task": 1,
         "out": str(tmp_path / "out"),
         "harness": {"type": "command", "argv": ["python3", "/opt/hostile.py"], "env": {"VLLM_URL": vllm.url}},
         "environment": {"type": "container", "mounts": {str(HOSTILE): "/opt/hostile.py"}},
         "proxy": {"upstream": vllm.url}}
    )  # fmt: skip
    results, _, db = collect(config, progress=False)
    [result] = results
    probe = json.loads((tmp_path / "out" / "episodes" / result.session_id / "agent" / "probe.json").read_text())
    assert probe["model"] == 200 and probe["other_key"] == 200, probe
    for name in ("other_path", "admin_list", "admin_reward", "admin_traversal"):
        assert probe[name] == 404, (name, probe)
    assert str(probe["vllm"]).startswith("unreachable"), probe
    assert result.status == "ok" and result.reward == 0.0, (result.status, result.error)
    assert [(p.source, p.value) for p in result.session.outcome.parts] == [("tests", 0.0)]  # type: ignore[union-attr]
    assert db is not None
    sessions = read_store(db, lambda s: s.list_sessions())
    assert [(s.id, s.calls) for s in sessions] == [(result.session_id, 2)]  # both calls its own, no other session
    assert left(container_engine) == []
