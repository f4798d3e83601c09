"""One training step through the real Claude Code, unchanged, on the real vLLM: the shell
example's `train-claude.yaml`, for one step of one group of two episodes: every call recorded
with its tokens through the Messages API, sequences built from them, one optimizer step, one
swap. Claude Code runs with its own `--system-prompt` and its Bash tool only, which brings its
prompts from ~7,600 tokens (its system prompt is ~5,000 of them) to under 1,000: the same path,
the step in a tenth of the time on 2 cores. The step on the full ~7,700-token sequences is
`python -m benchmarks.bench_train_step` (the agent shape) and the example itself. Codex and
mini-swe-agent go through the same path from their recorded calls (their recording and
token-in are tested in tests/harness_adapters/)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.support.sessions import HARNESS_BIN, SHELL
from benchmarks.support.stack import Upstream, read_store
from harness_adapters.config import load_config
from harness_adapters.rewards import PythonReward
from recorder.graph import build_sequences
from trainer.config import TrainConfig
from trainer.run import train

# Claude Code's episodes, sampled and then trained on 2 CPU cores.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def by_duration(task: Any, outcome: Any) -> float:
    """A test's reward, certain to differ between two episodes (the model seldom solves a task
    through these harnesses, and a group of equal rewards is never trained)."""
    return outcome.seconds


@pytest.mark.usefixtures("bwrap")  # its commands run in the shell example's sandbox
def test_one_step_through_claude_code(
    vllm: Upstream, restore: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert (HARNESS_BIN / "claude").exists(), "run `make install`: it installs Claude Code into .harnesses/"
    monkeypatch.setenv("PATH", f"{HARNESS_BIN}{os.pathsep}{os.environ['PATH']}")
    config = load_config(SHELL / "train-claude.yaml", TrainConfig)
    config.out, config.episodes_per_task, config.concurrency, config.eval = str(tmp_path / "run"), 2, 2, None
    config.proxy.upstream, config.proxy.vllm_args = vllm.url, []
    config.rewards = [PythonReward(type="python", function=f"{__file__}:by_duration")]
    # The 135M model seldom ends inside the output cap, and both harnesses then exit 1, which the
    # trainer scores as a crash (train.failure_reward) for every episode alike: their exit code is
    # set aside here so the reward above decides.
    argv = list(config.harness.argv)  # type: ignore[union-attr]
    argv[argv.index("--tools") + 1] = "Bash"
    argv += ["--system-prompt", "You are a shell agent: do the task in this directory with the Bash tool."]
    config.harness.argv = ["sh", "-c", '"$@" || true', "sh", *argv]  # type: ignore[union-attr]
    # 32 tokens a call, not the example's 128: a 135M model's calls here run to the cap whatever
    # it is (Claude Code then asks it to go on, four calls an episode), and the cap set the time.
    config.harness.env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = "32"  # type: ignore[union-attr]
    # Checkpointed layers: a step on Claude Code's full ~7,700-token sequences peaked near 16 GB in
    # the test process, which with the shared vLLM beside it reached this machine's 24 GB once in CI.
    grpo = {**config.train.grpo, "gradient_checkpointing": True}
    # Both episodes in one micro-batch: their common prompt (Claude Code's system prompt and
    # tools, most of each sequence) runs once, its KV shared by the two rows.
    config.train = config.train.model_copy(update={"steps": 1, "grpo": grpo, "micro_batch": 2})

    result = train(config, progress=False)

    assert (result.state.step, result.state.version) == (1, 1)
    assert httpx.get(f"{restore}/weight_info").json()["weight_version"] == "1"
    out = tmp_path / "run"
    [step] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"reward"' in line]
    assert step["samples"] >= 2 and step["skipped_equal"] == 0, step
    assert step["peak_memory_gb"] >= step["memory_gb"] > 0
    sessions = read_store(str(out / "rl-proxy.db"), lambda s: s.list_sessions())
    trained = [s for s in sessions if s.group_id in result.state.consumed]
    assert len(trained) == 2 and all(s.reward is not None for s in trained)
    calls = read_store(str(out / "rl-proxy.db"), lambda s: _calls(s, [s_.id for s_ in trained]))
    assert calls
    for call in calls:  # every call Claude Code made went through the proxy, recorded with its tokens
        assert call.ok and call.api == "anthropic.messages" and call.stream
        assert call.rewrites["model"] == [call.request["model"], vllm.model]
        assert call.prompt_token_ids and call.completions[0].token_ids
        assert len(call.completions[0].logprobs) == len(call.completions[0].token_ids)
    assert any(c.request.get("tools") for c in calls)  # the main loop's, which offer its Bash tool
    for session in trained:  # each episode's calls all in its sequences
        report = build_sequences([c for c in calls if c.session_id == session.id])
        assert sum(len(s.calls) for s in report.sequences) == report.calls >= 1 and not report.skipped
    print(f"{len(calls)} calls, step {step}")


async def _calls(store: Any, session_ids: list[str]) -> list[Any]:
    return [c for sid in session_ids async for c in store.iter_calls(sid)]
