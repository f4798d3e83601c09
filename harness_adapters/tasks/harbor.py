"""Harbor's task format (Terminal-Bench 2.0 and the datasets published in it): a folder of
tasks, each a folder of its own:

    task.toml                (optional sections: [metadata], [agent] timeout_sec,
                              [verifier] timeout_sec / env, [environment] cpus / memory_mb /
                              build_timeout_sec / docker_image; other fields are kept as written)
    instruction.md           the prompt
    environment/Dockerfile   the task's image (or [environment] docker_image)
    tests/test.sh            run in the container after the agent; writes the reward to
                             /logs/verifier/reward.txt, or named rewards to reward.json
    solution/solve.sh        the oracle (`rl-proxy tasks check` runs it)

The task's id is its folder's name; its split is `[metadata] split` ("train" unless given; the
held-out names of tasks/task.py count as held out). Hidden folders (`.git`) are no
tasks. Harbor's defaults apply where a task names none (1 CPU, 2048 MB; the tests' timeout 600 s,
the agent's the run's `timeout`), and a value must be a finite number within bounds (BOUNDS). A malformed
task is refused by name with what is wrong, all of them at once.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from harness_adapters.tasks.task import HarborTask, Task, TaskError


def is_harbor(path: Path) -> bool:
    """A Harbor task folder, or a folder of them."""
    return path.is_dir() and (
        (path / "task.toml").is_file() or any((sub / "task.toml").is_file() for sub in path.iterdir() if sub.is_dir())
    )


def load_harbor(path: Path) -> list[Task]:
    """Every task in `path` (a folder of task folders, or one task folder)."""
    tasks, errors = read_harbor(path)
    if errors:
        lines = [f"{name}: {error}" for name, error in errors.items()]
        raise TaskError(f"{path}: {len(errors)} malformed Harbor tasks:\n  " + "\n  ".join(lines))
    return tasks


def read_harbor(path: Path) -> tuple[list[Task], dict[str, str]]:
    """The well-formed tasks in `path`, and what is wrong with each other one (by folder name)."""
    if (path / "task.toml").is_file():
        folders = [path]
    else:
        folders = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    tasks, errors = [], {}
    for folder in folders:
        try:
            tasks.append(harbor_task(folder))
        except TaskError as exc:
            errors[folder.name] = str(exc)
    return tasks, errors


# task.toml's fields that rl-proxy reads: (section, key) -> the types they may have.
NUMBERS = (int, float)
# The bounds of the numbers: a timeout of 0 or NaN would end every episode at once, and a CPU
# share too small for the engine to apply (under 0.01) would be no limit at all.
BOUNDS = {
    ("agent", "timeout_sec"): (1, 86_400),
    ("verifier", "timeout_sec"): (1, 86_400),
    ("environment", "build_timeout_sec"): (1, 86_400),
    ("environment", "cpus"): (0.01, 1024),
    ("environment", "memory_mb"): (16, 2**20),
}
TYPED = {
    ("agent", "timeout_sec"): NUMBERS,
    ("verifier", "timeout_sec"): NUMBERS,
    ("environment", "cpus"): NUMBERS,
    ("environment", "memory_mb"): (int,),
    ("environment", "build_timeout_sec"): NUMBERS,
    ("environment", "docker_image"): (str,),
    ("verifier", "env"): (dict,),
    ("metadata", "split"): (str,),
}


def harbor_task(folder: Path) -> Task:
    """One task folder as a Task, or TaskError saying what is wrong with it."""
    problems = []
    config: dict[str, Any] = {}
    if not (folder / "task.toml").is_file():
        problems.append("no task.toml")
    else:
        try:
            config = tomllib.loads((folder / "task.toml").read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            problems.append(f"task.toml: {exc}")
    for (section, key), types in TYPED.items():
        part = config.get(section, {})
        if not isinstance(part, dict):
            problems.append(f"task.toml: [{section}] must be a table")
            continue
        value = part.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            problems.append(
                f"task.toml: {section}.{key} must be {' or '.join(t.__name__ for t in types)}, not {value!r}"
            )
        elif isinstance(value, NUMBERS) and (section, key) in BOUNDS:
            low, high = BOUNDS[section, key]
            if not low <= value <= high:  # NaN is within no bounds
                problems.append(f"task.toml: {section}.{key} must be from {low:g} to {high:g}, not {value!r}")
    env = config.get("verifier", {}).get("env", {}) if isinstance(config.get("verifier"), dict) else {}
    if isinstance(env, dict) and not all(isinstance(v, str) for v in env.values()):
        problems.append("task.toml: verifier.env values must be strings")
    instruction, prompt = folder / "instruction.md", ""
    try:
        prompt = instruction.read_text(encoding="utf-8").strip() if instruction.is_file() else ""
        if not prompt:
            problems.append("no instruction.md" if not instruction.is_file() else "instruction.md is empty")
    except UnicodeDecodeError as exc:
        problems.append(f"instruction.md is not UTF-8 text ({exc.reason} at byte {exc.start})")
    if not (folder / "tests" / "test.sh").is_file():
        problems.append("no tests/test.sh")
    docker_image = (
        config.get("environment", {}).get("docker_image") if isinstance(config.get("environment"), dict) else None
    )
    if not (folder / "environment" / "Dockerfile").is_file() and not docker_image:
        problems.append("no environment/Dockerfile (and no [environment] docker_image)")
    if problems:
        raise TaskError("; ".join(problems))
    metadata = config.get("metadata", {})
    return Task(
        id=folder.name,
        prompt=prompt,
        split=str(metadata.get("split") or "train"),
        data={k: v for k, v in metadata.items() if k != "split"},
        harbor=HarborTask(folder.resolve(), config),
    )
