"""Episodes through the proxy: every adapter on the real vLLM CPU server, each episode a
recorded session with its rewards; failures (a harness that ignores the proxy, a hung harness,
a verifier that raises) reported and contained; `rl-proxy collect` on the shipped example."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sqlite3
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from benchmarks.support.stack import RunningProxy, Upstream
from benchmarks.support.stub_upstream import MODEL, stub_app
from harness_adapters.config import CollectConfig, ConfigError, load_config
from harness_adapters.harnesses import (
    AgentsSdkAdapter,
    CommandAdapter,
    Endpoint,
    LangChainAdapter,
    Outcome,
    PythonAdapter,
    load_callable,
)
from harness_adapters.rewards import CommandReward, HarnessReward, JudgeReward, PythonReward, RewardError, RewardSource
from harness_adapters.runner import EpisodeResult, EpisodeRunner
from harness_adapters.tasks import Task, load_tasks
from proxy.server import AppThread
from recorder.graph import build_sequences
from trainer.cli import app

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parents[1] / "harness_adapters" / "examples" / "arithmetic"
TASKS = [Task("hello", "Say hello."), Task("colours", "Name a colour.")]


def run(
    proxy: RunningProxy,
    model: str,
    adapter: Any,
    rewards: list[RewardSource],
    tasks: list[Task],
    tmp_path: Path,
    episodes: int = 1,
    timeout: float = 120,
) -> list[EpisodeResult]:
    runner = EpisodeRunner(proxy.url, adapter, rewards, model, tmp_path / "work", "test", timeout, concurrency=4)
    return asyncio.run(runner.run_all(tasks, episodes))


def rewards_in(db: str, session_id: str) -> list[tuple[str, float]]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("select source, value from rewards where session_id = ? order by id", (session_id,))
        return [(source, value) for source, value in rows]


def session_row(db: str, session_id: str) -> tuple[str, dict[str, Any], str | None]:
    """A session's status, outcome and group, as the store's database holds them."""
    with sqlite3.connect(db) as conn:
        status, outcome, group = conn.execute(
            "select status, outcome, group_id from sessions where id = ?", (session_id,)
        ).fetchone()
    return status, json.loads(outcome), group


def nonempty(task: Task, outcome: Any) -> float:
    return float(bool(outcome.output.strip()))


def strict(task: Task, outcome: Any) -> Any:
    if task.id == "raises":
        raise ValueError("cannot score this")
    return "not a number" if task.id == "word" else 1.0


async def one_call(client: Any, task: Task, model: str) -> str:
    reply = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": task.prompt}], max_tokens=8, temperature=0
    )
    return reply.choices[0].message.content or ""


@pytest.mark.vllm
def test_command_adapter_runs_a_cli_agent_scored_by_itself_and_a_command(
    proxy: RunningProxy, vllm: Upstream, tmp_path: Path
) -> None:
    adapter = CommandAdapter([sys.executable, str(HERE / "cli_agent.py"), "{prompt}", "--post-reward", "0.25"])
    check = ["sh", "-c", "echo checking {task_id}; echo 1"]  # its last line is the reward
    rewards = [HarnessReward(), CommandReward(weight=0.5, command=check)]
    results = run(proxy, vllm.model, adapter, rewards, TASKS, tmp_path, episodes=2)
    assert [(r.task.id, r.status) for r in results] == [("hello", "ok")] * 2 + [("colours", "ok")] * 2
    for result in results:
        assert result.calls == 2 and result.reward == pytest.approx(0.75) and result.outcome.output
        assert rewards_in(proxy.db, result.session_id) == [("harness", 0.25), ("command", 0.5)]
        status, outcome, group = session_row(proxy.db, result.session_id)
        assert status == "ok" and group == f"test/{result.task.id}" and outcome["reward"] == 0.75
        assert [(p["source"], p["value"]) for p in outcome["parts"]] == [("harness", 0.25), ("command", 0.5)]
        calls = proxy.calls(result.session_id)
        assert [c.seq for c in calls] == [1, 2] and all(c.ok and c.completions[0].token_ids for c in calls)
    [session] = [s for s in proxy.sessions() if s.id == results[0].session_id]
    assert session.reward == pytest.approx(0.75) and session.task_id == "hello" and session.run == "test"


@pytest.mark.vllm
def test_python_adapter_with_the_shipped_example_merges_each_episode(
    proxy: RunningProxy, vllm: Upstream, tmp_path: Path
) -> None:
    adapter = PythonAdapter(load_callable(f"{EXAMPLE / 'agent.py'}:agent"))
    rewards = [PythonReward(function=f"{EXAMPLE / 'agent.py'}:score")]
    # Greedy, so that the same turns come every run: at temperature 1 the model now and then
    # writes a token split that re-tokenizes differently (a reported "prefix diverges" break).
    tasks = [replace(t, data={**t.data, "temperature": 0}) for t in load_tasks(EXAMPLE / "tasks.jsonl", "heldout")[:4]]
    results = run(proxy, vllm.model, adapter, rewards, tasks, tmp_path)
    score = load_callable(f"{EXAMPLE / 'agent.py'}:score")
    for result in results:
        assert result.status == "ok" and result.reward == score(result.task, result.outcome)
        assert rewards_in(proxy.db, result.session_id) == [("python", result.reward)]
        report = build_sequences(proxy.calls(result.session_id))
        # The calculator is written as text: every turn of an episode is one training sequence.
        assert len(report.sequences) == 1 and len(report.sequences[0].calls) == result.calls >= 1


@pytest.mark.vllm
@pytest.mark.parametrize("library", ["agents_sdk", "langchain"])
def test_agent_library_adapters(proxy: RunningProxy, vllm: Upstream, tmp_path: Path, library: str) -> None:
    if library == "agents_sdk":
        from agents import Agent, ModelSettings

        adapter: Any = AgentsSdkAdapter(
            lambda task: Agent(name="a", instructions="Be brief.", model_settings=ModelSettings(max_tokens=16))
        )
    else:
        adapter = LangChainAdapter(lambda llm, task: llm.bind(max_tokens=16))
    rewards = [PythonReward(function="tests.harness_adapters.test_episodes:nonempty")]
    results = run(proxy, vllm.model, adapter, rewards, TASKS, tmp_path)
    for result in results:
        assert result.status == "ok" and result.calls == 1 and result.reward == 1.0, result.error
        [call] = proxy.calls(result.session_id)
        assert call.ok and call.api == ("openai.responses" if library == "agents_sdk" else "chat.completions")


@pytest.mark.vllm
def test_a_harness_that_ignores_the_proxy_is_reported_by_name(
    proxy: RunningProxy, vllm: Upstream, tmp_path: Path
) -> None:
    lost = CommandAdapter([sys.executable, str(HERE / "cli_agent.py"), "{prompt}", "--ignore-base-url"])
    rewards = [PythonReward(function="tests.harness_adapters.test_episodes:nonempty")]
    [result] = run(proxy, vllm.model, lost, rewards, TASKS[:1], tmp_path)
    assert result.status == "no_calls" and result.reward is None and "no call through the proxy" in str(result.error)
    assert rewards_in(proxy.db, result.session_id) == []
    assert session_row(proxy.db, result.session_id)[0] == "no_calls"


@pytest.mark.vllm
def test_a_verifier_that_raises_or_gives_no_number_fails_only_its_episode(
    proxy: RunningProxy, vllm: Upstream, tmp_path: Path
) -> None:
    tasks = [Task("raises", "Say hi."), Task("word", "Say hi."), Task("fine", "Say hi.")]
    rewards = [PythonReward(function="tests.harness_adapters.test_episodes:strict")]
    by_task = {r.task.id: r for r in run(proxy, vllm.model, PythonAdapter(one_call), rewards, tasks, tmp_path)}
    assert by_task["raises"].status == "failed" and "ValueError: cannot score this" in str(by_task["raises"].error)
    assert by_task["word"].status == "failed" and "not a finite number: 'not a number'" in str(by_task["word"].error)
    assert by_task["fine"].status == "ok" and by_task["fine"].reward == 1.0
    assert all(r.calls == 1 for r in by_task.values())


def test_a_hung_harness_is_killed_with_its_whole_process_group(tmp_path: Path) -> None:
    script = "sleep 300 & echo $! > child.pid; sleep 300"
    adapter = CommandAdapter(["sh", "-c", script], grace=1.0)
    # 8 s: time enough, on a loaded machine (a niced test worker beside the shared vLLM), for sh
    # to start its child and write child.pid.
    outcome = asyncio.run(adapter.run(Task("hang", "wait"), Endpoint("http://127.0.0.1:9", "k", "m"), tmp_path, 8))
    assert outcome.status == "timeout" and "killed after 8 s" in str(outcome.error)
    assert outcome.seconds < 20
    status = Path(f"/proc/{int((tmp_path / 'child.pid').read_text())}/status")

    def gone() -> bool:  # or a zombie not yet reaped
        with contextlib.suppress(FileNotFoundError):
            return "State:\tZ" in status.read_text()
        return True

    # A SIGKILLed process dies when next scheduled: on a loaded machine, a moment after killpg.
    deadline = time.monotonic() + 10
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(), status.read_text()


def test_an_episode_cancelled_as_its_harness_starts_leaves_no_harness_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`collect` stopped by SIGTERM as its episodes started left their harnesses running (a CI
    run): cancelled inside asyncio's start of the process, asyncio kills the process it started
    (the supervisor) and nothing else. Here the start is held open (fault injection: the process
    is up, its start not yet returned) until the harness's child is there, then cancelled."""
    script = "sleep 300 & echo $! > child.pid; sleep 300"
    start = asyncio.create_subprocess_exec

    async def slow_start(*args: Any, **kwargs: Any) -> Any:
        proc = await start(*args, **kwargs)
        while not (tmp_path / "child.pid").is_file() or not (tmp_path / "child.pid").read_text().strip():
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # the cancel lands in here
        return proc

    async def cancelled() -> None:
        monkeypatch.setattr(asyncio, "create_subprocess_exec", slow_start)
        episode = asyncio.create_task(
            CommandAdapter(["sh", "-c", script]).run(
                Task("t", "p"), Endpoint("http://127.0.0.1:9", "k", "m"), tmp_path, 600
            )
        )
        await _cancelled_once_its_child_runs(episode, tmp_path / "child.pid")

    asyncio.run(cancelled())
    _gone(tmp_path / "child.pid")


