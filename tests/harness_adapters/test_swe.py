"""The SWE-style example (harness_adapters/examples/swe) on a real engine (Podman, the tasks' base
image from Debian's packages): its tasks tell a fix from nothing; the harness presets (mini-swe-
agent, Claude Code, Codex CLI) run unchanged inside each episode's container, and against the
real vLLM each records its calls under the episode's session as exact sequences and fixes
nothing; with a scripted model (a stub upstream, NOT vLLM) each preset's commands fix the bug in
the very container the hidden tests score, and Claude Code's compaction there is placed in the
session graph as its subagents are."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks.support.ray_cluster import worker_nodes
from benchmarks.support.stack import Upstream, read_calls
from benchmarks.support.stub_upstream import stub_app
from harness_adapters import engines
from harness_adapters.collect import collect
from harness_adapters.config import CollectConfig, PresetHarness, load_config
from harness_adapters.engines import pack_folder
from harness_adapters.environments import ContainerEnvironment
from harness_adapters.environments.oracle import check_tasks
from harness_adapters.harnesses.presets import PresetName
from harness_adapters.tasks.harbor import load_harbor
from proxy.server import AppThread
from recorder.episodes import Sampling
from recorder.graph import build_sequences, place
from tests.support.containers import left
from trainer.config import TrainConfig

SWE = Path(__file__).resolve().parents[2] / "harness_adapters" / "examples" / "swe"
FIX = "sed -i 's/width + height/width * height/' shapes/area.py"


def _config(tmp_path: Path, harness: PresetHarness, upstream: str, task: str = "rect-area") -> CollectConfig:
    """The shipped collect config on one task, one episode, with `harness`; the task's agent
    timeout cut to 120 s (a 135M model seldom ends a harness's loop by itself)."""
    tasks = tmp_path / "tasks"
    if not tasks.exists():
        shutil.copytree(SWE / "tasks" / task, tasks / task)
        toml = tasks / task / "task.toml"
        toml.write_text(toml.read_text().replace("timeout_sec = 300.0", "timeout_sec = 120.0"))
    config = load_config(SWE / "collect.yaml", CollectConfig)
    config = config.model_copy(
        update={"tasks": str(tasks), "episodes_per_task": 1, "out": str(tmp_path / harness.type), "harness": harness}
    )
    config.proxy.upstream = upstream
    return config


@pytest.mark.parametrize("example, agent", [("swe", "swe_agent.yaml"), ("shell", "shell_agent.yaml")])
def test_the_trainer_scores_at_the_temperature_mini_samples_at(example: str, agent: str) -> None:
    """Else every episode is refused for its sampling settings and nothing trains: the SWE
    example's train.yaml lacked it (its run stopped after its evaluation, 2026-11-28)."""
    folder = SWE.parent / example
    config = load_config(folder / "train.yaml", TrainConfig)
    sampled = yaml.safe_load((folder / agent).read_text())["model"]["model_kwargs"]["temperature"]
    assert config.train.grpo.get("temperature", 1.0) == sampled


# One task of each kind of bug, of both splits: `rl-proxy tasks check harness_adapters/examples/swe/tasks`
# checks all 24 (docs/environments.md), 24 image builds on a fresh machine.
CHECKED = {"rect-area", "range-sum", "empty-mean", "config-key", "mutable-default", "cart-tax"}


def test_the_swe_tasks_score_their_fix_1_and_nothing_0(container_engine: Any, tmp_path: Path) -> None:
    tasks = load_harbor(SWE / "tasks")
    assert len(tasks) == 24 and sum(t.held_out for t in tasks) == 8
    tasks = [t for t in tasks if t.id in CHECKED]
    results = asyncio.run(check_tasks(ContainerEnvironment(), tasks, tmp_path, concurrency=2))
    assert {r.task: (r.oracle_reward, r.noop_reward, r.error) for r in results} == {
        t.id: (1.0, 0.0, None) for t in tasks
    }
    assert left(container_engine) == []


# A scripted model's answers to mini-swe-agent (a stub upstream, NOT vLLM): the fix, then mini's own submit.
ANSWERS = [
    f"THOUGHT: the area multiplies.\n\n```mswea_bash_command\n{FIX}\n```",
    "THOUGHT: done.\n\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```",
]


def test_mini_acts_in_the_container_the_hidden_tests_score(container_engine: Any, tmp_path: Path) -> None:
    """Mini-swe-agent, told the fix by the scripted model: the task's hidden tests see the fixed file."""
    with AppThread(stub_app(answers=ANSWERS)) as stub:
        [result] = collect(_config(tmp_path, PresetHarness(type="mini"), f"{stub.url}/v1"), progress=False)[0]
    assert result.session.outcome and result.session.outcome.harness == "ok", result.error
    assert (result.status, result.reward, result.calls) == ("ok", 1.0, 2)
    assert left(container_engine) == []


@pytest.mark.parametrize(
    "preset, tool",
    [("claude-code", ("Bash", {"command": FIX})), ("codex", ("exec_command", {"cmd": FIX}))],
)
def test_claude_code_and_codex_act_in_the_container_the_hidden_tests_score(
    container_engine: Any, tmp_path: Path, preset: PresetName, tool: tuple[str, dict[str, str]]
) -> None:
    """Each told the fix by a scripted model (a stub upstream, NOT vLLM) as its own shell tool's
    call, then an answer: the task's hidden tests see the fixed file."""
    name, arguments = tool
    with AppThread(stub_app(answers=["Fixed."], tool_calls=[(name, json.dumps(arguments))])) as stub:
        config = _config(tmp_path, PresetHarness(type=preset), f"{stub.url}/v1")
        [result] = collect(config, progress=False)[0]
    assert (result.status, result.reward, result.calls) == ("ok", 1.0, 2), result.error
    assert left(container_engine) == []


@pytest.mark.slow
def test_the_mini_preset_on_ray_nodes_acts_in_their_containers(
    ray_cluster: Any, container_engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 47, item 4: the same preset and task with `rollouts: {engine: ray}` on the local
    cluster's two worker nodes (each finds the task's image on its engine, Podman's behind both,
    or builds it): mini-swe-agent runs in each episode's container on the node Ray chose, the
    scripted fix scores 1 there, and no container is left. The task's folder travels with the
    task: it is gone from the driver's disk once packed, and the nodes still build and score."""

    def pack_then_remove(folder: Path) -> bytes:
        packed = pack_folder(folder)
        shutil.rmtree(folder)
        return packed

    monkeypatch.setattr(engines, "pack_folder", pack_then_remove)
    with AppThread(stub_app(answers=ANSWERS)) as stub:
        config = _config(tmp_path, PresetHarness(type="mini"), f"{stub.url}/v1")
        engine = {"DOCKER_HOST": os.environ["DOCKER_HOST"]}
        rollouts = {"engine": "ray", "address": ray_cluster.address, "env_vars": engine}
        config = CollectConfig.model_validate({**config.model_dump(), "episodes_per_task": 2, "rollouts": rollouts})
        results = collect(config, progress=False)[0]
    assert [(r.status, r.reward, r.calls) for r in results] == [("ok", 1.0, 2)] * 2, [r.error for r in results]
    assert {r.node for r in results} <= worker_nodes(ray_cluster) and all(r.node for r in results)
    assert left(container_engine) == []


@pytest.mark.vllm
@pytest.mark.slow
def test_each_preset_records_exact_sequences_in_the_container_and_fixes_nothing(
    vllm: Upstream, container_engine: Any, tmp_path: Path
) -> None:
    """The real SmolLM2-135M through each preset, unchanged, on one task: every call through the
    episode's gateway, recorded under its session with its tokens, each call in an exact
    sequence; the hidden tests score the untouched bug 0."""
    presets = {
        "mini": (PresetHarness(type="mini", args=["-c", "agent.step_limit=2"]), "chat.completions"),
        "claude-code": (
            PresetHarness(
                type="claude-code",
                args=["--max-turns", "2", "--system-prompt", "Fix the bug with your tools."],  # its own: ~5,000 tokens
                env={"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64"},
            ),
            "anthropic.messages",
        ),
        "codex": (  # its own instructions are ~3,800 tokens: one line instead, a file the preset writes
            PresetHarness(
                type="codex",
                args=["-c", 'model_instructions_file="/tmp/codex/instructions.md"'],
                files={"/tmp/codex/instructions.md": "Fix the bug with your tools."},
            ),
            "openai.responses",
        ),
    }
    for name, (harness, api) in presets.items():
        config = _config(tmp_path, harness, vllm.url)
        config.proxy.max_completion_tokens = 48  # short answers: the harness is tested here, not the model
        [result] = collect(config, progress=False)[0]
        assert (result.status, result.reward) == ("ok", 0.0), (name, result.error)
        calls = read_calls(str(tmp_path / name / "rl-proxy.db"), result.session_id)
        assert calls and all(c.ok and c.api == api and c.completions[0].token_ids for c in calls), name
        report = build_sequences(calls)
        assert sum(len(s.calls) for s in report.sequences) == report.calls == len(calls), (name, report)
        assert not report.skipped, name
    assert left(container_engine) == []


@pytest.mark.vllm
@pytest.mark.slow
def test_claude_codes_subagent_in_the_container_is_placed_in_the_session_graph(
    vllm: Upstream, container_engine: Any, tmp_path: Path
) -> None:
    """Claude Code's preset with the config's `sampling:` forcing its Agent tool where offered
    (greedy): the subagent it starts inside the container (defined by `--agents`: two tools and
    a short prompt, as the host's graph test does) is placed under the call that sampled it."""
    prompt = "You are a helpful agent. Do the task you are given with your tools, then answer in one sentence."
    agents = {"general-purpose": {"description": "Runs commands.", "prompt": prompt, "tools": ["Bash", "Read"]}}
    args = ["--tools", "Agent", "--max-turns", "1", "--system-prompt", "Use a subagent."]
    args += ["--agents", json.dumps(agents).replace("{", "{{").replace("}", "}}")]  # args are templates: {prompt}
    harness = PresetHarness(type="claude-code", args=args, env={"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "120"})
    config = _config(tmp_path, harness, vllm.url).model_copy(
        update={"sampling": Sampling(tool_choice="Agent", temperature=0)}
    )
    [result] = collect(config, progress=False)[0]
    calls = read_calls(str(tmp_path / "claude-code" / "rl-proxy.db"), result.session_id)
    edges = [(p.edge, p.parent) for p in place(calls)]
    assert ("subagent", 1) in edges and len(calls) >= 2, (edges, result.error)
    assert left(container_engine) == []


# A scripted model's summary for Claude Code's compaction (a stub upstream, NOT vLLM), in the
# form it asks for; and a Stop hook that has it go on twice after answering (Claude Code's -p
# ends at an answer without a tool call; a 135M model seldom makes one that works).
SUMMARY = "<analysis>It names one file.</analysis>\n\n<summary>\nrectangle_area in shapes/area.py adds.\n</summary>"
DECISION = json.dumps({"decision": "block", "reason": "Go on."})
GO_ON_TWICE = f"touch /tmp/stops; n=$(wc -l < /tmp/stops); echo >> /tmp/stops; [ $n -ge 2 ] || echo '{DECISION}'"
GO_ON = {"hooks": {"Stop": [{"hooks": [{"type": "command", "command": GO_ON_TWICE}]}]}}


def test_claude_codes_compaction_in_the_container_is_placed_in_the_session_graph(
    container_engine: Any, tmp_path: Path
) -> None:
    """Claude Code's own automatic compaction, inside the container: a window set by
    CLAUDE_CODE_AUTO_COMPACT_WINDOW (without it Claude Code compacts only near the 200k tokens it
    believes a model has) and a threshold of 0.01% of it, so that it compacts as soon as there is
    an earlier turn to summarize. The conversation that goes on from the summary is placed as a
    compaction of the call that wrote it (it was `new`: Claude Code carries only the <summary>
    block's text)."""
    env = {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": "100000", "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "0.01"}
    args = ["--settings", json.dumps(GO_ON).replace("{", "{{").replace("}", "}}")]  # args are templates: {prompt}
    with AppThread(stub_app(answers=["I read the task.", "I read it again."], summary=SUMMARY)) as stub:
        config = _config(tmp_path, PresetHarness(type="claude-code", args=args, env=env), f"{stub.url}/v1")
        [result] = collect(config, progress=False)[0]
    calls = read_calls(str(tmp_path / "claude-code" / "rl-proxy.db"), result.session_id)
    summarized = [c.seq for c in calls if "<summary>" in json.dumps(c.request["messages"][-1])]
    edges = [(p.edge, p.parent) for p in place(calls)]
    assert result.status == "ok" and len(summarized) == 1, (result.error, edges)
    assert edges[summarized[0] :] == [("compaction", summarized[0])], edges
    assert left(container_engine) == []
