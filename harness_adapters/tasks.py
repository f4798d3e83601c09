"""Tasks: what one episode is asked to do, read from a JSONL file or a Hugging Face dataset.

A task has an `id`, a `prompt` (or `instruction`), an optional `split` ("train" unless given;
"test", "eval", "heldout" and "validation" count as held out) and any other fields, which go to
`data` for the verifier. Rows with missing fields are refused up front, all of them at once,
with their line numbers. A folder of Harbor tasks (harness_adapters/harbor.py) is a source too.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness_adapters.harbor import HarborTask

HELD_OUT = ("test", "eval", "heldout", "held_out", "validation")


class TaskError(ValueError):
    """A task file that cannot be used; the message names every bad row."""


@dataclass(frozen=True)
class Task:
    id: str
    prompt: str
    split: str = "train"
    data: dict[str, Any] = field(default_factory=dict)
    harbor: HarborTask | None = None  # a Harbor task: its folder (image, tests, oracle) and task.toml

    @property
    def held_out(self) -> bool:
        return self.split in HELD_OUT


def task_from_row(row: Any, where: str) -> Task:
    if not isinstance(row, dict):
        raise TaskError(f"{where}: a task must be a JSON object, not {type(row).__name__}")
    prompt = row.get("prompt", row.get("instruction"))
    missing = [name for name, value in (("id", row.get("id")), ("prompt", prompt)) if value in (None, "")]
    if missing:
        raise TaskError(f"{where}: missing {' and '.join(repr(m) for m in missing)}")
    if not isinstance(prompt, str):
        raise TaskError(f"{where}: 'prompt' must be a string")
    data = {k: v for k, v in row.items() if k not in ("id", "prompt", "instruction", "split")}
    return Task(id=str(row["id"]), prompt=prompt, split=str(row.get("split") or "train"), data=data)


def load_tasks(source: str | Path, split: str | None = None) -> list[Task]:
    """Tasks from a JSONL file, a folder of Harbor tasks, a `datasets.save_to_disk` directory or
    a hub dataset name (`name` or `name:split`); only those of `split` ("train" or "heldout")
    when given."""
    from harness_adapters.harbor import is_harbor, load_harbor

    path = Path(source)
    if path.is_file():
        tasks = _from_jsonl(path)
    else:
        tasks = load_harbor(path) if is_harbor(path) else _from_dataset(str(source))
    duplicates = sorted(i for i, n in Counter(t.id for t in tasks).items() if n > 1)
    if duplicates:
        raise TaskError(f"{source}: duplicate task ids {', '.join(duplicates[:10])}")
    if split is not None:
        tasks = [t for t in tasks if t.held_out == (split in HELD_OUT)]
    if not tasks:
        raise TaskError(f"{source}: no tasks" + (f" in split {split!r}" if split else ""))
    return tasks


def _from_jsonl(path: Path) -> list[Task]:
    tasks, errors = [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            tasks.append(task_from_row(json.loads(line), f"line {number}"))
        except json.JSONDecodeError as exc:
            errors.append(f"line {number}: not JSON ({exc.msg})")
        except TaskError as exc:
            errors.append(str(exc))
    if errors:
        more = f" (and {len(errors) - 20} more)" if len(errors) > 20 else ""
        raise TaskError(f"{path}: {len(errors)} bad task rows:\n  " + "\n  ".join(errors[:20]) + more)
    return tasks


def _from_dataset(source: str) -> list[Task]:
    import datasets

    if Path(source).is_dir():
        data = datasets.load_from_disk(source)
    else:
        name, _, split = source.partition(":")
        data = datasets.load_dataset(name, split=split or "train")
    if isinstance(data, datasets.DatasetDict):
        return [
            task_from_row({"split": name, **row}, f"{name} row {i}")
            for name in data
            for i, row in enumerate(data[name])
        ]
    return [task_from_row(row, f"row {i}") for i, row in enumerate(data)]
