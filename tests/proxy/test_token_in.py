"""Token-in with a stub upstream (NOT vLLM): it renders chats with a toy template of its own
(`stub_upstream.render`, whose end-of-turn token is 2) and takes `kv_transfer_params` prompts as
vLLM does, so the bridge can be checked id by id; the real thing is in test_token_in_vllm.py."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.support.stub_upstream import COMPLETION, MODEL, render, stub_app
from proxy.server import AppThread
from recorder.graph import build_sequences


@pytest.mark.parametrize("bridges", [True, False], ids=["bridged-upstream", "tokenize"])
def test_each_continuing_prompt_is_the_last_prompt_its_answer_and_the_bridge(make_proxy: Any, bridges: bool) -> None:
    """Alike whether the upstream makes the bridge itself (rl-proxy's vLLM plugin: proxy/bridge.py)
    or the proxy cuts it from a `/tokenize` of the request: then the call's path holds one more
    round trip. Either way the end-of-turn token is found once, from two renderings."""
    app = stub_app(bridges=bridges)
    with AppThread(app) as upstream:
        proxy = make_proxy(f"{upstream.url}/v1")
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        for turn in range(3):
            body = {"model": MODEL, "messages": messages}
            httpx.post(f"{proxy.v1}/chat/completions", json=body, headers={"x-api-key": "s-ti"}).raise_for_status()
            messages += [{"role": "assistant", "content": "stub answer"}, {"role": "user", "content": f"and {turn}?"}]
        first, second, third = proxy.calls("s-ti")
        assert first.prompt_token_ids == render(messages[:1]) and not first.token_in
        for before, after, n in ((first, second, 3), (second, third, 5)):
            bridge = render(messages[:n])[len(render(messages[: n - 1])) - 1 :]  # the new user turn, then "assistant"
            assert after.prompt_token_ids == before.prompt_token_ids + COMPLETION + bridge
            assert after.token_in and after.thread_start is None
        assert app.state.renderings == (2 if bridges else 4)
        assert httpx.get(f"{proxy.url}/healthz").json()["upstreams"][0]["bridges"] is bridges
    # What token-in's planning and the durable commits took, for Prometheus (docs/proxy.md#admin-api)
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert 'rlp_token_in_seconds_count{outcome="continued"} 2.0' in metrics
    assert 'rlp_token_in_seconds_count{outcome="new_thread"} 1.0' in metrics
    assert "rlp_commit_seconds_count 3.0" in metrics


def test_messages_mode_sends_the_messages_as_they_are(make_proxy: Any, stub: str) -> None:
    proxy = make_proxy(stub, messages_mode=True)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "stub answer"},
        {"role": "user", "content": "more"},
    ]
    for sent in (messages[:1], messages):
        httpx.post(f"{proxy.v1}/chat/completions", json={"model": MODEL, "messages": sent}).raise_for_status()
    assert [c.prompt_token_ids for c in proxy.calls()] == [render(messages[:1]), render(messages)]
    assert not any(c.token_in or c.thread_start for c in proxy.calls())


def test_template_inputs_are_part_of_a_thread_and_a_change_starts_a_new_one(make_proxy: Any, stub: str) -> None:
    """`reasoning_effort` (and `documents`) reach the template: a call that keeps them continues
    its thread, one that changes them starts a new one (its history would render otherwise)."""
    proxy = make_proxy(stub)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    for effort in ("low", "low", "high"):
        body = {"model": MODEL, "messages": messages, "reasoning_effort": effort}
        httpx.post(f"{proxy.v1}/chat/completions", json=body, headers={"x-api-key": "s-effort"}).raise_for_status()
        messages += [{"role": "assistant", "content": "stub answer"}, {"role": "user", "content": "more"}]
    _, same, changed = proxy.calls("s-effort")
    assert same.token_in and same.thread_start is None
    assert not changed.token_in and changed.thread_start == "the tools or the chat template changed"


def fork(key: str, first: str, branch_urls: list[str]) -> list[list[dict[str, Any]]]:
    """A first call to `first`, then two calls at once continuing its answer (to the two URLs),
    each with its own new message; the two branches' messages."""
    ask = [{"role": "user", "content": "hi"}]
    headers = {"x-api-key": key}
    httpx.post(f"{first}/chat/completions", json={"model": MODEL, "messages": ask}, headers=headers)
    branches = [
        [*ask, {"role": "assistant", "content": "stub answer"}, {"role": "user", "content": q}]
        for q in ("left?", "right, at some length?")
    ]

    async def send_both() -> None:
        async with httpx.AsyncClient(headers=headers) as client:
            sent = [
                client.post(f"{url}/chat/completions", json={"model": MODEL, "messages": m})
                for url, m in zip(branch_urls, branches, strict=True)
            ]
            for answer in await asyncio.gather(*sent):
                answer.raise_for_status()

    asyncio.run(send_both())
    return branches


def test_two_calls_continuing_one_answer_at_once_each_get_its_prompt_and_the_second_is_a_fork(
    make_proxy: Any, stub: str
) -> None:
    """A harness's retry, or two branches sent together: both continue the first answer token-in,
    each with its own bridge, and the record says which one forked."""
    proxy = make_proxy(stub)
    branches = fork("s-fork", proxy.v1, [proxy.v1, proxy.v1])
    first, *continuing = proxy.calls("s-fork")
    bridges = {tuple(render(m)[len(render(m[:2])) - 1 :]) for m in branches}  # after the echoed answer
    got = {tuple(c.prompt_token_ids[len(first.prompt_token_ids) + len(COMPLETION) :]) for c in continuing}
    assert got == bridges and all(c.token_in for c in continuing)
    went_on = next(c for c in continuing if c.thread_start is None)
    assert sorted(str(c.thread_start) for c in continuing) == [
        "None",
        f"a fork: call {went_on.call_id} continued this answer first",  # by id: renumbering cannot move it
    ]


def test_two_calls_continuing_one_answer_at_once_on_two_proxies_are_two_exact_sequences(
    make_proxy: Any, stub: str, db: str
) -> None:
    """A fork across processes: the two branches go to two proxies on one store (neither served
    the first call), each reads the thread back and continues the answer token-in; the session
    becomes two exact sequences sharing the first call's tokens, as with a fork in one process.
    Both proxies number their call 2: the one that commits second failed (a unique violation,
    answered 503) until a batch whose numbers were taken meanwhile was numbered anew."""
    first_proxy, left, right = (make_proxy(stub, db=db) for _ in range(3))
    fork("s-fork-across", first_proxy.v1, [left.v1, right.v1])
    calls = first_proxy.calls("s-fork-across")
    assert [c.token_in for c in calls] == [False, True, True], [c.thread_start for c in calls]
    sequences = build_sequences(calls).sequences  # as in one process: the later branch is a sequence of its own
    assert [[span.seq for span in s.spans] for s in sequences] == [[1, 2], [3]]
    shared = [*calls[0].prompt_token_ids, *COMPLETION]  # the first call's tokens, exact, in both
    assert all(s.input_ids[: len(shared)] == shared for s in sequences)


def test_any_edit_of_a_message_the_model_did_not_sample_starts_a_new_thread(make_proxy: Any, stub: str) -> None:
    """Only the echo of the model's own answer is compared loosely. An edit of an earlier message
    only in its whitespace, its `name`, its `tool_call_id` or a non-text part was dropped: the call
    continued the thread and the model saw the old tokens. A moved `cache_control` (Claude Code
    marks its latest turns; no template renders it) still continues, and so does content of one
    text part sent again as a string (Claude Code does: vLLM renders the two alike)."""
    proxy = make_proxy(stub)
    tool_call = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    first = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
    ]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    edits = {
        "same": lambda m: m,
        "cache_control moved": lambda m: [m[0], {**m[1], "content": [{"type": "text", "text": "hi"}]}, *m[2:]],
        "one text part as a string": lambda m: [m[0], {**m[1], "content": "hi"}, *m[2:]],
        "two text parts": lambda m: [m[0], {**m[1], "content": [{"type": "text", "text": t} for t in "hi"]}, *m[2:]],
        "whitespace": lambda m: [{**m[0], "content": "be brief "}, *m[1:]],
        "name": lambda m: [m[0], {**m[1], "name": "alice"}, *m[2:]],
        "tool_call_id": lambda m: [*m[:3], {**m[3], "tool_call_id": "c2"}],
        "image part": lambda m: [m[0], {**m[1], "content": [*m[1]["content"], image]}, *m[2:]],
    }
    joined = {}
    for name, edit in edits.items():
        key = {"x-api-key": f"s-edit-{name.replace(' ', '-')}"}
        httpx.post(
            f"{proxy.v1}/chat/completions", json={"model": MODEL, "messages": first}, headers=key
        ).raise_for_status()
        again = [*edit(first), {"role": "assistant", "content": "stub answer"}, {"role": "user", "content": "and?"}]
        httpx.post(
            f"{proxy.v1}/chat/completions", json={"model": MODEL, "messages": again}, headers=key
        ).raise_for_status()
        joined[name] = proxy.calls(key["x-api-key"])[-1].token_in
    assert joined == {name: name in ("same", "cache_control moved", "one text part as a string") for name in edits}