async def _cancelled_once_its_child_runs(task: asyncio.Task[Any], pid_file: Path) -> None:
    """Cancel `task` once the child whose pid `pid_file` holds runs; it ends cancelled."""
    deadline = time.monotonic() + 60
    while not pid_file.is_file() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def _gone(pid_file: Path) -> None:
    """The process whose pid `pid_file` holds exits (or is a zombie) within 10 s."""
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    state = _state(pid)
    while state not in ("gone", "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
        state = _state(pid)
    assert state in ("gone", "Z"), f"process {pid} still runs ({state})"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


@pytest.mark.parametrize("end", ["timeout", "cancel"])
def test_a_reward_command_ended_leaves_no_process_of_it(tmp_path: Path, end: str) -> None:
    """A verifier command that outlives its timeout, or whose episode is cancelled, is killed
    with what it started: only the process itself was killed at the timeout, nothing at a
    cancel, and a test runner it had started ran on."""
    reward = CommandReward(command=["sh", "-c", "sleep 300 & echo $! > child.pid; sleep 300"], timeout=2)

    async def scored() -> None:
        scoring = asyncio.create_task(
            reward.score(Task("t", "p"), Outcome("ok"), Endpoint("http://127.0.0.1:9", "k", "m"), tmp_path, None)
        )
        if end == "timeout":
            with pytest.raises(RewardError, match="timed out"):
                await scoring
            return
        await _cancelled_once_its_child_runs(scoring, tmp_path / "child.pid")

    asyncio.run(scored())
    _gone(tmp_path / "child.pid")


def test_a_runner_killed_outright_leaves_no_harness_process(tmp_path: Path) -> None:
    """Issue 45: a runner that dies with no chance to unwind (a Ray worker killed at a cancel's
    deadline, SIGKILL) took no harness with it: the harness's children ran on. Under its
    supervisor the whole group goes with the runner."""
    import signal
    import subprocess

    script = "sleep 300 & echo $! > child.pid; sleep 300"
    runner = (
        "import asyncio, sys; from pathlib import Path; "
        "from harness_adapters.harnesses import CommandAdapter, Endpoint; from harness_adapters.tasks import Task; "
        f"asyncio.run(CommandAdapter(['sh', '-c', {script!r}]).run("
        "Task('t', 'p'), Endpoint('http://127.0.0.1:9', 'k', 'm'), Path(sys.argv[1]), 600))"
    )
    process = subprocess.Popen([sys.executable, "-c", runner, str(tmp_path)], cwd=HERE.parents[1])
    deadline = time.monotonic() + 60
    while not (tmp_path / "child.pid").is_file() or not (tmp_path / "child.pid").read_text().strip():
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    process.send_signal(signal.SIGKILL)
    process.wait()
    status = Path(f"/proc/{int((tmp_path / 'child.pid').read_text())}/status")
    deadline = time.monotonic() + 10
    while status.exists() and "State:\tZ" not in status.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not status.exists() or "State:\tZ" in status.read_text(), status.read_text()


def test_an_infrastructure_fault_is_no_failure_of_the_agent_and_runs_the_episode_again(
    make_proxy: Any, stub: str, tmp_path: Path
) -> None:
    """Issue 45: an error that is not the harness's (a container engine's connection lost, an
    error of ours) escaped the episode, left its session active and, under async training, lost
    its whole group; an engine error mid-run was trained as the agent's failure. Now the attempt
    ends "ended" (infra, never trained), the episode runs again under a new session that names
    it, and the group is whole. The upstream is the stub (fault injection, no model needed)."""
    import requests

    from recorder.episodes import RewardRule

    proxy = make_proxy(stub)

    @dataclass
    class Flaky:  # a harness whose environment's engine fails the first attempt of each episode
        failed: set[int] = field(default_factory=set)

        async def run(self, task: Task, endpoint: Endpoint, workdir: Path, timeout: float, box: Any = None) -> Outcome:
            from openai import AsyncOpenAI

            async with AsyncOpenAI(base_url=endpoint.openai_base_url, api_key=endpoint.api_key) as client:
                await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
            episode = int(task.data["n"])
            if episode not in self.failed:
                self.failed.add(episode)
                raise requests.ConnectionError("the engine went away")
            return Outcome("ok")

    runner = EpisodeRunner(
        proxy.url, Flaky(), [CommandReward(command=["echo", "1"])], MODEL, tmp_path / "work", "infra"
    )
    tasks = [Task(f"t{n}", "go", data={"n": n}) for n in range(2)]
    results = asyncio.run(runner.run_all(tasks, 1))
    assert [(r.status, r.reward) for r in results] == [("ok", 1.0), ("ok", 1.0)], [r.error for r in results]
    sessions = {s.id: s for s in proxy.sessions()}
    for result in results:
        [earlier] = result.retried
        first = sessions[str(earlier["session_id"])]
        assert first.status == "ended" and (first.outcome.error or "").startswith("infra: ConnectionError")  # type: ignore[union-attr]
        assert first.training_reward(RewardRule()).value is None  # never trained
        assert sessions[result.session_id].metadata["replaces"] == first.id


def test_crashes_and_bad_templates_become_failed_outcomes(tmp_path: Path) -> None:
    endpoint, task = Endpoint("http://127.0.0.1:9", "k", "m"), Task("t", "p")
    crashed = asyncio.run(CommandAdapter(["sh", "-c", "echo boom >&2; exit 3"]).run(task, endpoint, tmp_path, 10))
    assert crashed.status == "failed" and crashed.exit_code == 3 and "boom" in str(crashed.error)
    missing = asyncio.run(CommandAdapter(["{nothing}"]).run(task, endpoint, tmp_path, 10))
    assert missing.status == "failed" and "bad template" in str(missing.error)

    async def broken(client: Any, task: Task) -> str:
        raise RuntimeError("agent bug")

    failed = asyncio.run(PythonAdapter(broken).run(task, endpoint, tmp_path, 10))
    assert failed.status == "failed" and "RuntimeError: agent bug" in str(failed.error)
    assert "Traceback" in Path(str(failed.log)).read_text()


def test_a_harness_that_deletes_its_own_log_and_output_still_ends_as_an_episode(tmp_path: Path) -> None:
    """An agent's commands run in the workdir, where the adapter keeps the harness's log and
    stdout: an `rm -rf *` there once crashed a whole training run."""
    endpoint, task = Endpoint("http://127.0.0.1:9", "k", "m"), Task("t", "p")
    wiped = CommandAdapter(["sh", "-c", "rm -rf ./*; echo still here; echo why >&2; exit 1"])
    outcome = asyncio.run(wiped.run(task, endpoint, tmp_path, 10))
    assert outcome.status == "failed" and outcome.output == "still here" and "why" in str(outcome.error)


def test_a_judge_reward_through_litellm(make_proxy: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The judge is a STUB upstream answering "0.75" (any model litellm reaches would do)."""
    monkeypatch.setenv("RLP_TEST_JUDGE_KEY", "none")
    with AppThread(stub_app()) as policy, AppThread(stub_app(answer="0.75")) as judge:
        proxy = make_proxy(f"{policy.url}/v1")
        rubric = JudgeReward(
            weight=2.0,
            rubric="Greets.",
            judge_model=f"openai/{MODEL}",
            judge_base_url=f"{judge.url}/v1",
            judge_api_key_env="RLP_TEST_JUDGE_KEY",
        )
        [scored] = run(proxy, MODEL, PythonAdapter(one_call), [rubric], TASKS[:1], tmp_path)
        silent = JudgeReward(
            rubric="Greets.",
            judge_model=f"openai/{MODEL}",
            judge_base_url=f"{policy.url}/v1",
            judge_api_key_env="RLP_TEST_JUDGE_KEY",
        )
        [unscored] = run(proxy, MODEL, PythonAdapter(one_call), [silent], TASKS[:1], tmp_path)
    assert scored.status == "ok" and scored.reward == 1.5
    assert rewards_in(proxy.db, scored.session_id) == [("judge", 1.5)]
    assert unscored.status == "failed" and "the judge answered no number: 'stub answer'" in str(unscored.error)


@pytest.mark.vllm
def test_collect_runs_the_shipped_example_and_prints_a_success_table(vllm: Upstream, tmp_path: Path) -> None:
    config = (EXAMPLE / "collect.yaml").read_text()
    config = config.replace("tasks: tasks.jsonl", f"tasks: {EXAMPLE / 'tasks.jsonl'}")
    config = config.replace("agent.py:", f"{EXAMPLE / 'agent.py'}:").replace("split: train", "split: heldout")
    config = config.replace("episodes_per_task: 4", "episodes_per_task: 1") + f"out: {tmp_path / 'out'}\n"
    (tmp_path / "collect.yaml").write_text(config)
    done = CliRunner().invoke(
        app, ["collect", str(tmp_path / "collect.yaml"), "--upstream", vllm.url], env={"COLUMNS": "200"}
    )
    assert done.exit_code == 0, done.output
    for task in load_tasks(EXAMPLE / "tasks.jsonl", "heldout"):
        assert f"│ {task.id} " in done.output
    assert "│ all " in done.output and "success = reward >= 1" in done.output
    assert "episodes 12/12, success " in done.output  # off a terminal, lines instead of a bar
    assert "capture grades: FATAL 0, WARN 0" in done.output  # every episode's records usable as they are
    lines = (tmp_path / "out" / "episodes.jsonl").read_text().splitlines()
    assert len(lines) == 12 and all(json.loads(line)["status"] == "ok" for line in lines)
    assert (tmp_path / "out" / "rl-proxy.db").exists()


def test_collect_refuses_a_bad_config_naming_the_key(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("run: x\ntasks: t.jsonl\nharness: {type: python, agent: a.py:f}\nepisodes: 3\n")
    done = CliRunner().invoke(app, ["collect", str(tmp_path / "c.yaml")], env={"COLUMNS": "200"})
    assert done.exit_code == 2 and "episodes: Extra inputs are not permitted" in done.output
    (tmp_path / "t.jsonl").write_text('{"id": "a"}\n')
    (tmp_path / "c.yaml").write_text('run: x\ntasks: t.jsonl\nharness: {type: command, argv: ["true"]}\n')
    done = CliRunner().invoke(app, ["collect", str(tmp_path / "c.yaml")], env={"COLUMNS": "200"})
    assert done.exit_code == 2 and "line 1: missing 'prompt'" in done.output


@pytest.mark.parametrize(
    ("section", "named"),
    [
        ("harness: {type: python}", "harness.python.agent: Field required"),
        ("harness: {type: shell, argv: [x]}", "Input tag 'shell' found using 'type' does not match"),
        ("harness: {type: command, argv: [x], agent: a.py:f}", "harness.command.agent: Extra inputs"),
        ("harness: {type: command, argv: [x]}\nrewards: [{type: harness, weight: 2}]", "its weight must be 1"),
        (
            "harness: {type: command, argv: [x]}\nrewards: [{type: judge, rubric: r}]",
            "judge.judge_model: Field required",
        ),
    ],
)
def test_each_harness_and_reward_kind_checks_its_own_keys(tmp_path: Path, section: str, named: str) -> None:
    (tmp_path / "c.yaml").write_text(f"run: x\ntasks: t.jsonl\n{section}\n")
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config(tmp_path / "c.yaml", CollectConfig)


def test_the_proxy_section_takes_the_serve_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One settings model for serve, collect and train: the section's names are Settings' own."""
    monkeypatch.setenv("MY_PROVIDER_KEY", "sk-test")
    (tmp_path / "c.yaml").write_text(
        "run: x\ntasks: t.jsonl\nharness: {type: command, argv: [x]}\n"
        "proxy: {upstream: 'http://h:1/v1', max_completion_tokens: 64, upstream_token_ids: false,"
        " upstream_api_key_env: MY_PROVIDER_KEY}\n"
    )
    settings = load_config(tmp_path / "c.yaml", CollectConfig).proxy.settings(tmp_path / "out")
    assert (settings.upstream, settings.max_completion_tokens, settings.upstream_token_ids) == (
        "http://h:1/v1",
        64,
        False,
    )
    assert settings.upstream_api_key == "sk-test" and settings.db == str(tmp_path / "out" / "rl-proxy.db")
    (tmp_path / "c.yaml").write_text(
        "run: x\ntasks: t.jsonl\nharness: {type: command, argv: [x]}\nproxy: {token_ids: false}\n"
    )
    with pytest.raises(ConfigError, match=r"proxy\.token_ids: Extra inputs are not permitted"):
        load_config(tmp_path / "c.yaml", CollectConfig)
    # Its own proxy runs in the run's process: workers are for `rl-proxy serve`, used through `url`.
    (tmp_path / "c.yaml").write_text(
        "run: x\ntasks: t.jsonl\nharness: {type: command, argv: [x]}\nproxy: {workers: 4}\n"
    )
    with pytest.raises(ConfigError, match=r"rl-proxy serve --workers N"):
        load_config(tmp_path / "c.yaml", CollectConfig)
