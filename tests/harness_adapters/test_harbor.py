"""Harbor task folders as a task source: read as Harbor writes them, refused by name when
malformed, and run only where their image and tests can be (a container environment)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from harness_adapters.config import CollectConfig, ConfigError, load_config
from harness_adapters.tasks import TaskError, load_tasks

HARBOR = Path(__file__).resolve().parents[2] / "harness_adapters" / "examples" / "harbor"


def test_the_example_tasks_are_read_with_their_splits_limits_and_unknown_fields(tmp_path: Path) -> None:
    tasks = shutil.copytree(HARBOR / "tasks", tmp_path / "tasks")
    with open(tasks / "fix-add" / "task.toml", "a") as toml:
        toml.write('\n[future]\nsetting = "kept"\n')
    train, heldout = load_tasks(tasks, "train"), load_tasks(tasks, "heldout")
    assert [t.id for t in train] == ["fix-add", "hello-file"] and [t.id for t in heldout] == ["count-lines"]
    fix = train[0]
    assert fix.prompt.startswith("The function add in calc.py") and fix.data == {
        "difficulty": "easy",
        "category": "python",
    }
    assert fix.harbor is not None and fix.harbor.dir == tasks.resolve() / "fix-add"
    assert (fix.harbor.agent_timeout, fix.harbor.verifier_timeout, fix.harbor.cpus, fix.harbor.memory_mb) == (
        120,
        30,
        1,
        512,
    )
    assert fix.harbor.config["future"] == {"setting": "kept"}
    assert [t.id for t in load_tasks(tasks / "hello-file")] == ["hello-file"]  # one task's folder


def test_malformed_tasks_are_refused_together_each_by_name_with_what_is_wrong(tmp_path: Path) -> None:
    tasks = shutil.copytree(HARBOR / "tasks", tmp_path / "tasks")
    (tasks / "hello-file" / "tests" / "test.sh").unlink()
    (tasks / "fix-add" / "task.toml").write_text("[environment]\ncpus = 'two'\nmemory_mb = -5\n[agent\n")
    (tasks / "count-lines" / "task.toml").write_text("[environment]\ncpus = 'two'\nmemory_mb = -5\n")
    (tasks / "count-lines" / "instruction.md").write_text("  \n")
    shutil.rmtree(tasks / "count-lines" / "environment")
    with pytest.raises(TaskError) as caught:
        load_tasks(tasks)
    message = str(caught.value)
    assert "3 malformed Harbor tasks" in message
    assert "hello-file: no tests/test.sh" in message
    assert "fix-add: task.toml: " in message  # not TOML at all
    count = next(line for line in message.splitlines() if "count-lines:" in line)
    for problem in (
        "environment.cpus must be int or float, not 'two'",
        "environment.memory_mb must be from 16 to 1.04858e+06, not -5",
        "instruction.md is empty",
        "no environment/Dockerfile (and no [environment] docker_image)",
    ):
        assert problem in count, count


def test_harbor_tasks_need_a_container_and_a_container_needs_a_command_harness(tmp_path: Path) -> None:
    config = load_config(HARBOR / "collect.yaml", CollectConfig)
    config.check_tasks(load_tasks(HARBOR / "tasks"))  # the example as shipped
    host = CollectConfig.model_validate({**config.model_dump(exclude={"environment"}), "environment": {"type": "host"}})
    refused = "fix-add, hello-file are Harbor tasks: they run in `environment: {type: container}`"
    with pytest.raises(ConfigError, match=re.escape(refused)):
        host.check_tasks(load_tasks(HARBOR / "tasks", "train"))
    python = CollectConfig.model_validate(
        {**config.model_dump(exclude={"harness"}), "harness": {"type": "python", "agent": "x.py:agent"}}
    )
    with pytest.raises(ConfigError, match="a container runs a command harness inside it, not a python one"):
        python.adapter()
    posted = CollectConfig.model_validate({**config.model_dump(), "rewards": [{"type": "harness"}]})
    with pytest.raises(ConfigError, match="a container's agent cannot reach the admin API"):
        posted.reward_sources()  # what the agent says of itself is no reward there


def test_hidden_folders_are_no_tasks_and_bad_values_are_bounded_and_named(tmp_path: Path) -> None:
    """Found by review (issue 45): a `.git` folder beside the tasks got the whole dataset refused, a
    latin-1 instruction.md crashed, `timeout_sec = nan` was taken (every episode timed out at
    once) and `cpus = 1e-10` became no limit; a task naming no limits got none (Harbor's are 1
    CPU and 2048 MB)."""
    tasks = shutil.copytree(HARBOR / "tasks", tmp_path / "tasks")
    (tasks / ".git" / "objects").mkdir(parents=True)
    loaded = {t.id: t for t in load_tasks(tasks, None)}
    assert sorted(loaded) == ["count-lines", "fix-add", "hello-file"]
    toml = tasks / "hello-file" / "task.toml"
    toml.write_text("[metadata]\nsplit = 'train'\n")  # no limits, no timeouts
    hello = next(t for t in load_tasks(tasks, None) if t.id == "hello-file").harbor
    assert hello is not None and (hello.cpus, hello.memory_mb, hello.verifier_timeout) == (1.0, 2048, 600.0)
    (tasks / "fix-add" / "instruction.md").write_bytes(
        "Corrige la fonction d\u2019addition : \xe9t\xe9".encode("latin-1", "replace")
    )
    (tasks / "count-lines" / "task.toml").write_text("[agent]\ntimeout_sec = nan\n[environment]\ncpus = 1e-10\n")
    with pytest.raises(TaskError) as caught:
        load_tasks(tasks, None)
    message = str(caught.value)
    assert "2 malformed Harbor tasks" in message, message
    assert "fix-add: instruction.md is not UTF-8 text" in message
    assert "agent.timeout_sec must be from 1 to 86400, not nan" in message
    assert "environment.cpus must be from 0.01 to 1024, not 1e-10" in message
