"""The shell example (harness_adapters/examples/shell): its verifier on work directories made
by hand, and mini-swe-agent, unchanged, running its tasks through the proxy on the real vLLM,
each episode scored by what it left in its own work directory."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks.support.stack import Upstream
from harness_adapters.collect import collect
from harness_adapters.config import CollectConfig, load_config
from harness_adapters.harnesses import Outcome
from harness_adapters.rewards import PythonReward
from harness_adapters.tasks import Task, load_tasks
from trainer.config import TrainConfig

SHELL = Path(__file__).resolve().parents[2] / "harness_adapters" / "examples" / "shell"
needs_bwrap = pytest.mark.usefixtures("bwrap")  # the shell example runs in bubblewrap


def _done(task: Task, workdir: Path) -> None:
    """What a harness that solved `task` would leave."""
    data = task.data
    target = workdir / data["file"]
    if data["kind"] in ("create", "count"):
        target.write_text(data["word"] + "\n")
    elif data["kind"] == "rename":
        (workdir / data["old"]).rename(target)
    elif data["kind"] == "copy":
        shutil.copy(workdir / data["old"], target)
    elif data["kind"] == "delete":
        target.unlink()
    elif data["kind"] == "mkdir":
        target.mkdir()


def test_the_verifier_scores_what_the_work_directory_holds(tmp_path: Path) -> None:
    tasks = load_tasks(SHELL / "tasks.jsonl")
    assert {t.data["kind"] for t in tasks if t.held_out} == {t.data["kind"] for t in tasks if not t.held_out}
    verifier = PythonReward(function=f"{SHELL / 'verify.py'}:score").resolved(str)

    def scored(task: Task, workdir: Path) -> float:
        return asyncio.run(verifier.score(task, Outcome("ok"), None, workdir, None))  # type: ignore[arg-type]

    for task in tasks:
        workdir = tmp_path / task.id
        workdir.mkdir()
        (workdir / task.data["setup"]).write_text(task.data["setup_text"])
        assert scored(task, workdir) == 0.0, task.id  # the starting directory does not solve its task
        _done(task, workdir)
        assert scored(task, workdir) == 1.0, task.id


@needs_bwrap
@pytest.mark.parametrize("name", ["collect.yaml", "train.yaml"])
def test_the_harness_can_write_only_its_work_directory(tmp_path: Path, name: str) -> None:
    """The configs' sandbox, with a shell in place of mini: the work directory is writable,
    every other path is not, /tmp (where pytest's folders are) included."""
    adapter = load_config(SHELL / name, TrainConfig if name == "train.yaml" else CollectConfig).adapter()
    sandbox = adapter.argv[: adapter.argv.index("--") + 1]  # type: ignore[attr-defined]
    workdir, outside = tmp_path / "work", tmp_path / "outside.txt"
    workdir.mkdir()
    outside.write_text("keep")
    canary = Path("/usr/rl-proxy-sandbox-canary")
    script = f"echo made > made.txt; rm -f {outside}; touch {canary}"
    done = subprocess.run(
        [a.format(workdir=workdir) for a in sandbox] + ["sh", "-c", script],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (workdir / "made.txt").read_text() == "made\n", done.stderr
    assert outside.read_text() == "keep" and not canary.exists()
    assert "Read-only file system" in done.stderr


@needs_bwrap
@pytest.mark.vllm
@pytest.mark.slow
def test_mini_swe_agent_runs_the_shell_tasks_and_each_episode_is_scored_by_its_directory(
    vllm: Upstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped collect config as it is (mini-swe-agent from PyPI, its config beside the
    example), with a relative output folder as a user would give it, on one held-out task of each
    kind (six of the ten: each kind's check is what differs); only its output cap is halved (to
    32: the 135M model's answers run to it, and the cap set the test's time)."""
    monkeypatch.chdir(tmp_path)
    kinds: dict[str, dict[str, str]] = {}  # the first held-out task of each kind
    for line in (SHELL / "tasks.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["split"] == "heldout":
            kinds.setdefault(row["kind"], row)
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(row) + "\n" for row in kinds.values()))
    config = load_config(SHELL / "collect.yaml", CollectConfig)
    update = {"tasks": str(tmp_path / "tasks.jsonl"), "split": "heldout", "episodes_per_task": 1, "out": "out"}
    config = config.model_copy(update=update)
    config.proxy.upstream, config.proxy.max_completion_tokens = vllm.url, 32
    results, _, db = collect(config, progress=False)
    assert db is not None and sorted(r.task.id for r in results) == sorted(row["id"] for row in kinds.values())
    for result in results:
        assert result.status == "ok" and result.reward in (0.0, 1.0) and result.calls >= 1, result.error
        workdir = tmp_path / "out" / "episodes" / result.session_id
        # mini wrote its trajectory where {workdir} said, not in a folder under its working directory
        assert (workdir / "trajectory.json").exists() and not (workdir / "out").exists()
        # The starting file is there, unless a command the model ran took it away (any kind of
        # task: a copy done with mv failed CI once).
        ran = "<returncode>" in (workdir / "trajectory.json").read_text()
        assert (workdir / result.task.data["setup"]).exists() or ran
