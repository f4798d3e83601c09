"""The loop's data rules on a real store with hand-made records: groups read back as
sequences, staleness filtering, equal-reward groups skipped, failed episodes not scored,
leftover groups found after a restart, a run that keeps failing stopped by name."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness_adapters.config import PythonHarness
from proxy.server import AppThread
from recorder import CallRecord, Completion, SessionInfo, Store
from recorder.episodes import EpisodeOutcome, Sampling
from trainer.config import TrainConfig, TrainSection
from trainer.groups import GroupReader, LoopState, TrainError, reward_rule, successes, would_train
from trainer.viewer import create_app

T0 = datetime(2026, 1, 1)


def _config(tmp_path: Path, **train: Any) -> TrainConfig:
    return TrainConfig(
        run="r",
        tasks="t.jsonl",
        episodes_per_task=4,
        out=str(tmp_path),
        harness=PythonHarness(type="python", agent="x:y"),
        train=TrainSection(**train),
    )


async def _episode(
    store: Store,
    group: str,
    n: int,
    version: str,
    reward: float | None,
    status: str = "ok",
    harness: str = "ok",
    infra: bool = False,
    sampling: dict[str, Any] | None = None,
    policy: str | None = None,
    also: Sequence[CallRecord] = (),
) -> None:
    """An episode of two merged turns (their requests with `sampling`) on model "m"; `harness` is
    how its harness ended, `infra` adds a call the upstream failed (503); `policy` is the model
    the runner named; `also`, calls recorded before it ends (the store refuses them after)."""
    session = await store.create_session(
        SessionInfo(id=f"{group}-{n}", key=f"k-{group}-{n}", run="r", task_id="t", group_id=group, policy_model=policy)
    )
    prompt = [1, 2, 3]
    for seq, tokens in enumerate([[10, 11], [12]]):  # two turns, merged into one sequence
        await store.record(
            CallRecord(
                session_id=session.id,
                seq=seq + 1,
                api="chat.completions",
                model="m",
                upstream="u",
                stream=False,
                request={"messages": [], **(sampling or {})},
                response=None,
                ok=True,
                http_status=200,
                error=None,
                prompt_token_ids=prompt,
                completions=[Completion(0, tokens, [-0.5] * len(tokens), "stop")],
                policy_version=version,
                policy_version_end=version,
                started_at=T0,
                finished_at=T0,
            )
        )
        prompt = prompt + tokens + [7]
    if infra:
        await store.record(
            CallRecord(
                session_id=session.id,
                seq=3,
                api="chat.completions",
                model="m",
                upstream="u",
                stream=False,
                request={"messages": []},
                response=None,
                ok=False,
                http_status=503,
                error="upstream unreachable",
                prompt_token_ids=[],
                completions=[],
                policy_version=version,
                policy_version_end=version,
                started_at=T0,
                finished_at=T0,
            )
        )
    if reward is not None:
        await store.add_reward(session.id, reward, "python")
    for extra in also:
        await store.record(extra)
    outcome = EpisodeOutcome(harness=harness, error=None if status == "ok" else "harness crashed", reward=reward)
    await store.end_session(session.id, status, outcome)  # type: ignore[arg-type]


def _loop(tmp_path: Path, store: Store, state: LoopState, **train: Any) -> GroupReader:
    config = _config(tmp_path, **train)
    return GroupReader(config, store, state, reward_rule(config.train, "none"))


def test_staleness_equal_rewards_and_failures(tmp_path: Path) -> None:
    async def main() -> tuple[Any, ...]:
        async with Store(str(tmp_path / "s.db")) as store:
            # version 3 is serving; max_staleness 1 keeps versions 2 and 3
            for n, (version, reward) in enumerate([("0", 1.0), ("2", 0.0), ("3", 1.0), ("3", 0.0)]):
                await _episode(store, "mixed", n, version, reward)
            for n in range(4):
                await _episode(store, "equal", n, "3", 1.0)
            for n in range(4):
                await _episode(store, "failing", n, "3", None, status="failed" if n else "ok")
            loop = _loop(tmp_path, store, LoopState(step=3, version=3), max_staleness=1)
            mixed = await loop.prepare("mixed")
            equal = await loop.prepare("equal")
            failing = await loop.prepare("failing")
            return mixed, equal, failing, loop.state

    mixed, equal, failing, state = asyncio.run(main())
    assert mixed is not None
    samples, rewards, staleness = mixed
    assert rewards == [0.0, 1.0, 0.0] and staleness == [1, 0, 0]  # the version-0 episode dropped
    assert [s.advantage for s in samples] == pytest.approx([-1 / 3, 2 / 3, -1 / 3])
    assert all(s.sequence.input_ids == [1, 2, 3, 10, 11, 7, 12] for s in samples)
    assert samples[0].sequence.loss_mask == [0, 0, 0, 1, 1, 0, 1]
    assert equal is None and failing is None
    assert (state.dropped_stale, state.skipped_equal, state.unscored) == (1, 1, 4)
    assert state.consumed == ["mixed", "equal", "failing"]


def test_leftovers_and_failing_groups(tmp_path: Path) -> None:
    async def main() -> tuple[list[str], str]:
        async with Store(str(tmp_path / "s.db")) as store:
            for group in ("done-1", "done-2", "trained"):
                for n in range(4):
                    await _episode(store, group, n, "1", float(n % 2))
            for n in range(3):  # one episode short: still running when the run stopped
                await _episode(store, "partial", n, "1", 1.0)
            # An attempt that Ray lost (ended "ended") is no episode: its replacement never ended.
            for n in range(3):
                await _episode(store, "replaced", n, "1", 1.0)
            await _episode(store, "replaced", 3, "1", None, status="ended")
            state = LoopState(step=2, version=1, consumed=["trained"])
            loop = _loop(tmp_path, store, state)
            leftovers = await loop.leftovers()
            for n in range(4):
                for g in range(3):
                    await _episode(store, f"bad-{g}", n, "1", None, status="failed")
            with pytest.raises(TrainError, match="3 groups in a row without one scored episode") as raised:
                for g in range(3):
                    await loop.prepare(f"bad-{g}")
            return leftovers, str(raised.value)

    leftovers, error = asyncio.run(main())
    assert leftovers == ["done-1", "done-2"]
    assert "harness crashed" in error


def test_groups_that_keep_scoring_the_same_stop_a_run_by_name(tmp_path: Path) -> None:
    """A policy that solves none of the tasks (the 135M model on the SWE example) makes groups of
    equal rewards: each was skipped, and the run made groups forever, never stepping. A group
    with a signal resets the count; `max_groups_without_signal` in a row stop the run, saying why."""

    async def main() -> str:
        async with Store(str(tmp_path / "s.db")) as store:
            loop = _loop(tmp_path, store, LoopState(step=1, version=1), max_groups_without_signal=3)
            for name, rewards in [("zero-0", [0.0] * 4), ("zero-1", [0.0] * 4), ("mixed", [0.0, 1.0, 0.0, 0.0])]:
                for n, reward in enumerate(rewards):
                    await _episode(store, name, n, "1", reward)
                await loop.prepare(name)
            with pytest.raises(TrainError) as raised:
                for g in range(3):
                    for n in range(4):
                        await _episode(store, f"zero-{g + 2}", n, "1", 0.0)
                    assert await loop.prepare(f"zero-{g + 2}") is None
            assert loop.state.skipped_equal == 5
            return str(raised.value)

    error = asyncio.run(main())
    assert error.startswith("3 groups in a row without rewards that differ") and "[0.0, 0.0, 0.0, 0.0]" in error


def test_episodes_with_nothing_to_train_stop_a_run_by_name(tmp_path: Path) -> None:
    """Every call of these episodes is aux (the runner named another model than they asked for):
    each is "empty". Such groups were counted as scored, so a run of them made groups forever."""

    async def main() -> str:
        async with Store(str(tmp_path / "s.db")) as store:
            loop = _loop(tmp_path, store, LoopState(step=1, version=1))
            with pytest.raises(TrainError) as raised:
                for g in range(3):
                    for n in range(4):
                        await _episode(store, f"aux-{g}", n, "1", float(n % 2), policy="the-policy")
                    assert await loop.prepare(f"aux-{g}") is None
            assert loop.state.capture_fatal == 12
            return str(raised.value)

    error = asyncio.run(main())
    assert "3 groups in a row without one scored episode" in error
    assert "no trained call: its 2 call(s) failed or are aux" in error and "'the-policy'" in error


def test_only_trained_calls_decide_whether_an_episode_was_sampled_as_the_trainer_scores() -> None:
    """A side call at temperature 0 or under a response_format (a title, a check) is aux and
    never trained: it dropped the whole episode."""
    from trainer.groups import sampling_refused, trained_sequences

    def made(seq: int, model: str, prompt: list[int], **request: Any) -> CallRecord:
        return CallRecord(
            session_id="s",
            seq=seq,
            api="chat.completions",
            model=model,
            upstream="u",
            stream=False,
            request={"model": model, "messages": [{"role": "user", "content": str(seq)}], **request},
            response=None,
            ok=True,
            http_status=200,
            error=None,
            prompt_token_ids=prompt,
            completions=[Completion(0, [5, 6], [-0.5, -0.5], "stop")],
            policy_version="1",
            policy_version_end="1",
            started_at=T0,
            finished_at=T0,
        )

    calls = [
        made(1, "m", [1, 2]),
        made(2, "small", [3], temperature=0.0, response_format={"type": "json_object"}),
        made(3, "m", [1, 2, 5, 6, 7]),
    ]
    settings = {"temperature": 1.0, "defaults": {}, "allow_truncated_sampling": False}
    fatal, sequences, trained = trained_sequences(calls, SessionInfo(id="s", key="k", policy_model="m"), 1)
    assert fatal is None and [q.calls for q in sequences] == [[1, 3]]
    assert sampling_refused(trained, settings) is None
    assert "call 2 sampled at temperature 0.0" in (sampling_refused(calls, settings) or "")


def test_config_refuses_unknown_keys(tmp_path: Path) -> None:
    from harness_adapters.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text("run: r\ntasks: t.jsonl\nharness: {type: python, agent: 'a:b'}\ntrain: {steps: 2, stepz: 3}\n")
    with pytest.raises(ConfigError, match=r"train\.stepz"):
        load_config(path, TrainConfig)
    path.write_text(
        "run: r\ntasks: t.jsonl\nharness: {type: python, agent: 'a:b'}\ntrain: {grpo: {num_generations: 4}}\n"
    )
    with pytest.raises(ConfigError, match=r"\['num_generations'\] are GRPOConfig fields not used here"):
        load_config(path, TrainConfig)
    path.write_text("run: r\ntasks: t.jsonl\nharness: {type: python, agent: 'a:b'}\ntrain: {grpo: {los_type: dapo}}\n")
    with pytest.raises(ConfigError, match=r"\['los_type'\] are not GRPOConfig fields"):
        load_config(path, TrainConfig)
    # The config's own sampling temperature, at another than the trainer scores at: every episode
    # would be refused for it, after vLLM's start and a first evaluation.
    path.write_text("run: r\ntasks: t.jsonl\nharness: {type: python, agent: 'a:b'}\nsampling: {temperature: 0.7}\n")
    with pytest.raises(ConfigError, match=r"sampling: temperature 0.7; the trainer scores at 1.0"):
        load_config(path, TrainConfig)
    path.write_text(path.read_text() + "train: {grpo: {temperature: 0.7}}\n")
    assert load_config(path, TrainConfig).sampling == Sampling(temperature=0.7)


def test_every_grpo_key_used_here_is_a_grpo_config_field() -> None:
    from trainer.config import GRPO_KEYS, grpo_fields

    assert grpo_fields() >= GRPO_KEYS, GRPO_KEYS - grpo_fields()


def test_metrics_to_tensorboard_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainer.loop import plot
    from trainer.run import _writers

    config = _config(tmp_path, report_to=["tensorboard"])
    [to_board] = _writers(config)
    rows = [{"step": 1, "reward": 0.25, "version": 1}, {"step": 2, "reward": 0.75, "version": 2}]
    for row in rows:
        to_board(row)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("reward")] == [0.25, 0.75]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in [*rows, {"step": 2, "heldout_success": 0.5}]))
    assert plot(metrics, tmp_path / "p.png") == tmp_path / "p.png" and (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.parametrize("answer", [503, "unreachable", "old version"])
def test_a_version_refresh_the_proxy_does_not_take_stops_the_swap(answer: Any) -> None:
    """Fault injection (an httpx mock transport stands in for the proxy's admin API): a refresh
    answered with an error, not answered, or answered with another version than the new one,
    raises SwapError naming it, where it was ignored."""
    import httpx

    from proxy.admin_client import AdminClient
    from trainer.loop import refresh_version
    from trainer.weight_sync import SwapError

    def admin_api(request: httpx.Request) -> httpx.Response:
        if answer == "unreachable":
            raise httpx.ConnectError("connection refused", request=request)
        if answer == "old version":
            return httpx.Response(200, json={"policy_version": "2", "versions": {"http://vllm/v1": "2"}})
        return httpx.Response(answer, json={"error": {"message": "vLLM did not answer /weight_info"}})

    async def refresh() -> None:
        async with AdminClient("http://proxy", transport=httpx.MockTransport(admin_api)) as admin:
            await refresh_version(admin, "3")

    with pytest.raises(SwapError, match={503: "503", "unreachable": "ConnectError"}.get(answer, "it reads")):
        asyncio.run(refresh())


def test_a_lora_section_is_checked_and_sizes_the_launched_vllm(tmp_path: Path) -> None:
    assert _config(tmp_path, lora={"r": 32}).proxy.max_lora_rank == 32  # the launcher starts vLLM for it
    assert _config(tmp_path, lora={}).train.lora == {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
    for lora, why in (
        ({"rank": 8}, "not PEFT LoraConfig fields"),
        ({"r": 0}, "from 1 to 512"),
        ({"layers_to_transform": [0]}, "cannot be used when"),
    ):
        with pytest.raises(ValueError, match=why):
            _config(tmp_path, lora=lora)
    with pytest.raises(ValueError, match="below the adapters' rank"):
        TrainConfig(
            run="r",
            tasks="t.jsonl",
            out=str(tmp_path),
            harness=PythonHarness(type="python", agent="x:y"),
            proxy={"max_lora_rank": 8},
            train=TrainSection(lora={"r": 16}),
        )


def test_resuming_with_or_without_lora_against_the_checkpoint_is_refused(tmp_path: Path) -> None:
    from trainer.groups import TrainError
    from trainer.run import train

    checkpoint = tmp_path / "versions" / "v1"
    checkpoint.mkdir(parents=True)
    LoopState().save(checkpoint / "state.json")  # whole weights
    (tmp_path / "t.jsonl").write_text('{"id": "a", "prompt": "p"}\n')
    config = _config(tmp_path, lora={"r": 8})
    config.tasks = str(tmp_path / "t.jsonl")
    with pytest.raises(TrainError, match="whole weights, and the config has a lora section"):
        train(config, resume=True, progress=False)
    (checkpoint / "adapter_config.json").write_text("{}")
    config.train = TrainSection()
    with pytest.raises(TrainError, match="a LoRA adapter, and the config has no lora section"):
        train(config, resume=True, progress=False)


def test_a_warm_start_from_a_store_that_is_not_there_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from trainer.groups import TrainError
    from trainer.run import train

    (tmp_path / "t.jsonl").write_text('{"id": "a", "prompt": "p"}\n')
    config = _config(tmp_path, steps=2, warm_start=1, warm_start_from=str(tmp_path / "collect" / "rl-proxy.db"))
    config.tasks = str(tmp_path / "t.jsonl")
    with pytest.raises(TrainError, match=r"warm_start_from: no store at .*collect/rl-proxy\.db: record"):
        train(config, progress=False)
    # resumed past the warm start, the store is not needed: it stops later, at the empty checkpoint
    (tmp_path / "versions" / "v1").mkdir(parents=True)
    LoopState(step=1, version=1).save(tmp_path / "versions" / "v1" / "state.json")
    with pytest.raises((OSError, ValueError)) as raised:
        train(config, resume=True, progress=False)
    assert "warm_start_from" not in str(raised.value)


def test_fp16_is_refused_by_name_on_every_device(tmp_path: Path) -> None:
    """On a GPU accelerate scaled the loss, but the optimizer was never unscaled: gradients stayed
    ~65536x too large and every step was clipped. Refused, as on CPU, whatever the device."""
    with pytest.raises(ValueError, match="fp16 is refused: its loss scaling is not wired"):
        _config(tmp_path, grpo={"fp16": True})


def test_crashed_and_timed_out_episodes_are_scored_and_infrastructure_failures_dropped(tmp_path: Path) -> None:
    async def main() -> tuple[Any, LoopState]:
        async with Store(str(tmp_path / "s.db")) as store:
            await _episode(store, "g", 0, "0", 1.0)
            await _episode(store, "g", 1, "0", None, status="failed", harness="failed")  # the harness crashed
            await _episode(store, "g", 2, "0", None, status="timeout", harness="timeout")
            await _episode(store, "g", 3, "0", None, status="failed", harness="failed", infra=True)  # vLLM was down
            await _episode(store, "g", 4, "0", None, status="failed")  # the verifier failed: not the policy's doing
            loop = _loop(tmp_path, store, LoopState(), failure_reward=-0.5)
            return await loop.prepare("g"), loop.state

    prepared, state = asyncio.run(main())
    assert prepared is not None and prepared[1] == [1.0, -0.5, -0.5]
    assert (state.failures_scored, state.dropped_infra, state.unscored) == (2, 1, 1)


def test_staleness_counts_optimizer_steps_not_swaps(tmp_path: Path) -> None:
    """Swaps every 2 steps: at step 4 (version 2), an episode of version 1 (made at step 2) is 2
    steps old, one of version 2 is fresh; max_staleness 1 drops the first. One of version 3, made
    after the checkpoint this run resumed from (weights that no longer exist), is dropped too."""

    async def main() -> tuple[Any, LoopState]:
        async with Store(str(tmp_path / "s.db")) as store:
            for n, (version, reward) in enumerate([("1", 1.0), ("2", 0.0), ("2", 1.0), ("3", 0.0)]):
                await _episode(store, "g", n, version, reward)
            state = LoopState(step=4, version=2, version_steps={"1": 2, "2": 4})
            loop = _loop(tmp_path, store, state, max_staleness=1)
            return await loop.prepare("g"), loop.state

    prepared, state = asyncio.run(main())
    assert prepared is not None and prepared[1:] == ([0.0, 1.0], [0, 0]) and state.dropped_stale == 2


def test_the_training_plot_shows_a_negative_failure_reward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reward axis was clamped to [-0.05, 1.05]: a failure_reward of -1 fell off the chart."""
    from matplotlib.figure import Figure

    from trainer.loop import plot

    shown: list[tuple[float, float]] = []
    savefig = Figure.savefig
    monkeypatch.setattr(
        Figure, "savefig", lambda fig, *a, **k: shown.append(fig.axes[0].get_ylim()) or savefig(fig, *a, **k)
    )
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "reward": -1.0, "rollout_reward": -0.6}, {"step": 2, "reward": 0.2, "rollout_reward": 0.1}]
    metrics.write_text("\n".join(json.dumps(r) for r in rows))
    assert plot(metrics, tmp_path / "p.png") is not None
    [(low, high)] = shown
    assert low <= -1.0 and high >= 1.0


