"""The session graph (recorder/graph.py) on hand-built records of a Claude Code-like session: a
subagent started by a tool call, a side call to a small model, a retry whose re-send the
harness went on with, a compaction summary, and a conversation with no link."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson

from benchmarks.support.samples import call
from recorder import CallRecord, Completion, SessionInfo
from recorder.graph import branches, build, delivery, edge_counts, place
from recorder.validation import Grade, check

PROMPT = "Search the repository for the failing test and report its name."
SUMMARY = "So far: the failing test is test_parse, broken by the new date format."
SESSION = SessionInfo(id="s", key="k", policy_model="policy")  # the runner named the policy model


def node(
    seq: int,
    digests: list[str],
    ask: str | None = None,
    answer: str = "",
    task: str | None = None,
    continues: int | None = None,
    model: str = "policy",
    why: str | None = None,
) -> CallRecord:
    message: dict[str, Any] = {"role": "assistant", "content": answer}
    if task is not None:
        arguments = orjson.dumps({"description": "find it", "prompt": task}).decode()
        message["tool_calls"] = [{"id": "t1", "type": "function", "function": {"name": "Task", "arguments": arguments}}]
    thread: dict[str, Any] = {"messages": digests, "tools": "t0", "answers": [{"message": message}]}
    if continues is not None:
        thread["continues"] = {"call": f"c{continues}", "choice": 0}
    # the request grows with the conversation (a message a digest here): equal digests, equal requests
    later = [{"role": "user", "content": d} for d in digests[1:]]
    return replace(
        call("s", seq, [seq]),
        prompt_token_ids=[sum(map(ord, d)) for d in digests],  # equal digests, equal prompts
        call_id=f"c{seq}",
        model=model,
        token_in=continues is not None,
        thread=thread,
        thread_start=why,
        request={"messages": [{"role": "user", "content": ask or f"ask {digests[0]}"}, *later]},
    )


def token_in(calls: list[CallRecord]) -> list[CallRecord]:
    """The calls with prompt ids as token-in makes them: a call that continues another's answer
    starts with that call's prompt and answer ids (equal requests keep equal prompts)."""
    by_id: dict[str, CallRecord] = {}
    made = []
    for c in calls:
        parent = by_id.get(((c.thread or {}).get("continues") or {}).get("call", ""))
        if parent is not None:
            c = replace(
                c,
                prompt_token_ids=[
                    *parent.prompt_token_ids,
                    *parent.completions[0].token_ids,
                    900 + len((c.thread or {})["messages"]),
                ],
            )
        by_id.setdefault(str(c.call_id), c)
        made.append(c)
    return made


def test_a_session_with_a_subagent_a_side_call_a_retry_and_a_compaction() -> None:
    calls = [
        node(1, ["a"], "Fix the failing test.", task=PROMPT, why="first call of the session seen by this proxy"),
        node(2, ["z"], "Write a title for: Fix the failing test.", answer="Fixing a test", model="small-fast"),
        node(3, ["p"], PROMPT, answer="It is test_parse."),
        node(4, ["p", "a3", "t3"], continues=3),
        node(5, ["a", "a1", "r1"], continues=1),
        node(6, ["a", "a1", "r1"], continues=1, why="a fork: call 5 continued this answer first"),  # the SDK re-sent it
        node(7, ["a", "a1", "r1", "a6", "u"], answer=SUMMARY, continues=6),
        node(8, ["s"], f"This session continues from an earlier one. {SUMMARY}"),
        node(9, ["q"], "Something else entirely.", why="the conversation is not a continuation of an earlier call's"),
    ]
    placed = {p.seq: p for p in place(calls, policy="policy")}
    got = {seq: (p.edge, p.parent, p.root) for seq, p in placed.items()}
    assert got == {
        1: ("new", None, 1),
        2: ("new", None, 2),
        3: ("subagent", 1, 3),
        4: ("continue", 3, 3),
        # The re-send takes the original's place in call 1's sequence; the original, not trained,
        # is a sequence of its own (the graph decides the chains: build assembles them as placed).
        5: ("continue", 1, 5),
        6: ("retry", 5, 1),
        7: ("continue", 6, 1),
        8: ("compaction", 7, 8),
        9: ("new", None, 9),
    }
    assert placed[9].reason == "the conversation is not a continuation of an earlier call's"
    assert [p.seq for p in placed.values() if p.purpose == "aux"] == [2]
    # The harness went on with the re-send (call 7 continued it): the original is not trained.
    assert [p.seq for p in placed.values() if not p.trained] == [2, 5]
    assert edge_counts(list(placed.values())) == {
        "continue": 3,
        "fork": 0,
        "retry": 1,
        "subagent": 1,
        "compaction": 1,
        "new": 3,
        "aux": 1,
    }


