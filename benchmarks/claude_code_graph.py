"""Real Claude Code sessions that branch, placed by the session graph (`make claude-graph`).

Each episode is one proxy session of Claude Code 2.1.197 (unchanged, from npm) on the real vLLM
CPU server with the default model, in three runs of `claude -p` (benchmarks/support/sessions.py
`claude_code_branching`): the task, where the session's sampling forces the `Agent` tool, so the
main loop starts subagents; `/compact`; and "Go on." from the summary. Per episode it prints the
calls by edge, the aux calls, `delivered_fraction` beside what one chain per episode (NeMo Gym's
rule) would deliver, and whether every link is right, checked against what Claude Code sent:

- a `subagent` edge: its parent sampled an Agent call whose `prompt` is a text part of the
  child's first user message;
- a `compaction` edge: the child says "This session is being continued from a previous
  conversation", and its parent is the call Claude Code made for `/compact` (or a call of its
  chain, when Claude Code had the summary go on past the output limit);
- no call starts unlinked where Claude Code sent a subagent or a post-compaction call whose
  link the records hold (prompts and summaries under 24 characters are not linked, by design).

The 135M model writes nonsense; what is measured is where each call is placed, not what it says.
Launches vLLM (eager) unless --upstream names a running one.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import httpx
import orjson

from benchmarks.bench_episodes import bench_vllm
from benchmarks.support.sessions import claude_code_branching
from benchmarks.support.stack import read_store
from proxy.app import create_app
from proxy.server import AppThread
from proxy.settings import Settings
from recorder import CallRecord
from recorder.graph import EDGES, MIN_LINK_TEXT, Placement, build, delivery, edge_counts, first_user_parts

TASK = "Use a subagent to list the files in this directory."
RESUMED = "This session is being continued from a previous conversation"


def agent_prompts(call: CallRecord) -> set[str]:
    """The `prompt` arguments of the Agent calls a Messages call sampled."""
    blocks = (call.response or {}).get("content") or []
    found = set()
    for block in blocks:
        if block.get("type") == "tool_use" and block.get("name") == "Agent":
            prompt = (block.get("input") or {}).get("prompt")
            found |= {prompt.strip()} if isinstance(prompt, str) else set()
    return found


def sampled_texts(call: CallRecord) -> list[str]:
    """The texts of a Messages call's answer (a summary, for a /compact call)."""
    return [b.get("text", "").strip() for b in (call.response or {}).get("content") or [] if b.get("type") == "text"]


def is_compaction_call(call: CallRecord) -> bool:
    """Whether Claude Code made this call for `/compact` (its last message asks for the summary)."""
    return "create a detailed summary of the conversation so far" in orjson.dumps(call.request["messages"][-1]).decode()


def wrong_links(calls: list[CallRecord], placements: list[Placement]) -> list[str]:
    """Each link the graph made or missed against what Claude Code sent, in words (none: all right)."""
    by_seq = {c.seq: c for c in calls}
    placed = {p.seq: p for p in placements}
    wrong = []
    for p in placements:
        call = by_seq[p.seq]
        parts = first_user_parts(call.request)
        starts_resumed = any(RESUMED in part for part in parts)
        served = [c.seq for c in calls if c.seq < p.seq and agent_prompts(c) & parts]
        if p.edge == "subagent" and (p.parent is None or not agent_prompts(by_seq[p.parent]) & parts):
            wrong.append(f"call {p.seq}: subagent of {p.parent}, which sampled no Agent call with its prompt")
        # the summary call, or the last of its chain when Claude Code made it go on past the output limit
        summary = placed[p.parent].root if p.parent in placed else None
        if p.edge == "compaction" and not (starts_resumed and summary and is_compaction_call(by_seq[summary])):
            wrong.append(f"call {p.seq}: compaction of {p.parent}, not a resumed conversation of a /compact call")
        summaries = [c for c in calls if c.seq < p.seq and is_compaction_call(c) and c.ok]
        linkable = any(len(text) >= MIN_LINK_TEXT for c in summaries for text in sampled_texts(c))
        if p.edge == "new" and starts_resumed and linkable:  # a summary like "Cheers!" links nothing, by design
            wrong.append(f"call {p.seq}: starts from a summary, placed new ({p.reason})")
        if p.edge == "new" and served and any(len(a) >= 24 for c in served for a in agent_prompts(by_seq[c]) & parts):
            wrong.append(f"call {p.seq}: a subagent of call {served[-1]}, placed new ({p.reason})")
    return wrong


def measure(upstream: str, episodes: int, work: Path, temperature: float | None) -> list[dict[str, Any]]:
    db = str(work / "claude-graph.db")
    rows = []
    with AppThread(create_app(Settings(upstream=upstream, db=db))) as proxy:
        for n in range(episodes):
            sampling = {"tool_choice": "Agent", "temperature": temperature}
            created = httpx.post(f"{proxy.url}/admin/sessions", json={"sampling": sampling}).json()
            print(f"episode {n + 1} of {episodes}: session {created['id']} ...", flush=True)
            home = Path(tempfile.mkdtemp(prefix="rlp-claude-", dir=work))
            claude_code_branching(proxy.url, created["key"], home, TASK)

            async def read(store: Any, session: str = created["id"]) -> list[CallRecord]:
                return [c async for c in store.iter_calls(session)]

            calls = read_store(db, read)
            graph = build(calls)
            placements = graph.placements
            reached, meant, longest = delivery(calls, graph)
            wrong = wrong_links(calls, placements)
            rows.append(
                {
                    "session": created["id"],
                    "calls": len(calls),
                    **edge_counts(placements),
                    "delivered": reached / meant if meant else 0.0,
                    "one chain": longest / meant if meant else 0.0,
                    "links right": not wrong,
                    "wrong": wrong,
                }
            )
            print(f"  {rows[-1]}", flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    columns = ["calls", *EDGES, "aux", "delivered", "one chain", "links right"]
    lines = ["| episode | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for i, row in enumerate(rows, 1):
        cells = [f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in columns]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", help="a running vLLM (…/v1, started with --trust-request-chat-template)")
    parser.add_argument("--episodes", type=int, default=3)
    parser.add_argument("--temperature", type=float, help="forced on every call (default: as Claude Code asks, 1.0)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rlp-claude-graph-"))
    with bench_vllm(args.upstream, work, max_model_len=8192, extra_args=["--trust-request-chat-template"]) as (
        upstream,
        _,
    ):
        rows = measure(upstream, args.episodes, work, args.temperature)
    print(table(rows))
    for i, row in enumerate(rows, 1):
        for line in row["wrong"]:
            print(f"episode {i}: {line}")
    raise SystemExit(0 if all(row["links right"] for row in rows) else 1)


if __name__ == "__main__":
    main()