def test_the_step_line_leads_with_the_rollout_reward(capsys: pytest.CaptureFixture[str]) -> None:
    """The trained groups' reward leaves out groups with equal rewards (all solved, say): the
    rollout reward is the headline."""
    from trainer.run import _display

    bar, update = _display(10)
    row = {
        "step": 1,
        "version": 1,
        "reward": 0.5,
        "rollout_reward": 0.875,
        "staleness_mean": 0.0,
        "sequence_tokens_per_s": 100.0,
        "skipped_equal": 1,
        "dropped_stale": 0,
        "failures_scored": 2,
        "dropped_infra": 0,
        "refused_sampling": 0,
        "train_s": 3.0,
        "wait_s": 1.0,
    }
    with bar:  # as a run shows it: off a terminal no live bar is drawn, and none is left behind when it stops
        update(row)
    [line] = capsys.readouterr().out.splitlines()  # one line in a log: it was wrapped at 80 columns
    assert "rollout reward 0.88 (trained groups 0.50)" in line and "failed 2" in line
    assert line.startswith("step 1/10") and line.endswith("(train 3 s, waited 1 s)")
    # a warm-start step says so, and how many groups it passed over for want of a success
    update(row | {"step": 2, "phase": "sft", "no_success": 3})
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith("step 2/10 supervised (warm start; 3 groups without a success passed over so far) v1 ")


