"""A session as a graph: where each recorded call belongs, and why.

A harness session is not one thread. Token-in joins a call to the one whose answer it continues
(`continue`, or `fork` for a second call continuing the same answer); anything else starts a new
sequence, and it is placed here by what links it to the calls before it, read from the records
alone (so it works on any store, whatever proxy served the calls):

- `retry`: the same request as an earlier call, and the same prompt ids where both have them
  (the same conversation, tools and settings, no new message: an SDK's retry, sent again after
  a timeout, answered or not): linked to it.
  Only one of the two is trained: the one a later call continued; if neither was continued,
  the retry (the harness sent it because the original's answer never reached it).
- `subagent`: a new conversation whose first user message (or a text part of it) is a string
  argument of a tool call sampled earlier in the session (Claude Code's Agent tool and its
  like): linked to that call.
- `compaction`: a new conversation whose first messages carry an answer sampled earlier (the
  summary; not one the model copied from its own prompt), linked to the call that sampled it.
- `new`: none of these, with the reason; "ambiguous" when more than one link fits (a graph
  never joins wrongly).

Each call also gets a purpose: `aux` for a call to another model than the session's policy
model (the model most of its calls outside branches ask for) that nothing links to the work
(a harness's small fast model writing titles or checking topics), or for a lone one-turn
conversation without tools in a session whose calls offer them, that no call continues or starts
from (Claude Code 2.1.197 writes a session's title so, on the main model), else `train`. A subagent's
or compaction's branch is `train` whatever model it asks (Claude Code runs a subagent on the
model its Agent call names), and a chain keeps its first call's purpose. `aux` calls are
placed and exported, never trained by default.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from recorder.records import CallRecord
from recorder.trajectories import build_sequences

Edge = Literal["continue", "fork", "retry", "subagent", "compaction", "new"]
Purpose = Literal["train", "aux"]
EDGES: tuple[Edge, ...] = ("continue", "fork", "retry", "subagent", "compaction", "new")
TRANSPORT = ("stream", "stream_options", "metadata", "user", "store")  # how a call is sent, not what it asks
MIN_LINK_TEXT = 24  # characters a text must have to link two calls (short ones match by chance)


@dataclass(frozen=True)
class Placement:
    seq: int
    root: int  # the first call of the sequence this call belongs to
    parent: int | None  # the call it continues, re-sends, serves or starts from
    edge: Edge
    reason: str | None  # why a `new` call is new; what links a subagent (the argument) or compaction (the summary)
    purpose: Purpose
    trained: bool  # train purpose, and not the untrained one of a retry pair


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list):
        return "\n".join(t for t in (_text(p.get("text") if isinstance(p, dict) else p) for p in content) if t)
    return ""


def conversation(request: dict[str, Any]) -> list[tuple[str, str]]:
    """(role, text) of a request's messages in any of the APIs: Chat and Messages `messages`
    (with Messages' top-level `system`), Responses `instructions` and `input`."""
    found = [("system", _text(request.get("system")))] if request.get("system") else []
    if request.get("instructions"):
        found.append(("system", _text(request["instructions"])))
    items = request.get("messages") or request.get("input") or []
    if isinstance(items, str):
        return [*found, ("user", items.strip())]
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict) and item.get("role"):
            found.append((str(item["role"]), _text(item.get("content"))))
    return found


def _answers(call: CallRecord) -> list[dict[str, Any]]:
    return [a.get("message") or {} for a in (call.thread or {}).get("answers") or [] if isinstance(a, dict)]


def _string_arguments(call: CallRecord) -> set[str]:
    """The string values of the arguments of the tool calls this call sampled."""
    found: set[str] = set()
    for message in _answers(call):
        for tool_call in message.get("tool_calls") or []:
            arguments = (tool_call.get("function") or {}).get("arguments")
            try:
                parsed = orjson.loads(arguments) if isinstance(arguments, str) else arguments
            except orjson.JSONDecodeError:
                continue
            values = parsed.values() if isinstance(parsed, dict) else []
            found |= {v.strip() for v in values if isinstance(v, str) and len(v.strip()) >= MIN_LINK_TEXT}
    return found


def first_user_parts(request: dict[str, Any]) -> set[str]:
    """The text parts of a request's first user message, each alone: Claude Code starts a
    subagent's conversation with reminders in parts of their own, then the Agent call's prompt."""
    items = request.get("messages") or request.get("input") or []
    if isinstance(items, str):
        return {items.strip()}
    first = (
        next((m for m in items if isinstance(m, dict) and m.get("role") == "user"), {})
        if isinstance(items, list)
        else {}
    )
    content = first.get("content")
    parts = content if isinstance(content, list) else [content]
    return {text for text in (_text(p.get("text") if isinstance(p, dict) else p) for p in parts) if text}


