"""The shell example's verifier: what the harness left in the episode's work directory.

Each task names its `kind` and what to look for; the harness (mini-swe-agent, Codex CLI or
Claude Code) ran in that directory with the task's `setup` file written there first. The
reward is 1.0 when the directory holds what the task asked for, else 0.0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _text(path: Path) -> str | None:
    return path.read_text(errors="replace").strip() if path.is_file() else None


def score(task: Any, outcome: Any, workdir: Path) -> float:
    data = task.data
    target = workdir / data["file"]
    if data["kind"] in ("create", "count"):  # the file holds the word (or the number), nothing else
        done = _text(target) == data["word"]
    elif data["kind"] == "rename":
        done = _text(target) == data["setup_text"].strip() and not (workdir / data["old"]).exists()
    elif data["kind"] == "copy":
        done = _text(target) == data["setup_text"].strip() == _text(workdir / data["old"])
    elif data["kind"] == "delete":
        done = not target.exists()
    elif data["kind"] == "mkdir":
        done = target.is_dir()
    else:
        raise ValueError(f"task {task.id}: unknown kind {data['kind']!r}")
    return float(done)
