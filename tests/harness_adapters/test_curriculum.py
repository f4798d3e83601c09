"""The curriculum by pass rate (harness_adapters/rollouts.py): tasks whose groups are likely to
hold both a success and a failure are sampled most, and none is starved."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from harness_adapters.rollouts import Curriculum
from harness_adapters.tasks import Task


def test_a_task_at_half_is_sampled_most_and_none_is_starved() -> None:
    curriculum = Curriculum(episodes_per_task=4, success_at=1.0)
    for _ in range(32):
        curriculum.record("never", False)
        curriculum.record("always", True)
    for n in range(32):
        curriculum.record("half", n % 2 == 0)
    # an untried task counts as a pass rate of 1/2: 1 - 2 * 0.5**4
    assert curriculum.weight("untried") == pytest.approx(0.875)
    assert curriculum.weight("half") == pytest.approx(1 - 2 * 0.5**4)
    assert curriculum.weight("never") == pytest.approx(1 - (33 / 34) ** 4 - (1 / 34) ** 4)
    tasks = [Task(id=name, prompt=name) for name in ("never", "half", "always")]
    random.seed(7)
    picked = Counter(curriculum.pick(tasks).id for _ in range(3000))
    assert picked["half"] > 2 * picked["never"] > 0 and picked["always"] > 0
    for _ in range(200):  # a task that never succeeds falls to the floor, and stays tried
        curriculum.record("never", False)
    assert curriculum.weight("never") >= curriculum.floor


def test_recent_episodes_count_and_older_ones_are_forgotten() -> None:
    curriculum = Curriculum(episodes_per_task=4, success_at=1.0, window=8)
    for _ in range(8):
        curriculum.record("t", True)
    easy = curriculum.weight("t")
    for n in range(8):  # the task became half as easy: only the last 8 count
        curriculum.record("t", n % 2 == 0)
    assert easy < curriculum.weight("t") == pytest.approx(1 - 2 * 0.5**4)


def test_a_resumed_run_goes_on_with_the_pass_rates_of_its_checkpoint(tmp_path: Path) -> None:
    """The pass rates were not in the checkpoint: a resumed run took every task as untried."""
    from trainer.groups import LoopState

    before = Curriculum(episodes_per_task=4, success_at=1.0, window=8)
    for n in range(12):
        before.record("hard", n == 0)
    state = LoopState(step=3, curriculum=before.saved())
    state.save(tmp_path / "state.json")
    resumed = Curriculum(episodes_per_task=4, success_at=1.0, window=8)
    resumed.restore(LoopState.load(tmp_path / "state.json").curriculum)
    assert resumed.weight("hard") == before.weight("hard") != resumed.weight("untried")
    assert len(resumed.outcomes["hard"]) == 8  # still a window of the recent ones
