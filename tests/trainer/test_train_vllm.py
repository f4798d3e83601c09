"""`rl-proxy train` end to end on the real vLLM: the arithmetic example for one step, then
resumed from its checkpoint for two more. The second run starts from the first's weights,
optimizer and version, never trains a group twice, swaps in versions 2 and 3, and keeps the
optimizer only with its checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from benchmarks.support.stack import Upstream, read_store
from harness_adapters.config import load_config
from harness_adapters.tasks import load_tasks
from proxy.server import AppThread
from recorder import CallRecord, Store
from trainer.cli import app
from trainer.config import EvalSection, TrainConfig
from trainer.groups import GroupView, LoopState, TrainError, group_view, would_train
from trainer.run import train
from trainer.viewer import create_app

EXAMPLE = Path(__file__).resolve().parents[2] / "harness_adapters" / "examples" / "arithmetic"


def _config(tmp_path: Path, upstream: str, steps: int, checkpoint_every: int = 10, mode: str = "auto") -> TrainConfig:
    config = load_config(EXAMPLE / "train.yaml", TrainConfig)
    config.out = str(tmp_path / "run")
    config.episodes_per_task, config.concurrency = 4, 8
    config.proxy.upstream, config.proxy.vllm_args = upstream, []
    update = {
        "steps": steps,
        "groups_per_step": 1,
        "micro_batch": 4,
        "checkpoint_every": checkpoint_every,
        "mode": mode,
    }
    config.train = config.train.model_copy(update=update)
    config.eval = None
    return config


@pytest.mark.timeout(600)  # two evaluations and four steps, one run async beside its rollouts: about 5 min
def test_train_then_resume(vllm: Upstream, restore: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, vllm.url, steps=1)
    config.eval = EvalSection(split="heldout", episodes_per_task=1)
    first = train(config)
    # The evaluations (12 held-out tasks, sampled and greedy) say how far they are.
    shown = capsys.readouterr().out
    for step, kind in ((0, "sampled"), (0, "greedy"), (1, "sampled"), (1, "greedy")):
        assert f"held-out evaluation at step {step}, {kind}: 12/12 episodes" in shown, shown[-2000:]
    out = tmp_path / "run"
    # Held-out success before and after, as the harness samples and greedy (the proxy sets
    # temperature 0 on the greedy sessions' calls, whatever the agent asks).
    assert all(0 <= getattr(first, k) <= 1 for k in ("before", "after", "before_greedy", "after_greedy"))
    evaluated = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evaluated if "heldout_success_greedy" in r] == [0, 1]
    sessions = read_store(str(out / "rl-proxy.db"), lambda s: s.list_sessions())
    greedy = [s.id for s in sessions if s.run == f"{config.run}-eval-greedy"]
    greedy_calls = read_store(str(out / "rl-proxy.db"), lambda s: _calls(s, greedy))
    assert len(greedy) == 2 * 12 and greedy_calls and all(c.rewrites["temperature"][1] == 0 for c in greedy_calls)
    assert (first.state.step, first.state.version) == (1, 1)
    state = LoopState.load(out / "versions" / "v1" / "state.json")
    assert state.step == 1 and state.consumed and state.samples >= 2
    assert (out / "versions" / "v1" / "learner" / "scheduler.pt").exists()

    with pytest.raises(TrainError, match="--resume"):
        train(_config(tmp_path, vllm.url, steps=2), progress=False)

    # Resumed in async mode (the first ran sync; auto picks sync on CPU): both paths run; its
    # tasks are sampled by the curriculum (harness_adapters/rollouts.py Curriculum); and its
    # step 2 is a warm start's supervised step on the successful episodes the store holds.
    resumed_config = _config(tmp_path, vllm.url, steps=3, checkpoint_every=2, mode="async")
    resumed_config.train.curriculum = True
    resumed_config.train.warm_start, resumed_config.train.warm_start_from = 2, str(out / "rl-proxy.db")
    second = train(resumed_config, resume=True, progress=False)
    assert (second.state.step, second.state.version, second.mode, first.mode) == (3, 3, "async", "sync")
    # Version 2 (step 2) went to vLLM as weights alone; step 3 (the last) is a checkpoint again,
    # and the two newest versions are kept.
    versions = out / "versions"
    assert [(v, (versions / v).exists(), (versions / v / "learner").exists()) for v in ("v1", "v2", "v3")] == [
        ("v1", False, False),
        ("v2", True, False),
        ("v3", True, True),
    ]
    assert second.state.consumed[: len(state.consumed)] == state.consumed  # what the first run used, kept
    assert len(set(second.state.consumed)) == len(second.state.consumed)  # no group trained twice
    assert httpx.get(f"{restore}/weight_info").json()["weight_version"] == "3"
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["phase"]) for r in steps if "reward" in r] == [(1, "grpo"), (2, "sft"), (3, "grpo")]
    # ... on successes only, and none of a held-out task (the store holds the evaluation's too)
    supervised = read_store(str(out / "rl-proxy.db"), lambda s: _views_of_step(s, 2))
    heldout = {t.id for t in load_tasks(EXAMPLE / "tasks.jsonl", "heldout")}
    assert supervised and all(reward == 1.0 and task not in heldout for _, reward, task in supervised), supervised
    assert any(s.task_id in heldout and s.outcome and s.outcome.reward == 1.0 for s in sessions)
    # groups with a signal (rewards that differ), of those this process made, and per minute. A
    # GRPO step trains on groups made: at least one by then. The warm start's step trains on the
    # store's episodes at once: the resumed run may have made none yet (a slow machine did not).
    made = [
        (r["phase"], r["signal_groups"], r["groups_made"], r["signal_groups_per_min"]) for r in steps if "reward" in r
    ]
    assert all(0 <= signal <= groups and (per_min or 0) >= 0 for _, signal, groups, per_min in made), made
    assert all(groups >= 1 for phase, _, groups, _ in made if phase == "grpo"), made
    assert (out / "training.png").stat().st_size > 0

    # The second run's episodes were sampled by the resumed weights (version 1), then version 2.
    sessions = read_store(str(out / "rl-proxy.db"), lambda s: s.list_sessions())
    new_groups = set(second.state.consumed) - set(state.consumed)
    resumed = [s.id for s in sessions if s.group_id in new_groups]
    calls = read_store(str(out / "rl-proxy.db"), lambda s: _calls(s, resumed))
    assert calls and "1" in {c.policy_version for c in calls} <= {"1", "2"}
    # each step stored what the learner saw of its first sequences, for the viewer's overlays
    trained = [s.id for s in sessions if s.group_id in set(second.state.consumed)]
    views = [read_store(str(out / "rl-proxy.db"), lambda s, i=i: s.learner_views(i)) for i in trained]
    seen = [v for found in views for _, v in found.values()]
    assert seen and all(v.logprobs and all(lp <= 0 for lp in v.logprobs) for v in seen)

    # The viewer shows each group as the trainer took it; and the one rule, with the settings the
    # run stored, gives the same advantages again (for groups where nothing was too stale: that
    # depends on the step that took them).
    db = str(out / "rl-proxy.db")
    views = read_store(db, lambda s: _views(s, second.state.consumed))
    trained = [(group, taken, again) for group, taken, again in views if taken.trained]
    assert trained and all(taken.step is not None for _, taken, _ in trained)
    for _, taken, again in trained:
        if all(why != "stale" for *_, why in taken.episodes):
            assert _advantages(again) == _advantages(taken)
    with AppThread(create_app(db, decode=lambda ids: [str(i) for i in ids])) as viewer:
        for group, taken, _ in trained:
            page = httpx.get(f"{viewer.url}/groups/{group}").text
            shown = [part.split("<", 1)[0] for part in page.split('class="advantage">')[1:]]
            assert shown == ["-" if a is None else format(a, "+.3f") for _, _, a, _ in taken.episodes]


async def _views(store: Store, groups: list[str]) -> list[tuple[str, GroupView, GroupView]]:
    """Each group as the trainer took it, and as the rule with the run's stored settings gives it."""
    views = []
    for group in dict.fromkeys(groups):
        taken = await group_view(store, group)
        sessions = await store.list_sessions(group_id=group)
        stored = await store.run_settings(str(sessions[0].run))
        assert taken is not None and stored is not None
        views.append((group, taken, await would_train(store, sessions, *stored)))
    return views


def _advantages(view: GroupView) -> list[float | None]:
    return [None if a is None else round(a, 6) for _, _, a, _ in view.episodes]


async def _views_of_step(store: Store, step: int) -> list[tuple[str, float | None, str | None]]:
    """The sessions (their rewards and tasks) whose sequences the learner's view of `step` shows."""
    shown = [(s, await store.learner_views(s.id)) for s in await store.list_sessions()]
    return [
        (s.id, s.outcome.reward if s.outcome else None, s.task_id)
        for s, found in shown
        for at, _ in found.values()
        if at == step
    ]


async def _calls(store: Store, session_ids: list[str]) -> list[CallRecord]:
    return [c for sid in session_ids async for c in store.iter_calls(sid)]


def test_train_cli_names_bad_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((EXAMPLE / "train.yaml").read_text().replace("max_staleness: 1", "max_stalenes: 1"))
    result = CliRunner().invoke(app, ["train", str(bad)])
    assert result.exit_code == 2 and "max_stalenes" in result.output