def test_threads_the_cache_cannot_hold_are_read_back(make_proxy: Any, stub: str) -> None:
    """The thread cache is bounded by bytes: two sessions taking turns on a proxy whose budget
    holds one session's threads evict each other at every call, and every continuing call still
    joins (its thread read back from the store). /healthz shows each cache within its budget."""
    proxy = make_proxy(stub, thread_cache_mb=0.008)  # about 8,400 bytes: one session's threads (5,900)
    histories: dict[str, list[dict[str, Any]]] = {k: [{"role": "user", "content": "hi"}] for k in ("s-a", "s-b")}
    for n in range(3):
        for key, messages in histories.items():
            body = {"model": MODEL, "messages": messages}
            httpx.post(f"{proxy.v1}/chat/completions", json=body, headers={"x-api-key": key}).raise_for_status()
            messages += [{"role": "assistant", "content": "stub answer"}, {"role": "user", "content": f"and {n}?"}]
    caches = httpx.get(f"{proxy.url}/healthz").json()["caches"]
    assert caches["threads"]["entries"] == 1, caches  # the other session was evicted
    assert all(c["bytes"] <= c["budget"] for c in caches.values()), caches
    for key in histories:
        calls = proxy.calls(key)
        assert [c.token_in for c in calls] == [False, True, True], [c.thread_start for c in calls]


