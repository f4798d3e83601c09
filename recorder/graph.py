"""A session as a graph: where each recorded call belongs, why, and what of it is trained.

This is the one place that decides which tokens are trained: `build` places a session's calls
and builds its training sequences from the ids of the calls placed to be trained, and nothing
else; the trainer, the exports, the viewer, `would_train` and the capture grades all take them
from there.

A harness session is not one thread. Token-in joins a call to the one whose answer it continues
(`continue`, or `fork` for a second call continuing the same answer); anything else starts a new
sequence, and it is placed here by what links it to the calls before it, read from the records
alone (so it works on any store, whatever proxy served the calls):

- `retry`: the same request as an earlier call, and the same prompt ids where both have them
  (the same conversation, tools and settings, no new message), unless a later call continued
  both (a deliberate repeat: the same subagent prompt before and after a fix). Of a set of equal
  requests only those a later call continued are trained (best of 3: the answers thrown away are
  not); if none was, the last (an SDK's retry after a timeout: the first answer never reached
  the harness, or it failed, 499 or 5xx).
- `subagent`: a new conversation whose first user message (or a text part of it) is a string
  argument of a tool call sampled earlier in the session (Claude Code's Agent tool and its
  like), however short (a whole part equal to a whole argument is no chance: SmolLM2 asked its
  subagent "What to do?"): linked to that call.
- `compaction`: a new conversation whose first messages carry an answer sampled earlier (the
  summary, or of one with a <summary> block that block's text, which is all Claude Code carries
  on; not one the model copied from its own prompt), linked to the call that sampled it.
  When the subagent and the compaction rule point at the same call (an Agent prompt quoting
  the answer's text), it is a subagent.
- `new`: none of these, with the reason; "ambiguous" when links to different calls fit (a graph
  never joins wrongly).

Each call also gets a purpose. A linked call (continue, fork, retry, subagent, compaction) has
the purpose of the call it is linked to, whatever model it asks for (Claude Code runs a
subagent on the model its Agent call names). An unlinked call is `aux` when the session names
its policy model (`SessionInfo.policy_model`: the admin API's, or the key's `model=`) and it
asks for another (a harness's small fast model writing titles or checking topics), or when it is
a side call by what it is: a lone one-turn conversation without tools in a session whose calls
offer them, that no call continues or starts from (Claude Code 2.1.197 writes a session's title
so, on the main model); else `train`. Never a vote by how many calls each model name has.
`aux` calls are placed and exported, never trained.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Literal

import orjson

from recorder.echo import echoes, norm
from recorder.records import CallRecord, SessionInfo
from recorder.trajectories import SessionReport, assemble, skip_reason

Edge = Literal["continue", "fork", "retry", "subagent", "compaction", "new"]
Purpose = Literal["train", "aux"]
EDGES: tuple[Edge, ...] = ("continue", "fork", "retry", "subagent", "compaction", "new")
TRANSPORT = ("stream", "stream_options", "metadata", "user", "store")  # how a call is sent, not what it asks
MIN_LINK_TEXT = 24  # characters a summary must have to link two calls (short ones are found again by chance)


@dataclass(frozen=True)
class Placement:
    seq: int
    root: int  # the first call of the sequence this call belongs to
    parent: int | None  # the call it continues, re-sends, serves or starts from
    edge: Edge
    reason: str | None  # why a `new` call is new; what links a subagent (the argument) or compaction (the summary)
    purpose: Purpose
    trained: bool  # train purpose, and not the untrained one of a retry pair
    choice: int = 0  # which of its choices (n > 1) its sequence goes on with: the others are set aside


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
            found |= {v.strip() for v in values if isinstance(v, str) and v.strip()}
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


SUMMARY_BLOCK = re.compile(r"<summary>(.*?)</summary>", re.DOTALL)


def _carried(text: str) -> str:
    """What a harness carries on of an answer: the whole text, or of one with a <summary> block
    (Claude Code's compactions ask for one) the block's text alone, trimmed, blank lines
    collapsed, as Claude Code puts it after "Summary:"."""
    block = SUMMARY_BLOCK.search(text)
    return re.sub(r"\n\n+", "\n\n", block.group(1).strip()) if block else text


def _sampled_texts(call: CallRecord, said: list[tuple[str, str]]) -> list[str]:
    """What the call wrote that could be a summary: its answers' texts as carried on, but none it
    copied from its own prompt (`said`; SmolLM2 in Claude Code repeated "Today's date is ...",
    which every later conversation's reminders carry)."""
    answers = (_carried(_text(m.get("content"))) for m in _answers(call))
    texts = [t for t in answers if len(t) >= MIN_LINK_TEXT]
    prompt = "\n".join(text for _, text in said) if texts else ""
    return [t for t in texts if t not in prompt]


@dataclass(frozen=True)
class _Facts:
    """What placing needs of a call, read once."""

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


Link = tuple[Edge, int | None, str | None]


class _Earlier:
    """The calls placed so far, indexed for the links a later call may have (so that placing a
    session is linear in its calls, not quadratic: 2,000 calls are an ordinary Claude Code day)."""

    def __init__(self) -> None:
        self.calls: list[CallRecord] = []
        self.facts: dict[int, _Facts] = {}
        self.by_id: dict[str, int] = {}
        self.by_request: dict[bytes, list[CallRecord]] = {}
        self.by_argument: dict[str, int] = {}  # a tool call's string argument: the latest call that sampled it

    def add(self, call: CallRecord, facts: _Facts) -> None:
        self.calls.append(call)
        self.facts[call.seq] = facts
        if call.call_id is not None:
            self.by_id[call.call_id] = call.seq
        self.by_request.setdefault(facts.asked, []).append(call)
        self.by_argument |= dict.fromkeys(facts.arguments, call.seq)


def place(calls: list[CallRecord], policy: str | None = None) -> list[Placement]:
    """Every call of one session placed, in call order. `policy` is the model name the session's
    own work asks for (`SessionInfo.policy_model`), if the session names it."""
    ordered = sorted(calls, key=lambda c: c.seq)
    earlier = _Earlier()
    links: dict[int, Link] = {}
    joins: dict[int, int] = {}  # the call each continues (or forks from), as first linked
    same: dict[int, list[CallRecord]] = {}  # earlier calls of the same request and prompt
    for call in ordered:
        facts = _facts(call)
        links[call.seq] = _link(call, facts, earlier)
        if links[call.seq][0] in ("continue", "fork"):
            joins[call.seq] = links[call.seq][1]  # type: ignore[assignment]
        same[call.seq] = [c for c in earlier.by_request.get(facts.asked, []) if _same_prompt(c, call)]
        earlier.add(call, facts)
    continued = {parent for edge, parent, _ in links.values() if edge in ("continue", "fork")}
    # Equal requests: each a retry of the one before, unless the harness went on with both (a
    # deliberate repeat, linked as any call). Of a set, the ones a later call continued are
    # trained; if none was, the last (its original's answer never reached the harness, a guess).
    first: dict[int, int] = {}
    for call in ordered:
        repeats = same[call.seq]
        first[call.seq] = first[repeats[0].seq] if repeats else call.seq
        if repeats and not {repeats[-1].seq, call.seq} <= continued:
            links[call.seq] = ("retry", repeats[-1].seq, None)
    sets: dict[int, list[int]] = {}
    for seq, head in first.items():
        sets.setdefault(head, []).append(seq)
    dropped = {
        seq
        for members in sets.values()
        for seq in members
        if seq not in ([m for m in members if m in continued] or members[-1:])
    }
    # A side call by what it is: a lone one-turn conversation without tools in a session whose
    # calls offer them, that no call continues or starts from (a harness's title, written on the
    # policy model itself by Claude Code 2.1.197; a last turn sent without tools has turns before).
    parents = {parent for edge, parent, _ in links.values() if edge != "retry"}
    with_tools = any(c.request.get("tools") for c in ordered)
    # Chains: a call extends the chain of the call it continues when that call is the chain's
    # last so far (a second call continuing the same answer forks), both are trained or both set
    # aside, and they ask for one model (`_joins`); the choice it continues is the one the chain
    # goes on with.
    by_seq = {c.seq: c for c in ordered}
    placed: dict[int, Placement] = {}
    last: dict[int, int] = {}  # a chain's first call -> its last so far
    went_on: dict[int, int] = {}  # a call -> the choice its chain goes on with
    for call in ordered:
        edge, parent, reason = links[call.seq]
        if parent is not None and parent in placed:  # a branch trains with what links it, whatever its model
            purpose = placed[parent].purpose
        else:
            one_turn = all(role in ("system", "user") for role, _ in earlier.facts[call.seq].said)
            aside = with_tools and one_turn and not call.request.get("tools") and call.seq not in parents
            other = policy is not None and call.model != policy
            purpose = "aux" if aside or other else "train"
        trained = purpose == "train" and call.seq not in dropped
        root, up = call.seq, joins.get(call.seq)
        if up is not None and up in placed and last.get(placed[up].root) == up:
            choice = _joins(call, by_seq[up], placed[up].trained == trained)
            if choice is not None:
                root, went_on[up] = placed[up].root, choice
                edge = "continue" if edge == "fork" else edge  # the answer's first continuation that counts
        elif edge == "continue":
            edge = "fork"  # the chain went on from its answer already
        last[root] = call.seq
        placed[call.seq] = Placement(call.seq, root, parent, edge, reason, purpose, trained)
    for seq, placement in placed.items():  # a chain's last call: the choice a later call echoes, else the first
        call = by_seq[seq]
        if seq not in went_on and len(call.completions) > 1:
            went_on[seq] = went_on_with(call, [c for c in ordered if c.seq > seq]) or 0
        placed[seq] = replace(placement, choice=went_on.get(seq, 0))
    return list(placed.values())


def _link(call: CallRecord, mine: _Facts, earlier: _Earlier) -> Link:
    continued = (call.thread or {}).get("continues") or {}
    fork = (call.thread_start or "").startswith("a fork")
    if call.token_in and continued.get("call") in earlier.by_id:  # what the proxy planned it on
        return ("fork" if fork else "continue"), earlier.by_id[continued["call"]], None
    if call.token_in and mine.messages:  # recorded before the proxy said (schema 9's first records)
        # the longest earlier conversation this one extends by the answer and more
        parents = [
            c
            for c in earlier.calls
            if (theirs := earlier.facts[c.seq].messages)
            and len(theirs) < len(mine.messages)
            and mine.messages[: len(theirs)] == theirs
        ]
        if parents:
            parent = max(parents, key=lambda c: (len(earlier.facts[c.seq].messages or []), c.seq))
            return ("fork" if fork else "continue"), parent.seq, None
    # A prompt that is an earlier call's tokens and more: one sequence, as trajectories merge it.
    # Those calls are a chain, each extending the one before: the latest is the longest.
    if call.prompt_token_ids:
        extended = next((c for c in reversed(earlier.calls) if _extended(call, c) is not None), None)
        if extended is not None:
            return "continue", extended.seq, None
    links: list[tuple[Edge, int, str]] = []
    served = sorted(p for p in first_user_parts(call.request) if p in earlier.by_argument)
    if served:  # the latest call whose tool call carried it
        argument = max(served, key=lambda p: earlier.by_argument[p])
        links.append(("subagent", earlier.by_argument[argument], argument))
    carried = [text for role, text in mine.said[:3] if role != "assistant"]
    for before in reversed(earlier.calls):
        if summary := next((t for t in earlier.facts[before.seq].texts if any(t in text for text in carried)), None):
            links.append(("compaction", before.seq, summary))
            break
    if len(links) == 2 and links[0][1] == links[1][1]:  # a subagent's prompt that carries its parent's text
        links = links[:1]
    if len(links) == 1:
        return links[0]
    if links:
        return "new", None, "ambiguous: " + " or ".join(f"{edge} of call {seq}" for edge, seq, _ in links)
    return (
        "new",
        None,
        call.thread_start or ("no link to an earlier call" if earlier.calls else "first call of the session"),
    )


def _same_prompt(a: CallRecord, b: CallRecord) -> bool:
    """Whether two calls had one prompt, as far as their records say (a re-send gets the one its
    original got; a call that failed before the upstream answered has none)."""
    return not a.prompt_token_ids or not b.prompt_token_ids or a.prompt_token_ids == b.prompt_token_ids


def _extended(call: CallRecord, before: CallRecord) -> int | None:
    """Which choice of an earlier call a call's prompt is that call's prompt and that choice's
    sampled tokens, and more, if one is (each answer compared first: the short test that fails
    for most pairs)."""
    prompt, ids = before.prompt_token_ids, call.prompt_token_ids
    if not prompt:
        return None
    for completion in before.completions:
        answer, end = completion.token_ids, len(prompt) + len(completion.token_ids)
        if len(ids) > end and ids[len(prompt) : end] == answer and ids[: len(prompt)] == prompt:
            return completion.index
    return None


def _joins(call: CallRecord, before: CallRecord, alike: bool) -> int | None:
    """The choice of `before` whose chain `call` extends, if it can: it has tokens to train (a
    failed call never ends a chain: the harness's retry continues the answer before it), both
    are trained or both set aside (`alike`), they ask for one model. The choice is the one
    token-in continued, else the one its prompt extends, else the first."""
    if not alike or skip_reason(call) is not None or call.request.get("model") != before.request.get("model"):
        return None
    continued = (call.thread or {}).get("continues") or {}
    if call.token_in and continued.get("call") == before.call_id and before.call_id is not None:
        return int(continued.get("choice") or 0)
    return _extended(call, before) or 0


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


@dataclass(frozen=True)
class SessionGraph:
    """A session placed, and what is trained of it: the one place that decides it. `trained` is
    assembled from the chains of the calls placed to be trained (each placement's `root` and
    `choice`) and nothing else; `aside` from the others' (aux calls, the untrained one of a
    retry pair) and the choices of an n > 1 call that the episode did not go on with, for the
    exports and the viewer."""

    placements: list[Placement]
    trained: SessionReport
    aside: SessionReport
    policy: str | None  # the policy model, if the session names it

    @property
    def trained_calls(self) -> set[int]:
        return {p.seq for p in self.placements if p.trained}


def _chains(calls: list[CallRecord], placements: list[Placement]) -> list[tuple[CallRecord, int, int]]:
    by_seq = {c.seq: c for c in calls}
    return [(by_seq[p.seq], p.root, p.choice) for p in placements]


def build(
    calls: list[CallRecord],
    session: SessionInfo | None = None,
    call_rewards: dict[int, float] | None = None,
    merge: bool = True,
) -> SessionGraph:
    """A session's graph and its sequences, assembled from the placements' chains and choices
    (`merge=False`: one sequence per call)."""
    policy = session.policy_model if session else None
    placements = place(calls, policy)
    chains = list(zip(_chains(calls, placements), placements, strict=True))
    trained, thrown = assemble([c for c, p in chains if p.trained], session, call_rewards, merge)
    aside, also = assemble([c for c, p in chains if not p.trained], session, call_rewards, merge)
    numbered = [replace(q, chain=len(trained.sequences) + i) for i, q in enumerate([*thrown, *aside.sequences, *also])]
    return SessionGraph(placements, trained, replace(aside, sequences=numbered), policy)


def build_sequences(
    calls: list[CallRecord],
    session: SessionInfo | None = None,
    merge: bool = True,
    call_rewards: dict[int, float] | None = None,
) -> SessionReport:
    """Every sequence of a session in one report, trained or set aside (aux calls, a superseded
    retry, the choices not gone on with), in the order of their calls and choices: what `build` makes
    of the calls, for a merge report of any list of calls."""
    placements = place(calls, session.policy_model if session else None)
    report, others = assemble(_chains(calls, placements), session, call_rewards, merge)
    ordered = sorted([*report.sequences, *others], key=lambda q: [(span.seq, span.choice) for span in q.spans])
    return replace(report, sequences=[replace(q, chain=i) for i, q in enumerate(ordered)])


def went_on_with(call: CallRecord, later: list[CallRecord]) -> int | None:
    """Which of a Chat Completions call's choices the first later call that extends its messages
    echoes back as the next message (compared as token-in compares an echo), if one does."""
    asked = call.request.get("messages")
    answers = [c for c in (call.response or {}).get("choices") or [] if isinstance(c, dict)]
    if not isinstance(asked, list):
        return None
    for other in later:
        messages = other.request.get("messages")
        if isinstance(messages, list) and len(messages) > len(asked) and messages[: len(asked)] == asked:
            echo = messages[len(asked)]
            for answer in answers:
                message = answer.get("message")
                if isinstance(echo, dict) and isinstance(message, dict) and echoes(norm(echo), norm(message)):
                    return int(answer.get("index", 0))
            return None
    return None


def delivery(calls: list[CallRecord], graph: SessionGraph) -> tuple[int, int, int]:
    """(sampled tokens that reach a training sequence, sampled tokens of the calls placed to be
    trained, those in the longest sequence alone): what the capture lost of what should be
    trained (failed or skipped calls, ids missing), and what keeping one chain per episode (as
    NeMo Gym's capture and verl's keep-the-longest do) would deliver. Aux calls and the
    untrained one of a retry pair are in none; of an n > 1 call's choices, the one trained (the
    first, if none reached a sequence)."""
    trained = graph.trained_calls
    chosen = {(span.seq, span.choice) for q in graph.trained.sequences for span in q.spans}

    def meant(call: CallRecord) -> int:
        picked = [c for c in call.completions if (call.seq, c.index) in chosen] or call.completions[:1]
        return sum(len(c.token_ids) for c in picked)

    sampled = sum(meant(c) for c in calls if c.seq in trained)
    reached = [s.sampled_tokens for s in graph.trained.sequences]
    return sum(reached), sampled, max(reached, default=0)