def test_a_retry_nobody_continued_trains_the_re_send_and_one_continued_keeps_the_original() -> None:
    first = [node(1, ["a"]), node(2, ["a", "b", "c"], continues=1), node(3, ["a", "b", "c"], continues=1)]
    assert [p.trained for p in place(first)] == [True, False, True]
    went_on = [*first, node(4, ["a", "b", "c", "d", "e"], continues=2)]
    assert [p.trained for p in place(went_on)] == [True, True, False, True]


def test_a_claude_code_subagent_on_another_model_is_linked_and_trained() -> None:
    """As a real Claude Code 2.1.197 sends it: the subagent's first user message holds reminders
    in parts of their own and then the Agent call's prompt, and the subagent runs on the model
    that call named (`"model": "opus"`). It is linked by the part, and trained with its chain;
    a call to that model that nothing links to stays aside."""
    parts = [{"type": "text", "text": "<system-reminder>\nYou can use these skills.</system-reminder>"}]
    subagent = node(2, ["p"], model="opus")
    subagent = replace(
        subagent, request={"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": PROMPT}]}]}
    )
    calls = [
        node(1, ["a"], "Fix the failing test.", task=PROMPT),
        subagent,
        node(3, ["p", "a2", "t2"], continues=2, model="opus"),
        node(4, ["a", "a1", "r1"], continues=1),
        node(5, ["z"], "Write a title.", model="opus"),
    ]
    got = [(p.edge, p.parent, p.purpose) for p in place(calls, policy="policy")]
    assert got == [
        ("new", None, "train"),
        ("subagent", 1, "train"),
        ("continue", 2, "train"),
        ("continue", 1, "train"),
        ("new", None, "aux"),
    ]


def test_a_lone_call_without_tools_in_a_session_with_tools_is_aux() -> None:
    """Claude Code 2.1.197 first asks the main model for a title, without tools; a summary
    without tools that a later conversation starts from is trained."""
    title = replace(node(1, ["t"], "Write the title for: Say hello.", answer="Hello"), request={"messages": []})
    calls = [title, *(replace(c, request={**c.request, "tools": [{"name": "Bash"}]}) for c in (node(2, ["a"]),))]
    summary = replace(node(3, ["b"], "Summarize.", answer=SUMMARY), request={"messages": []})
    calls += [summary, node(4, ["s"], f"This session continues from an earlier one. {SUMMARY}")]
    assert [p.purpose for p in place(calls)] == ["aux", "train", "train", "train"]
    # a last turn sent without tools has turns before it: trained; a re-sent title stays aside
    turns = [{"role": "user", "content": "Fix it."}, {"role": "assistant", "content": "Done."}]
    last = replace(node(5, ["l"], answer="All fixed."), request={"messages": turns})
    retried = replace(title, seq=6, call_id="c6", thread={**(title.thread or {}), "continues": None})
    assert [(p.edge, p.purpose) for p in place([*calls, last, retried])][4:] == [("new", "train"), ("retry", "aux")]


def test_two_links_that_both_fit_join_nothing_and_say_so() -> None:
    """A first message that is both a tool call's argument and an earlier answer's text."""
    calls = [node(1, ["a"], task=SUMMARY), node(2, ["b"], answer=SUMMARY), node(3, ["c"], SUMMARY)]
    third = place(calls)[2]
    assert (third.edge, third.parent) == ("new", None)
    assert third.reason == "ambiguous: subagent of call 1 or compaction of call 2"


