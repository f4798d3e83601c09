"""The real Claude Code CLI (npm @anthropic-ai/claude-code, installed by `make install` into
.harnesses/) pointed at the proxy with two environment variables, against the real vLLM: its
subagents placed in the session graph, and its tool-calling turns joined into one exact token
sequence (token-in through the Messages API). Its compactions: tests/harness_adapters/test_swe.py (its
own automatic one, in a container, with a scripted summary: a 135M model's seldom ends within
the cap) and `make claude-graph` (`/compact`). Every call of an episode recorded with its tokens,
and a training step on them: tests/trainer/test_train_harnesses.py."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from benchmarks.claude_code_graph import TASK, wrong_links
from benchmarks.support.sessions import HARNESS_BIN, claude_code_branching, masked_in, sampled
from benchmarks.support.stack import Upstream
from proxy.server import AppThread
from recorder.graph import build_sequences, place
from trainer.viewer import create_app as viewer_app

# Prompts of 4,500 to 7,600 tokens on 2 CPU cores, and the first test also waits for the shared
# vLLM to start: Claude Code took 330 s of it on a quiet machine (2026-11-23), so these get 600 s.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

CLAUDE = HARNESS_BIN / "claude"


def test_claude_code_subagents_are_placed_in_the_session_graph(make_proxy: Any, vllm: Upstream, tmp_path: Path) -> None:
    """Real Claude Code, its Agent tool forced where offered (greedy): the main loop starts a
    subagent. The graph links the subagent to the call that sampled its Agent call, and the main
    loop's second call continues its first (four subagent calls pushed it out of the proxy's
    threads before); every link checks out against what Claude Code sent
    (benchmarks/claude_code_graph.py checks the same on sampled episodes, compactions too). The
    viewer draws the subagent under the main loop. Token-in: the main loop's second call was
    built from the tokens the first sampled (its Agent call) and the subagent's result, and the
    two are one training sequence whose masked-in tokens are exactly the sampled ids."""
    assert CLAUDE.exists(), "run `make install`: it installs Claude Code into .harnesses/"
    # The main loop's second call is forced to start a subagent too: a project hook refuses every
    # Agent call after the first, which saves the second subagent's four calls (about 50 s).
    first = tmp_path / "first-agent-call"
    marker = shlex.quote(str(first))
    refuse = f"[ -e {marker} ] && {{ echo 'One subagent is enough.' >&2; exit 2; }}; touch {marker}"
    hook = {"hooks": {"PreToolUse": [{"matcher": "Agent", "hooks": [{"type": "command", "command": refuse}]}]}}
    (tmp_path / "project" / ".claude").mkdir(parents=True)
    (tmp_path / "project" / ".claude" / "settings.json").write_bytes(orjson.dumps(hook))
    proxy = make_proxy(vllm.url)
    sampling = {"tool_choice": "Agent", "temperature": 0}
    created = httpx.post(f"{proxy.url}/admin/sessions", json={"sampling": sampling}).json()
    printed = claude_code_branching(proxy.url, created["key"], tmp_path, TASK, compact=False)
    calls = proxy.calls(created["id"])
    placed = {p.seq: p for p in place(calls)}
    edges = [(p.edge, p.parent) for p in placed.values()]
    assert ("subagent", 1) in edges, (edges, printed)
    main = [c.seq for c in calls if "Agent" in {t["name"] for t in c.request.get("tools", [])}]
    assert len(main) >= 2 and (placed[main[1]].edge, placed[main[1]].parent) == ("continue", main[0]), edges
    assert wrong_links(calls, list(placed.values())) == [], (edges, printed)
    assert all(c.ok and c.api == "anthropic.messages" and c.stream for c in calls)
    # Only the main loop's first call and the subagent's first started a thread: every other
    # call, the main loop's after the subagent's result included, was built from sampled tokens.
    [subagent] = [seq for seq, p in placed.items() if p.edge == "subagent"]
    assert [c.seq for c in calls if not c.token_in] == [main[0], subagent], [(c.seq, c.thread_start) for c in calls]
    [chain] = [s for s in build_sequences(calls).sequences if s.spans[0].seq == main[0]]
    assert [span.seq for span in chain.spans][:2] == main[:2]
    assert masked_in(chain) == sampled(chain, calls)
    with AppThread(viewer_app(proxy.db, decode=lambda ids: [f"<{i}>" for i in ids])) as viewer:
        page = httpx.get(f"{viewer.url}/sessions/{created['id']}").text
    assert '<ul><li><b class="edge">subagent</b> of call <a href="#call-1">1</a>' in page  # nested under call 1's
