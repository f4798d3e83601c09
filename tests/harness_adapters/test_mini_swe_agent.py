"""mini-swe-agent (pip, a dev dependency) run as an episode by the command adapter with the
recipe in docs/harnesses.md: its text-based config, its litellm model on the proxy through
OPENAI_API_BASE, against the real vLLM."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from benchmarks.support.stack import Upstream
from harness_adapters.environments import BubblewrapEnvironment
from harness_adapters.harnesses import CommandAdapter, command_env
from harness_adapters.runner import EpisodeRunner
from harness_adapters.tasks import Task

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# The model's commands run in the shell example's sandbox (bubblewrap: everything read-only but
# the work directory): an untrained SmolLM2 once deleted /bin/sh here.
SANDBOX = BubblewrapEnvironment().wrap([])
MINI = CommandAdapter(
    [
        *SANDBOX,
        "mini",
        "-c",
        "mini_textbased.yaml",
        "-c",
        "agent.step_limit=2",
        "-c",
        "agent.cost_limit=0",
        "--model-class",  # the text-based config's model: actions in fenced blocks, not tool calls
        "litellm_textbased",
        "-m",
        "openai/{model}",
        "-t",
        "{prompt}",
        "--yolo",
        "--exit-immediately",
        "-o",
        "{workdir}/trajectory.json",
    ],
    env={
        "MSWEA_CONFIGURED": "true",
        "MSWEA_COST_TRACKING": "ignore_errors",
        "MSWEA_GLOBAL_CONFIG_DIR": "{workdir}/.mini",
        "TMPDIR": "{workdir}",
    },
)


@pytest.mark.usefixtures("bwrap")  # its commands run in the shell example's sandbox
def test_mini_swe_agent_runs_as_an_episode_and_every_call_is_recorded(
    make_proxy: Any, vllm: Upstream, tmp_path: Path
) -> None:
    # Found beside this interpreter, as the adapter finds it, with or without an activated venv.
    assert shutil.which("mini", path=command_env()["PATH"]), "mini-swe-agent is a dev dependency: run `make install`"
    proxy = make_proxy(vllm.url, max_completion_tokens=48)  # its calls run to the cap, which sets the time
    runner = EpisodeRunner(proxy.url, MINI, [], vllm.model, tmp_path, "mini", timeout=300)
    [result] = asyncio.run(runner.run_all([Task("hello", "Create a file hello.txt containing the word hello.")], 1))
    log = Path(str(result.outcome.log)).read_text() + result.outcome.output
    assert result.status == "ok" and result.calls >= 1, log[-800:]
    calls = proxy.calls(result.session_id)
    assert [c.seq for c in calls] == list(range(1, result.calls + 1))
    for call in calls:
        assert call.ok and call.api == "chat.completions" and call.completions[0].token_ids
        assert call.rewrites["max_tokens"] == [None, 48]  # it asks for no limit
    assert (tmp_path / result.session_id / "trajectory.json").exists()  # mini's own record of the run
    # Its turns extend each other: the whole episode, one prompt after another.
    assert len(calls[-1].prompt_token_ids) > len(calls[0].prompt_token_ids) or len(calls) == 1