def test_short_texts_link_nothing() -> None:
    """A two-word answer found again in a later message is chance, not a summary."""
    calls = [node(1, ["a"], answer="Done."), node(2, ["b"], "Done. Next task?"), node(3, ["c"], task="go")]
    assert [p.edge for p in place(calls)] == ["new", "new", "new"]


def test_delivery_is_what_the_trained_calls_sampled_that_reaches_a_sequence() -> None:
    """A failed call's tokens are lost to training; an aux call's and a superseded retry's are
    not meant for it."""
    failed = replace(node(3, ["x"]), ok=False, http_status=502, error="upstream died")
    calls = [node(1, ["a"]), node(2, ["a", "b", "c"], continues=1), failed, node(4, ["z"], model="small-fast")]
    assert delivery(calls, build(calls, SESSION)) == (2, 3, 1)
    retried = [node(1, ["a"]), node(2, ["a", "b", "c"], continues=1), node(3, ["a", "b", "c"], continues=1)]
    assert delivery(retried, build(retried, SESSION)) == (2, 2, 1)  # two sequences here: one chain keeps half


def test_capture_grades() -> None:
    """FATAL for records that cannot be trained on as they are, WARN for tokens lost or spent
    aside, INFO for sequences started with their reasons."""
    clean = [node(1, ["a"]), node(2, ["a", "b", "c"], continues=1)]
    assert check(clean).grade == Grade("OK")
    assert check(clean, min_calls=3).grade.level == "FATAL"  # a harness expected to loop stopped at 2
    bare = replace(node(2, ["a", "b", "c"], continues=1), completions=[Completion(0, [], [], "stop")])
    assert check([clean[0], bare]).grade.problems == ["call 2 was answered without its token ids or logprobs"]
    assert check([]).grade.level == "FATAL"
    big_aux = replace(node(3, ["z"], model="small-fast"), completions=[Completion(0, [5] * 9, [-0.1] * 9, "stop")])
    warned = check([*clean, node(4, ["a", "b", "c", "d", "e"], continues=2), big_aux], SESSION)
    assert (warned.grade.level, warned.grade.problems) == ("WARN", ["aux calls sampled 9 tokens, the trained calls 3"])
    edited = check([*clean, node(3, ["q"], "Start again.", why="an earlier message was edited")])
    assert edited.grade == Grade("INFO", ["call 3 starts a sequence: an earlier message was edited"])


def test_branches_nest_each_sequence_under_the_one_holding_its_parent_call() -> None:
    calls = [
        node(1, ["a"], "Fix the failing test.", task=PROMPT),
        node(2, ["p"], PROMPT, answer=SUMMARY),
        node(3, ["p", "a2", "t2"], continues=2),
        node(4, ["a", "a1", "r1"], continues=1),
        node(5, ["s"], f"Continuing from: {SUMMARY}"),
        node(6, ["q"], "Something else."),
    ]

    def shape(tree: list[Any]) -> list[Any]:
        return [(b.first.edge, b.calls, shape(b.children)) for b in tree]

    assert shape(branches(place(calls))) == [
        ("new", [1, 4], [("subagent", [2, 3], [("compaction", [5], [])])]),
        ("new", [6], []),
    ]


def test_a_text_the_model_copied_from_its_prompt_is_no_summary() -> None:
    """SmolLM2 in Claude Code answered with "Today's date is 2026-11-26.", copied from the
    reminders that every later conversation carries too: no compaction link from it."""
    reminder = "Today's date is 2026-11-26. Be brief."
    copied = node(1, ["a"], reminder, answer="Today's date is 2026-11-26.")
    calls = [copied, node(2, ["b"], f"{reminder} Fix the test."), node(3, ["c"], "Summarize.", answer=SUMMARY)]
    calls.append(node(4, ["d"], f"{reminder} Continued from: {SUMMARY}"))
    assert [(p.edge, p.parent) for p in place(calls)] == [
        ("new", None),
        ("new", None),
        ("new", None),
        ("compaction", 3),
    ]


