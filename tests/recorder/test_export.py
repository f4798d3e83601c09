"""Exports of every kind and format, from a store filled with hand-built calls; the SFT export
is loaded with `datasets` and trains one step with TRL's SFTTrainer on the default model."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from recorder import CallRecord, Completion, SessionInfo, Store
from recorder.export import Filter, export

T0 = datetime(2026, 1, 1)


def turn(session: str, seq: int, prompt: list[int], tokens: list[int], messages: list[dict], answer: str) -> CallRecord:
    return CallRecord(
        session_id=session,
        seq=seq,
        api="chat.completions",
        model="m",
        upstream="u",
        stream=False,
        request={"messages": messages},
        ok=True,
        http_status=200,
        error=None,
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]},
        prompt_token_ids=prompt,
        completions=[Completion(0, tokens, [-0.5] * len(tokens), "stop")],
        policy_version="v3",
        policy_version_end="v3",
        started_at=T0 + timedelta(minutes=seq),
        finished_at=T0,
    )


async def fill(db: str) -> None:
    """Two sessions of two merged turns each; rewards 1.0 and 0.0."""
    async with Store(db) as store:
        for i, reward in enumerate((1.0, 0.0)):
            sid = f"ep{i}"
            await store.resolve_session(SessionInfo(id=sid, key=sid, run="r", task_id=f"t{i}", group_id="g"))
            first = [{"role": "user", "content": f"What is {i} + 1?"}]
            await store.record(turn(sid, 1, [1, 2, 3], [4, 5], first, f"{i + 1}"))
            second = [*first, {"role": "assistant", "content": f"{i + 1}"}, {"role": "user", "content": "Sure?"}]
            await store.record(turn(sid, 2, [1, 2, 3, 4, 5, 6], [7], second, "Yes."))
            await store.add_reward(sid, reward, "test")
            await store.add_reward(sid, 0.5, "judge", call_seq=2)


@pytest.fixture
async def db(tmp_path: Path) -> str:
    path = str(tmp_path / "x.db")
    await fill(path)
    return path


async def test_rl_parquet_round_trips(db: str, tmp_path: Path) -> None:
    out = tmp_path / "rl.parquet"
    async with Store(db) as store:
        assert await export(store, out, kind="rl", fmt="parquet") == 2
    rows = pq.read_table(out).to_pylist()
    assert [r["session_id"] for r in rows] == ["ep0", "ep1"]
    first = rows[0]
    assert first["input_ids"] == [1, 2, 3, 4, 5, 6, 7] and first["loss_mask"] == [0, 0, 0, 1, 1, 0, 1]
    assert first["logprobs"] == [0.0, 0.0, 0.0, -0.5, -0.5, 0.0, -0.5]
    assert (first["reward"], first["task_id"], first["group_id"], first["calls"]) == (1.0, "t0", "g", [1, 2])
    assert first["policy_versions"] == ["v3", "v3"] and first["span_starts"] == [3, 6]
    assert first["span_rewards"] == [None, 0.5]
    # the session graph: the row's first call starts it; its second continues it (recorder/graph.py)
    assert (first["edge"], first["root_call"], first["parent_call"], first["purpose"]) == ("new", 1, None, "train")
    calls = tmp_path / "calls.jsonl"
    async with Store(db) as store:
        await export(store, calls, kind="calls")
    graph = [(r["seq"], r["edge"], r["parent_call"], r["root_call"]) for r in map(json.loads, calls.open())]
    assert graph[:2] == [(1, "new", None, 1), (2, "continue", 1, 1)]


async def test_calls_parquet_has_one_schema_for_every_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A column that is empty in the first batch (thread_start, error) and set in a later one:
    the schema is declared, not inferred from the first batch (which typed it null)."""
    monkeypatch.setattr("recorder.export.BATCH", 1)
    db, out = str(tmp_path / "c.db"), tmp_path / "calls.parquet"
    async with Store(db) as store:
        await store.resolve_session(SessionInfo(id="a", key="a"))
        first = turn("a", 1, [1, 2], [3], [{"role": "user", "content": "hi"}], "yo")
        await store.record(first)
        await store.record(replace(first, seq=2, call_id="c2", thread_start="edited history", error="x", token_in=True))
        assert await export(store, out, kind="calls", fmt="parquet") == 2
    rows = pq.read_table(out).to_pylist()
    assert [(r["thread_start"], r["error"], r["token_in"]) for r in rows] == [
        (None, None, False),
        ("edited history", "x", True),
    ]
    assert rows[1]["completions"][0]["token_ids"] == [3] and orjson.loads(rows[0]["request"])["messages"]