def _sampled_texts(call: CallRecord, said: list[tuple[str, str]]) -> list[str]:
    """What the call wrote that could be a summary: its answers' texts, but none it copied from its
    own prompt (`said`; SmolLM2 in Claude Code repeated "Today's date is ...", which every later
    conversation's reminders carry)."""
    prompt = "\n".join(text for _, text in said)
    texts = (_text(m.get("content")) for m in _answers(call))
    return [t for t in texts if len(t) >= MIN_LINK_TEXT and t not in prompt]


def policy_model(calls: list[CallRecord]) -> str | None:
    """The model most of the session's calls ask for (the earliest of those tied)."""
    counts = Counter(c.model for c in calls)
    return max(counts, key=lambda m: (counts[m], -next(i for i, c in enumerate(calls) if c.model == m)), default=None)


@dataclass(frozen=True)
class _Facts:
    """What placing needs of a call, read once (placing compares every call with the earlier ones)."""

    asked: bytes  # digest of its request (_asked)
    messages: list[str] | None  # its thread's message digests
    arguments: set[str]  # string arguments of the tool calls it sampled
    texts: list[str]  # the texts it sampled
    said: list[tuple[str, str]]  # its conversation (`conversation`)


def _facts(call: CallRecord) -> _Facts:
    asked = {k: v for k, v in call.request.items() if k not in TRANSPORT}
    digest = hashlib.blake2b(orjson.dumps(asked, option=orjson.OPT_SORT_KEYS), digest_size=16).digest()
    said = conversation(call.request)
    messages = (call.thread or {}).get("messages")
    return _Facts(digest, messages, _string_arguments(call), _sampled_texts(call, said), said)


def place(calls: list[CallRecord]) -> list[Placement]:
    """Every call of one session placed, in call order."""
    ordered = sorted(calls, key=lambda c: c.seq)
    facts = {c.seq: _facts(c) for c in ordered}
    links = {c.seq: _link(c, ordered[:i], facts) for i, c in enumerate(ordered)}
    # A branch (a subagent's or compaction's, and what continues it) serves the work it is linked
    # to, whatever model it asks: Claude Code runs a subagent on the model its Agent call names.
    # So the policy model is the one the calls outside branches ask for most.
    branch: dict[int, bool] = {}
    for seq, (edge, parent, _) in links.items():
        branch[seq] = edge in ("subagent", "compaction") or (parent is not None and branch.get(parent, False))
    policy = policy_model([c for c in ordered if not branch[c.seq]])
    # A side call on the policy model itself (Claude Code's title, written before its main loop):
    # a lone one-turn conversation without tools in a session whose other calls offer them, that
    # no call continues or starts from (a harness's last turn sent without tools has turns before).
    parents = {parent for edge, parent, _ in links.values() if edge != "retry"}
    with_tools = any(c.request.get("tools") for c in ordered)
    placed: dict[int, Placement] = {}
    for call in ordered:
        edge, parent, reason = links[call.seq]
        one_turn = all(role in ("system", "user") for role, _ in facts[call.seq].said)
        aside = edge == "new" and with_tools and one_turn and not call.request.get("tools") and call.seq not in parents
        purpose: Purpose = "train" if branch[call.seq] or (call.model == policy and not aside) else "aux"
        if edge in ("continue", "fork", "retry") and parent in placed:  # a chain keeps its first call's purpose
            purpose = placed[parent].purpose
        root = placed[parent].root if edge == "continue" and parent in placed else call.seq
        placed[call.seq] = Placement(call.seq, root, parent, edge, reason, purpose, purpose == "train")
    return _resolve_retries(list(placed.values()))


def _link(call: CallRecord, earlier: list[CallRecord], facts: dict[int, _Facts]) -> tuple[Edge, int | None, str | None]:
    mine = facts[call.seq]
    # First: a re-send continues whatever the original continued, so token-in joins it as a fork.
    same = [c for c in earlier if facts[c.seq].asked == mine.asked and _same_prompt(c, call)]
    if same:
        return "retry", same[-1].seq, None
    continued = (call.thread or {}).get("continues") or {}
    by_id = {c.call_id: c.seq for c in earlier}
    fork = (call.thread_start or "").startswith("a fork")
    if call.token_in and continued.get("call") in by_id:  # what the proxy planned it on
        return ("fork" if fork else "continue"), by_id[continued["call"]], None
    if call.token_in and mine.messages:  # recorded before the proxy said (schema 9's first records)
        # the longest earlier conversation this one extends by the answer and more
        parents = [
            c
            for c in earlier
            if (theirs := facts[c.seq].messages)
            and len(theirs) < len(mine.messages)
            and mine.messages[: len(theirs)] == theirs
        ]
        if parents:
            parent = max(parents, key=lambda c: (len(facts[c.seq].messages or []), c.seq))
            return ("fork" if fork else "continue"), parent.seq, None
    # A prompt that is an earlier call's tokens and more: one sequence, as trajectories merge it.
    # Those calls are a chain, each extending the one before: the latest is the longest.
    extended = next((c for c in reversed(earlier) if c.completions and _extends(call, c)), None)
    if extended is not None:
        return "continue", extended.seq, None
    links: list[tuple[Edge, int, str]] = []
    first_user = first_user_parts(call.request)
    carried = [text for role, text in mine.said[:3] if role != "assistant"]
    for before in reversed(earlier):
        if served := first_user & facts[before.seq].arguments:
            links.append(("subagent", before.seq, min(served)))
            break
    for before in reversed(earlier):
        if summary := next((t for t in facts[before.seq].texts if any(t in text for text in carried)), None):
            links.append(("compaction", before.seq, summary))
            break
    if len(links) == 1:
        return links[0]
    if links:
        return "new", None, "ambiguous: " + " or ".join(f"{edge} of call {seq}" for edge, seq, _ in links)
    return "new", None, call.thread_start or ("no link to an earlier call" if earlier else "first call of the session")