def test_a_thread_continues_across_proxies_and_after_a_restart(make_proxy: Any, stub: str, tmp_path: Path) -> None:
    """Threads lived in one proxy's memory: a session whose calls went to another proxy on the
    same store (round robin behind a load balancer), or to a restarted one, started a new thread
    at every call. A proxy now reads the session's recorded threads back when it holds none that
    the call continues."""
    db = str(tmp_path / "shared.db")
    first, second = make_proxy(stub, db=db), make_proxy(stub, db=db)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]

    def turn(proxy: Any, n: int) -> None:
        body = {"model": MODEL, "messages": messages}
        httpx.post(f"{proxy.v1}/chat/completions", json=body, headers={"x-api-key": "s-across"}).raise_for_status()
        messages.extend([{"role": "assistant", "content": "stub answer"}, {"role": "user", "content": f"and {n}?"}])

    for n, proxy in enumerate([first, second, first, second]):
        turn(proxy, n)
    turn(make_proxy(stub, db=db), 4)  # restarted: a new process, nothing in memory
    calls = first.calls("s-across")
    assert [c.seq for c in calls] == [1, 2, 3, 4, 5]
    assert [c.token_in for c in calls] == [False, True, True, True, True], [c.thread_start for c in calls]
    for before, after in itertools.pairwise(calls):  # one exact sequence
        assert after.prompt_token_ids[: len(before.prompt_token_ids) + len(COMPLETION)] == [
            *before.prompt_token_ids,
            *COMPLETION,
        ]


def test_a_long_subagent_leaves_its_parent_thread_to_be_continued(make_proxy: Any, stub: str) -> None:
    """Claude Code's main loop calls its Agent tool, and the subagent's own conversation takes
    many calls before the main loop goes on. The subagent's turns, each continuing the one before,
    must not push the main thread out of the session's threads: the main loop's next call
    continues it (seen with a real Claude Code, where four subagent calls split the main loop)."""
    proxy = make_proxy(stub)
    key = {"x-api-key": "s-subagent"}

    def ask(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        body = {"model": MODEL, "messages": messages}
        httpx.post(f"{proxy.v1}/chat/completions", json=body, headers=key).raise_for_status()
        return [*messages, {"role": "assistant", "content": "stub answer"}]

    main = ask([{"role": "user", "content": "Use a subagent to list the files."}])
    subagent = [{"role": "user", "content": "List the files."}]
    for turn in range(20):
        subagent = [*ask(subagent), {"role": "user", "content": f"a.txt {turn}"}]
    ask([*main, {"role": "user", "content": "The subagent says: a.txt"}])
    calls = proxy.calls("s-subagent")
    assert [c.token_in for c in calls] == [False, False, *[True] * 19, True], [c.thread_start for c in calls]
    assert calls[-1].thread["continues"]["call"] == calls[0].call_id  # type: ignore[index]


def test_a_long_subagent_on_another_proxy_leaves_the_main_thread_to_be_read_back(
    make_proxy: Any, stub: str, tmp_path: Path
) -> None:
    """Defect 3 of issue 39: the main loop's first call on one proxy, a 20-call subagent on
    another, the main loop's next call on a third (a restart) of the same store. The read-back
    took the newest 16 calls, all the subagent's, and the restored threads entered the cache
    before what continued them was known, so the main loop started a new thread. Now the open
    ends (calls no later call continued) are read back too, and each thread enters the cache
    knowing whether it was continued."""
    db = str(tmp_path / "shared.db")
    main_proxy, subagent_proxy = make_proxy(stub, db=db), make_proxy(stub, db=db)
    key = {"x-api-key": "s-subagent-across"}

    def ask(proxy: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        body = {"model": MODEL, "messages": messages}
        httpx.post(f"{proxy.v1}/chat/completions", json=body, headers=key).raise_for_status()
        return [*messages, {"role": "assistant", "content": "stub answer"}]

    main = ask(main_proxy, [{"role": "user", "content": "Use a subagent to list the files."}])
    subagent = [{"role": "user", "content": "List the files."}]
    for turn in range(20):
        subagent = [*ask(subagent_proxy, subagent), {"role": "user", "content": f"a.txt {turn}"}]
    ask(make_proxy(stub, db=db), [*main, {"role": "user", "content": "The subagent says: a.txt"}])
    calls = main_proxy.calls("s-subagent-across")
    assert [c.token_in for c in calls] == [False, False, *[True] * 19, True], [c.thread_start for c in calls]
    last = calls[-1]
    assert (last.thread or {})["continues"]["call"] == calls[0].call_id
    assert last.prompt_token_ids[: len(calls[0].prompt_token_ids) + len(COMPLETION)] == [
        *calls[0].prompt_token_ids,
        *COMPLETION,
    ]