async def test_one_per_call_and_filters(db: str, tmp_path: Path) -> None:
    async with Store(db) as store:
        assert await export(store, tmp_path / "a.jsonl", kind="rl", merge=False) == 4
        assert await export(store, tmp_path / "b.jsonl", kind="rl", where=Filter(min_reward=0.5)) == 1
        assert await export(store, tmp_path / "c.jsonl", kind="calls", where=Filter(task_id="t1")) == 2
        late = Filter(since=T0 + timedelta(minutes=2))
        assert await export(store, tmp_path / "d.jsonl", kind="calls", where=late) == 2
        assert await export(store, tmp_path / "e.jsonl", kind="calls", where=Filter(api="completions")) == 0
        assert await export(store, tmp_path / "f.parquet", kind="calls", fmt="parquet") == 4
    row = orjson.loads((tmp_path / "c.jsonl").read_bytes().splitlines()[0])
    assert row["session_id"] == "ep1" and row["completion_token_ids"] == [4, 5]
    calls = pq.read_table(tmp_path / "f.parquet").to_pylist()
    assert orjson.loads(calls[0]["request"])["messages"][0]["content"] == "What is 0 + 1?"


@pytest.mark.slow
async def test_sft_rows_of_a_call_with_several_choices_pair_each_chain_with_its_own_answer(tmp_path: Path) -> None:
    """Every alternative chain of an n > 1 call was paired with choice 0's answer: duplicate rows,
    the other answers lost."""
    db = str(tmp_path / "n.db")
    async with Store(db) as store:
        await store.resolve_session(SessionInfo(id="s", key="s", run="r"))
        asked = [{"role": "user", "content": "Name a colour."}]
        call = turn("s", 1, [1, 2, 3], [4], asked, "red")
        answers = ["red", "green", "blue"]
        response = {
            "choices": [{"index": i, "message": {"role": "assistant", "content": a}} for i, a in enumerate(answers)]
        }
        completions = [Completion(i, [4 + i], [-0.5], "stop") for i in range(3)]
        await store.record(replace(call, response=response, completions=completions))
        assert await export(store, tmp_path / "sft.jsonl", kind="sft") == 3
    rows = [orjson.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert sorted(row["messages"][-1]["content"] for row in rows) == sorted(answers)


async def test_sft_dataset_trains_one_step_with_trl(db: str, tmp_path: Path) -> None:
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from proxy.model import prepare_default_model

    out = tmp_path / "sft"
    async with Store(db) as store:
        assert await export(store, out, kind="sft", fmt="hf", where=Filter(min_reward=0.5)) == 1
    dataset = load_from_disk(str(out))
    messages = dataset[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[-1]["content"] == "Yes."
    model_dir = prepare_default_model()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    before = model.lm_head.weight.detach().clone()
    config = SFTConfig(
        output_dir=str(tmp_path / "run"),
        max_steps=1,
        per_device_train_batch_size=1,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        learning_rate=1e-3,
    )
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(model_dir)
    )
    result = trainer.train()
    assert result.global_step == 1 and result.training_loss > 0
    assert not model.lm_head.weight.detach().equal(before)