def test_calls_sampled_otherwise_than_the_trainer_scores_are_refused_by_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The trainer scores at grpo.temperature (0.9 here), untruncated: an episode sampled at
    another temperature, with top_p or under a grammar (a forced tool call), is left out,
    counted and named; top_k 0 is vLLM's "off";
    a model whose generation_config sets a temperature is read as vLLM reads it."""
    settings = [
        {"temperature": 0.9},
        {"temperature": 0.9, "top_k": 0},
        {"temperature": 0.7},
        {"temperature": 0.9, "top_p": 0.95},
        {},
        {"temperature": 0.9, "tool_choice": "required"},
        {"temperature": 0.9, "tool_choice": {"type": "auto"}},
    ]

    async def main() -> tuple[Any, ...]:
        async with Store(str(tmp_path / "s.db")) as store:
            for n, sampling in enumerate(settings):
                await _episode(store, "g", n, "0", float(n % 2), sampling=sampling)
            config = _config(tmp_path)
            strict = GroupReader(config, store, LoopState(), reward_rule(config.train, "none"), temperature=0.9)
            with caplog.at_level(logging.WARNING, logger="rl_proxy.trainer"):
                refused = await strict.prepare("g")
            defaults = GroupReader(
                config, store, LoopState(), reward_rule(config.train, "none"), 0.9, {"temperature": 0.9}
            )
            loose = _config(tmp_path, allow_truncated_sampling=True)
            allowing = GroupReader(
                loose, store, LoopState(), reward_rule(loose.train, "none"), 0.9, {"temperature": 0.9}
            )
            return refused, strict.state, await defaults.prepare("g"), await allowing.prepare("g")

    refused, state, with_defaults, allowing = asyncio.run(main())
    assert refused is not None and refused[1] == [0.0, 1.0, 0.0] and state.refused_sampling == 4
    named = [r.getMessage() for r in caplog.records]
    assert any("temperature 0.7" in m for m in named) and any("top_p 0.95" in m for m in named)
    assert any("sampled with tool_choice 'required'" in m for m in named)
    assert with_defaults is not None and with_defaults[1] == [0.0, 1.0, 0.0, 0.0]  # the fifth: 0.9 by default
    assert allowing is not None and allowing[1] == [0.0, 1.0, 1.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("api", "request_fields", "refused"),
    [
        ("chat.completions", {"logit_bias": {"42": 5.0}}, "logit_bias"),
        ("chat.completions", {"min_tokens": 8}, "min_tokens"),
        ("chat.completions", {"allowed_token_ids": [1, 2, 3]}, "allowed_token_ids"),
        ("chat.completions", {"bad_words": ["no"]}, "bad_words"),
        ("chat.completions", {"thinking_token_budget": 64}, "thinking_token_budget"),
        ("chat.completions", {"vllm_xargs": {"bias": 1}}, "vllm_xargs"),
        ("openai.responses", {"text": {"format": {"type": "json_schema", "schema": {}}}}, "response_format"),
        ("openai.responses", {"text": {"format": {"type": "text"}, "verbosity": "low"}}, None),
        ("chat.completions", {"min_tokens": 0, "bad_words": [], "logit_bias": None}, None),
    ],
)
def test_every_field_that_reshapes_the_sampled_distribution_is_refused(
    api: str, request_fields: dict[str, Any], refused: str | None
) -> None:
    """vLLM applies these before it computes the logprobs it records, and the trainer scores the
    whole distribution: they trained off-policy without a word. Their empty defaults are fine."""
    from trainer.groups import sampling_refused

    call = CallRecord(
        session_id="s",
        seq=1,
        api=api,
        model="m",
        upstream="u",
        stream=False,
        request={"temperature": 1.0, **request_fields},
        response=None,
        ok=True,
        http_status=200,
        error=None,
        prompt_token_ids=[1],
        completions=[Completion(0, [2], [-0.5], "stop")],
        policy_version="0",
        policy_version_end="0",
        started_at=T0,
        finished_at=T0,
    )
    why = sampling_refused([call], {"temperature": 1.0, "defaults": {}, "allow_truncated_sampling": False})
    assert (why is None) if refused is None else (why is not None and f"sampled with {refused}" in why), why


def test_only_the_choice_an_episode_continued_is_trained() -> None:
    """n > 1: call 2 sampled two choices and call 3 went on from the second; the first choice's
    branch did not produce the episode's outcome. At the episode's last call, the first choice
    is the answer. When the chain breaks after the n > 1 call (its next prompt does not extend
    it), the choice the next call echoes is the one (choice 0 was kept whatever the episode did).
    The session graph decides it (issue 45: graph.build, and so exports and the viewer, trained
    both choices while the trainer trained one); the thrown-away choice is set aside."""
    from recorder.graph import build, delivery

    def made(seq: int, prompt: list[int], *choices: list[int], messages: list[Any] | None = None) -> CallRecord:
        texts = [
            {"index": i, "message": {"role": "assistant", "content": f"answer {c}"}} for i, c in enumerate(choices)
        ]
        return CallRecord(
            session_id="s",
            seq=seq,
            api="chat.completions",
            model="m",
            upstream="u",
            stream=False,
            request={"messages": messages or []},
            response={"choices": texts},
            ok=True,
            http_status=200,
            error=None,
            prompt_token_ids=prompt,
            completions=[Completion(i, c, [-0.5] * len(c), "stop") for i, c in enumerate(choices)],
            policy_version="0",
            policy_version_end="0",
            started_at=T0,
            finished_at=T0,
        )

    def spans(sequences: list[Any]) -> list[list[tuple[int, int]]]:
        return [[(span.seq, span.choice) for span in q.spans] for q in sequences]

    calls = [made(1, [1, 2], [10]), made(2, [1, 2, 10, 3], [11], [20]), made(3, [1, 2, 10, 3, 20, 4], [12], [30])]
    graph = build(calls)
    assert spans(graph.trained.sequences) == [[(1, 0), (2, 1), (3, 0)]]
    assert delivery(calls, graph)[:2] == (3, 3)  # what is meant of call 2 is the choice trained
    assert spans(graph.aside.sequences) == [[(1, 0), (2, 0)], [(1, 0), (2, 1), (3, 1)]]
    assert [q.chain for q in graph.trained.sequences + graph.aside.sequences] == [0, 1, 2]
    ask = [{"role": "user", "content": "go"}]
    then = [*ask, {"role": "assistant", "content": "answer [21]"}, {"role": "user", "content": "more"}]
    broken = [made(1, [1, 2], [11], [21], messages=ask), made(2, [9, 9, 9], [12], messages=then)]
    assert spans(build(broken).trained.sequences) == [[(1, 1)], [(2, 0)]]


def test_a_session_that_joined_a_group_by_its_key_is_left_out_and_counted(tmp_path: Path) -> None:
    """Anyone who can reach the proxy can name a group in a key: such a session is no episode of
    the runner's. It was trained on (or, with `outcome=1` in its key, raised AttributeError and
    stopped the run, again at every resume), and made a resumed run skip the group."""
    from proxy.sessions import parse_key

    async def main() -> tuple[list[str], Any, LoopState]:
        async with Store(str(tmp_path / "s.db")) as store:
            for n in range(4):
                await _episode(store, "g", n, "0", float(n % 2))
            intruder = parse_key("run=r,task=t,group=g,id=intruder,outcome=1,sampling=hot")
            await store.resolve_session(intruder)
            await store.add_reward("intruder", 1.0, "posted")
            loop = _loop(tmp_path, store, LoopState())
            return await loop.leftovers(), await loop.prepare("g"), loop.state

    leftovers, prepared, state = asyncio.run(main())
    assert leftovers == ["g"] and prepared is not None and prepared[1] == [0.0, 1.0, 0.0, 1.0]
    assert state.foreign == 1


def test_aux_calls_are_not_trained_and_a_fatal_capture_leaves_its_episode_out(tmp_path: Path) -> None:
    """An aux call (another model than the runner named: a title) adds no sequence; an episode
    with an answered call that holds no logprobs is graded FATAL (recorder/validation.py):
    skipped and counted."""

    def extra(session: str, model: str, logprobs: list[float]) -> CallRecord:
        return CallRecord(
            session_id=session,
            seq=3,
            api="chat.completions",
            model=model,
            upstream="u",
            stream=False,
            request={"messages": [{"role": "user", "content": "Title this."}]},
            response={"id": "x"},
            ok=True,
            http_status=200,
            error=None,
            prompt_token_ids=[90, 91],
            completions=[Completion(0, [50, 51], logprobs, "stop")],
            policy_version="1",
            policy_version_end="1",
            started_at=T0,
            finished_at=T0,
        )

    async def main() -> tuple[Any, LoopState, Any]:
        async with Store(str(tmp_path / "s.db")) as store:
            also = {
                0: [extra("g-0", "small-fast", [-0.1, -0.2])],  # aux: left out
                1: [extra("g-1", "m", [])],  # no logprobs: FATAL
            }
            for n, reward in enumerate([1.0, 0.0, 1.0, 0.0]):
                await _episode(store, "g", n, "1", reward, policy="m", also=also.get(n, ()))
            loop = _loop(tmp_path, store, LoopState(step=1, version=1))
            # the viewer, before the trainer took the group, tells the same
            shown = await would_train(store, await store.list_sessions(group_id="g"), loop.rule, loop.settings)
            return await loop.prepare("g"), loop.state, shown

    prepared, state, shown = asyncio.run(main())
    assert [why for _, _, _, why in shown.episodes] == ["", "capture", "", ""]
    assert prepared is not None
    samples, rewards, _ = prepared
    assert rewards == [1.0, 1.0, 0.0] and state.capture_fatal == 1
    assert len(samples) == 3 and all(50 not in s.sequence.input_ids for s in samples)


def test_the_warm_start_trains_on_the_successes_of_a_group_or_of_a_store(tmp_path: Path) -> None:
    """A supervised step (`train.warm_start`) takes a group's successful episodes whatever the
    others' rewards (an all-success group too, which GRPO skips), each of weight 1, and no group
    without one; `successes` finds them in any store (`warm_start_from`), held-out tasks left out."""

    async def main() -> tuple[Any, ...]:
        async with Store(str(tmp_path / "s.db")) as store:
            for group, rewards in (("mixed", [1.0, 0.0, 0.0, 1.0]), ("won", [1.0] * 4), ("lost", [0.0] * 4)):
                for n, reward in enumerate(rewards):
                    await _episode(store, group, n, "0", reward)
            loop = _loop(tmp_path, store, LoopState(), steps=2, warm_start=1)
            await loop.save_run()
            taken = [await loop.prepare(group, supervised=True) for group in ("mixed", "won", "lost")]
            found = await successes(store, loop.rule, 1.0, 1, set(), vocab=13)
            with pytest.raises(TrainError, match="token id 12, and the model's vocabulary has 12"):
                await successes(store, loop.rule, 1.0, 1, set(), vocab=12)  # another model's store
            return taken, found, await successes(store, loop.rule, 1.0, 1, {"t"}, vocab=13), loop.state

    (mixed, won, lost), found, heldout, state = asyncio.run(main())
    assert mixed is not None and won is not None and lost is None
    assert [(s.sequence.session_id, s.advantage) for s in mixed[0]] == [("mixed-0", 1.0), ("mixed-3", 1.0)]
    assert mixed[1] == [1.0, 1.0] and len(won[0]) == 4
    assert won[0][0].sequence.loss_mask == [0, 0, 0, 1, 1, 0, 1]  # the sampled tokens only, as in GRPO
    assert (state.skipped_equal, state.no_success) == (0, 1)  # "lost" is counted, as passed over
    assert sorted(q.session_id for episode in found for q in episode) == [
        "mixed-0",
        "mixed-3",
        "won-0",
        "won-1",
        "won-2",
        "won-3",
    ]
    assert heldout == []
    # The viewer says what such a step did with each group.
    with AppThread(create_app(str(tmp_path / "s.db"), decode=lambda ids: [str(i) for i in ids])) as viewer:
        mixed_page, lost_page = (httpx.get(f"{viewer.url}/groups/{g}").text for g in ("mixed", "lost"))
    assert "A warm-start step" in mixed_page and "Not trained" not in mixed_page
    assert "Not trained</b>: no episode succeeded" in lost_page


def test_a_warm_start_fits_in_the_run_and_a_store_needs_one(tmp_path: Path) -> None:
    assert _config(tmp_path, steps=2, warm_start=2).train.warm_start == 2  # expert iteration alone
    with pytest.raises(ValueError, match="3 supervised steps, and the run has 2 in all"):
        _config(tmp_path, steps=2, warm_start=3)
    with pytest.raises(ValueError, match="set warm_start"):
        _config(tmp_path, warm_start_from="runs/x/rl-proxy.db")