def _same_prompt(a: CallRecord, b: CallRecord) -> bool:
    """Whether two calls had one prompt, as far as their records say (a re-send gets the one its
    original got; a call that failed before the upstream answered has none)."""
    return not a.prompt_token_ids or not b.prompt_token_ids or a.prompt_token_ids == b.prompt_token_ids


def _extends(call: CallRecord, before: CallRecord) -> bool:
    """Whether a call's prompt is an earlier call's prompt and answer, and more (its answer
    compared first: the short test that fails for most pairs)."""
    prompt, answer, ids = before.prompt_token_ids, before.completions[0].token_ids, call.prompt_token_ids
    end = len(prompt) + len(answer)
    return bool(prompt) and len(ids) > end and ids[len(prompt) : end] == answer and ids[: len(prompt)] == prompt


def _resolve_retries(placements: list[Placement]) -> list[Placement]:
    """Of a call and its retry, keep training the one a later call continued (or forked); if
    neither was, the retry."""
    continued = {p.parent for p in placements if p.edge in ("continue", "fork")}
    by_seq = {p.seq: p for p in placements}
    for p in placements:
        if p.edge != "retry" or p.parent is None:
            continue
        original = by_seq[p.parent]
        keep_original = original.seq in continued and p.seq not in continued
        drop = p if keep_original else original
        by_seq[drop.seq] = Placement(
            drop.seq, drop.root, drop.parent, drop.edge, drop.reason, drop.purpose, trained=False
        )
    return [by_seq[p.seq] for p in placements]


@dataclass(frozen=True)
class Branch:
    """A sequence of the graph: its calls (a `continue` chain from its first), how its first call
    attached (edge, parent call, reason), and the branches whose parent call is one of its calls."""

    first: Placement
    calls: list[int]
    children: list[Branch]


def branches(placements: list[Placement]) -> list[Branch]:
    """The session as a tree of sequences: those with no parent at the top, each other under the
    sequence holding its parent call (a subagent under the call of its Agent tool, a compaction
    under its summary's, a fork or retry under what it re-sent)."""
    chains: dict[int, list[int]] = {}
    for p in placements:
        chains.setdefault(p.root, []).append(p.seq)
    root_of = {p.seq: p.root for p in placements}
    children: dict[int | None, list[int]] = {}
    for p in placements:
        if p.root == p.seq:
            children.setdefault(root_of.get(p.parent) if p.parent is not None else None, []).append(p.seq)
    by_seq = {p.seq: p for p in placements}

    def grow(root: int) -> Branch:
        return Branch(by_seq[root], chains[root], [grow(r) for r in children.get(root, [])])

    return [grow(root) for root in children.get(None, [])]


def edge_counts(placements: list[Placement]) -> dict[str, int]:
    counts = Counter(p.edge for p in placements)
    return {edge: counts.get(edge, 0) for edge in EDGES} | {"aux": sum(p.purpose == "aux" for p in placements)}


def delivery(calls: list[CallRecord], placements: list[Placement]) -> tuple[int, int, int]:
    """(sampled tokens that reach a training sequence, sampled tokens of the calls placed to be
    trained, those in the longest sequence alone): what the capture lost of what should be
    trained (failed or skipped calls, ids missing), and what keeping one chain per episode (as
    NeMo Gym's capture and verl's keep-the-longest do) would deliver. Aux calls and the
    untrained one of a retry pair are in none."""
    trained = {p.seq for p in placements if p.trained}
    kept = [c for c in calls if c.seq in trained]
    sampled = sum(len(choice.token_ids) for c in kept for choice in c.completions)
    reached = [s.sampled_tokens for s in build_sequences(kept).sequences]
    return sum(reached), sampled, max(reached, default=0)