def test_a_summary_block_is_linked_as_claude_code_carries_it() -> None:
    """Claude Code asks for an <analysis> block and a <summary> block, and carries only the
    summary's text on, after "Summary:" and with blank lines collapsed: the whole answer is in no
    later message, so a model that wrote as asked was never linked (a scripted one, issue 47)."""
    answer = f"<analysis>\nThe test.\n</analysis>\n\n<summary>\n{SUMMARY}\n\n\n\nNext: fix it.\n</summary>"
    calls = [node(1, ["a"], "Summarize.", answer=answer)]
    calls.append(node(2, ["b"], f"This session is being continued.\n\nSummary:\n{SUMMARY}\n\nNext: fix it."))
    assert [(p.edge, p.parent) for p in place(calls)] == [("new", None), ("compaction", 1)]


def test_the_main_loop_stays_trained_beside_a_longer_unlinked_subagent_on_another_model() -> None:
    """Defect 1 of issue 39: a subagent that nothing links (here its harness reworded the Agent
    call's prompt) ran 5 calls on another model name, more than the main loop's 3: the vote by
    call count made it the policy, and the main loop aux, untrained. No vote now: the runner
    names the policy model, and without a name an unlinked conversation is trained as its own."""
    calls = [
        node(1, ["a"], "Fix the failing test.", task="Fix it."),
        *(
            node(
                2 + i,
                ["p", *[f"x{j}" for j in range(2 * i)]],
                "Fix it, please.",
                model="sub",
                continues=1 + i if i else None,
            )
            for i in range(5)
        ),
        node(7, ["a", "a1", "r1"], continues=1),
        node(8, ["a", "a1", "r1", "a7", "r7"], continues=7),
    ]
    named = {p.seq: p for p in place(calls, policy="policy")}
    assert [named[s].trained for s in (1, 7, 8)] == [True, True, True]
    assert {named[s].purpose for s in range(2, 7)} == {"aux"}  # unlinked, on another model than the named one
    assert all(p.trained for p in place(calls))  # no name: each conversation is trained, none by a vote


def test_a_subagent_with_a_short_prompt_is_linked() -> None:
    """SmolLM2 in Claude Code asked its subagent "What to do?" (the CI run of 2026-11-26): the
    24-character floor that keeps chance out of summaries left it unlinked, and on another model
    name than the session's policy it was aux, untrained. A whole part equal to a whole argument
    links at any length."""
    calls = [node(1, ["a"], "List the files.", task="What to do?"), node(2, ["p"], "What to do?", model="sub")]
    calls.append(node(3, ["p", "a2", "t2"], continues=2, model="sub"))
    got = [(p.edge, p.parent, p.trained) for p in place(calls, policy="policy")]
    assert got == [("new", None, True), ("subagent", 1, True), ("continue", 2, True)]
    assert place([*calls[:1], node(2, ["p"], "What to do? Be quick.", model="sub")])[1].edge == "new"  # a part, whole


def test_a_deliberate_repeat_is_no_retry_and_a_thrown_away_answer_is_not_trained() -> None:
    """Defect 2 of issue 39: any equal request was a retry. A request, its continuation, the same
    request again and its continuation: the harness went on with both, so both are trained, each
    its own sequence (the original was untrained while the export trained it). Best of 3 (one
    request sent three times, the first answer taken): the two thrown away are not trained."""
    again = token_in(
        [
            node(1, ["a"]),
            node(2, ["a", "b", "c"], continues=1),
            node(3, ["a"]),
            node(4, ["a", "d", "e"], continues=3),
        ]
    )
    placed = place(again)
    assert [(p.edge, p.trained) for p in placed] == [
        ("new", True),
        ("continue", True),
        ("new", True),
        ("continue", True),
    ]
    graph = build(again, SESSION)
    assert [q.calls for q in graph.trained.sequences] == [[1, 2], [3, 4]] and graph.aside.sequences == []
    best = token_in([node(1, ["a"]), node(2, ["a"]), node(3, ["a"]), node(4, ["a", "b", "c"], continues=1)])
    assert [(p.edge, p.parent, p.trained) for p in place(best)] == [
        ("new", None, True),
        ("retry", 1, False),
        ("retry", 2, False),
        ("continue", 1, True),
    ]
    graph = build(best, SESSION)
    assert [q.calls for q in graph.trained.sequences] == [[1, 4]]
    assert [q.calls for q in graph.aside.sequences] == [[2], [3]]  # exported as not trained, chains after


