"""Task files: bad rows refused up front with their line numbers, splits, datasets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness_adapters.tasks import TaskError, load_tasks

EXAMPLE = Path(__file__).resolve().parents[2] / "harness_adapters" / "examples" / "arithmetic" / "tasks.jsonl"


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_every_bad_row_is_named_with_its_line(tmp_path: Path) -> None:
    rows = [
        '{"id": "a", "prompt": "x"}',
        '{"prompt": "no id"}',
        "not json",
        '{"id": "c"}',
        "",
        '{"id": "d", "prompt": 5}',
        '["a list"]',
    ]
    with pytest.raises(TaskError) as bad:
        load_tasks(write(tmp_path / "t.jsonl", rows))
    message = str(bad.value)
    assert "5 bad task rows" in message
    for expected in (
        "line 2: missing 'id'",
        "line 3: not JSON",
        "line 4: missing 'prompt'",
        "line 6: 'prompt' must be a string",
        "line 7: a task must be a JSON object",
    ):
        assert expected in message


def test_splits_fields_and_duplicates(tmp_path: Path) -> None:
    tasks = load_tasks(EXAMPLE)
    train, held = load_tasks(EXAMPLE, "train"), load_tasks(EXAMPLE, "heldout")
    assert len(tasks) == len(train) + len(held) == 36 and len(held) == 12
    assert all(t.held_out for t in held) and not any(t.held_out for t in train)
    assert isinstance(train[0].data["answer"], int) and "split" not in train[0].data
    rows = ['{"id": "a", "instruction": "x"}', '{"id": "a", "prompt": "y"}']
    with pytest.raises(TaskError, match="duplicate task ids a"):
        load_tasks(write(tmp_path / "dup.jsonl", rows))
    with pytest.raises(TaskError, match="no tasks in split 'heldout'"):
        load_tasks(write(tmp_path / "one.jsonl", rows[:1]), "heldout")


def test_a_saved_dataset_with_splits(tmp_path: Path) -> None:
    import datasets

    rows = [json.loads(line) for line in EXAMPLE.read_text().splitlines()]
    saved = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{k: v for k, v in r.items() if k != "split"} for r in rows[:5]]),
            "test": datasets.Dataset.from_list([{k: v for k, v in r.items() if k != "split"} for r in rows[30:]]),
        }
    )
    saved.save_to_disk(tmp_path / "ds")
    assert [t.id for t in load_tasks(tmp_path / "ds", "heldout")] == [r["id"] for r in rows[30:]]
    assert len(load_tasks(tmp_path / "ds")) == 11
