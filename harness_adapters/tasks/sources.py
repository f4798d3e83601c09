"""Where tasks come from: a JSONL file, a folder of Harbor tasks (tasks/harbor.py), a
`datasets.save_to_disk` directory or a Hugging Face hub dataset. Rows with missing fields are
refused up front, all of them at once, with their line numbers.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from harness_adapters.tasks.harbor import is_harbor, load_harbor
from harness_adapters.tasks.task import HELD_OUT, Task, TaskError, task_from_row


def load_tasks(source: str | Path, split: str | None = None) -> list[Task]:
    """Tasks from a JSONL file, a folder of Harbor tasks, a `datasets.save_to_disk` directory or
    a hub dataset name (`name` or `name:split`); only those of `split` ("train" or "heldout")
    when given."""
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