def test_what_is_trained_is_what_the_sequences_hold() -> None:
    """The graph's placements and its sequences agree: every trained call is in exactly one
    trained sequence (of its first choice), no untrained call is, and each call's root is the
    first call of the sequence holding it."""
    calls = token_in(
        [
            node(1, ["a"], "Fix the failing test.", task=PROMPT),
            node(2, ["z"], "Write a title.", model="small-fast"),
            node(3, ["p"], PROMPT),
            node(4, ["p", "a3", "t3"], continues=3),
            node(5, ["a", "a1", "r1"], continues=1),
            node(6, ["a", "a1", "r1"], continues=1, why="a fork: call 5 continued this answer first"),
            node(7, ["a", "a1", "r1", "a6", "u"], continues=6),
        ]
    )
    graph = build(calls, SESSION)
    in_sequences = [span.seq for q in graph.trained.sequences for span in q.spans]
    assert sorted(in_sequences) == sorted(graph.trained_calls) == [1, 3, 4, 6, 7]
    assert [q.calls for q in graph.trained.sequences] == [[1, 6, 7], [3, 4]]  # the re-send joins its thread
    roots = {span.seq: q.spans[0].seq for q in [*graph.trained.sequences, *graph.aside.sequences] for span in q.spans}
    assert {p.seq: p.root for p in graph.placements} == roots


def test_the_sequences_are_the_chains_the_graph_placed() -> None:
    """Issue 46: `build` assembles the sequences from the placements' chains and choices; nothing
    finds them again by token prefix. Call 1 samples two choices and call 2 continues the second
    (token-in); call 3, continuing call 2, fails upstream (no answer, no ids) and the harness
    sends it again as call 4. Call 1's sequence goes on with its second choice, through call 2
    and the re-send: the failed call ends no chain. The first choice is a sequence set aside."""
    one = node(1, ["a"])
    one = replace(one, completions=[Completion(0, [11], [-0.5], "stop"), Completion(1, [12], [-0.7], "stop")])
    two = node(2, ["a", "b", "c"], continues=1)
    two = replace(two, thread={**two.thread, "continues": {"call": "c1", "choice": 1}}, prompt_token_ids=[97, 12, 5])
    failed = replace(
        node(3, ["a", "b", "c", "d", "e"], continues=2), ok=False, http_status=500, error="down",
        prompt_token_ids=[], completions=[],
    )  # fmt: skip
    again = replace(node(4, ["a", "b", "c", "d", "e"], continues=2), prompt_token_ids=[97, 12, 5, 2, 6])
    graph = build([one, two, failed, again], SESSION)
    placed = {p.seq: (p.edge, p.parent, p.root, p.choice, p.trained) for p in graph.placements}
    assert placed == {
        1: ("new", None, 1, 1, True),
        2: ("continue", 1, 1, 0, True),
        3: ("continue", 2, 3, 0, False),  # the failed original of a re-send: its own, untrained
        4: ("retry", 3, 1, 0, True),  # the re-send takes its place in call 1's chain
    }
    [trained] = graph.trained.sequences
    assert [(span.seq, span.choice) for span in trained.spans] == [(1, 1), (2, 0), (4, 0)]
    assert trained.input_ids == [97, 12, 5, 2, 6, 4] and trained.loss_mask == [0, 1, 0, 1, 0, 1]
    assert [[(span.seq, span.choice) for span in q.spans] for q in graph.aside.sequences] == [[(1, 0)]]
    assert graph.aside.skipped == [(3, "failed call (HTTP 500): down")]


def test_a_subagent_whose_prompt_carries_its_parents_answer_is_a_subagent() -> None:
    """Defect 7 of issue 39: the Agent call's prompt quotes the answer text of the same call, so
    both the subagent and the compaction rule point at call 1; it was "ambiguous", placed new
    (then aux on another model)."""
    task = f"{SUMMARY} Now find where the date is parsed."
    calls = [node(1, ["a"], "Fix the failing test.", answer=SUMMARY, task=task), node(2, ["p"], task, model="opus")]
    assert [(p.edge, p.parent, p.trained) for p in place(calls, policy="policy")] == [
        ("new", None, True),
        ("subagent", 1, True),
    ]
