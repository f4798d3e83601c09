"""Pure parts of the proxy on hand-built input: session keys, token capture, client view."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import socket
import subprocess
import sys
import threading
import time
from array import array
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import orjson
import pytest
from aiohttp import web
from fastapi import FastAPI
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.support.samples import call
from proxy import heap
from proxy import upstream as upstream_module
from proxy.anthropic import to_chat
from proxy.bridge import bridge
from proxy.capture import Capture, client_view, parse_answer, parse_rendering
from proxy.errors import UpstreamUnreachable
from proxy.server import AppThread
from proxy.sessions import forced_tool_choice, parse_key
from proxy.state import RecentResponses
from proxy.threads import Answer, Plan, Threads, _digest, exact, thread_state, tools_key
from proxy.upstream import VERSION_PATIENCE, Upstream
from proxy.vllm import VllmServer, dtype_args, free_port
from proxy.workers import RING, Marks
from recorder.caches import ENTRY
from recorder.records import ThreadRecord
from recorder.schema import key_digest


def test_plain_key_names_the_session_but_a_secret_one_does_not() -> None:
    info = parse_key("ep-3")
    assert (info.id, info.key, info.run, info.metadata) == ("ep-3", "ep-3", None, {})
    for secret in ("sk-abc", "sk-ant-api03-" + "x" * 90, "x" * 49):
        assert parse_key(secret).id.startswith("key-") and secret not in parse_key(secret).id
    assert parse_key("sk-abc").id == parse_key("sk-abc").id != parse_key("sk-abd").id


def test_labelled_key() -> None:
    info = parse_key("run=exp1, task=t7,group=t7-a,id=ep3,seed=4")
    assert (info.id, info.run, info.task_id, info.group_id) == ("ep3", "exp1", "t7", "t7-a")
    assert info.metadata == {"seed": "4"}
    assert parse_key("run=exp1,task=t7").id == "run=exp1,task=t7"
    assert parse_key("a=b,garbage").id == "a=b,garbage"  # not all pairs: an opaque key
    assert parse_key("a=b,garbage").run is None


def test_stream_capture_assembles_tool_calls_and_tokens() -> None:
    capture = Capture()
    chunks = [
        {
            "id": "c1",
            "model": "m",
            "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}],
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [{"index": 0, "id": "t1", "type": "function", "function": {"name": "add"}}]
                    },
                    "token_ids": [10, 11],
                    "logprobs": {"content": [{"logprob": -1.0}, {"logprob": -2.0}]},
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1'}}]},
                    "token_ids": [12],
                    "logprobs": {"content": [{"logprob": -0.5}]},
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]},
                    "token_ids": [2],
                    "logprobs": {"content": [{"logprob": -0.1}]},
                    "finish_reason": "tool_calls",
                }
            ]
        },
    ]
    for chunk in chunks:
        capture.add_chunk(chunk)
    [completion] = capture.completions()
    assert capture.prompt_token_ids.tolist() == [1, 2, 3]
    assert completion.token_ids == [10, 11, 12, 2]
    assert completion.logprobs == [-1.0, -2.0, -0.5, -0.1]
    assert completion.finish_reason == "tool_calls"
    message = capture.assembled(chat=True)["choices"][0]["message"]
    assert message["tool_calls"] == [
        {"id": "t1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    ]
    assert message["content"] is None


def test_text_completion_capture() -> None:
    capture = Capture()
    choice = {
        "index": 0,
        "text": "4",
        "prompt_token_ids": [5, 6],
        "token_ids": [7],
        "logprobs": {"token_logprobs": [-0.25]},
        "finish_reason": "length",
    }
    capture.add_response({"choices": [choice]})
    assert capture.prompt_token_ids.tolist() == [5, 6]
    assert capture.completions()[0].logprobs == [-0.25]


def test_client_view_nulls_only_what_was_not_asked() -> None:
    body = {"prompt_token_ids": [1], "choices": [{"token_ids": [2], "logprobs": {"content": []}}]}
    assert client_view(body, keep_tokens=False, keep_logprobs=True) == {
        "prompt_token_ids": None,
        "choices": [{"token_ids": None, "logprobs": {"content": []}}],
    }
    chunk = {"choices": [{"delta": {}, "logprobs": {"content": [{"logprob": -1}]}}]}
    assert client_view(chunk, keep_tokens=True, keep_logprobs=False) == {"choices": [{"delta": {}, "logprobs": None}]}


def _lists(value: Any) -> Any:
    """`value` with parse_answer's arrays made lists, to compare with orjson's parse."""
    if isinstance(value, array):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    return [_lists(v) for v in value] if isinstance(value, list) else value


IDS = st.lists(st.integers(0, 2**31 - 1), max_size=40)
NOT_IDS = st.lists(
    st.one_of(st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False), st.text(max_size=3)), min_size=1, max_size=4
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=20), inner, max_size=3),
    max_leaves=8,
)


@given(
    top=st.one_of(st.none(), IDS, NOT_IDS),
    in_choices=st.lists(st.one_of(st.none(), IDS, NOT_IDS), max_size=3),
    nested=st.one_of(st.none(), IDS),
    noise=st.dictionaries(st.sampled_from(["content", "model", "prompt_token_ids:", "x"]), JSON, max_size=3),
)
def test_an_answers_prompt_ids_are_parsed_as_orjson_parses_them(
    top: Any, in_choices: list[Any], nested: Any, noise: dict[str, Any]
) -> None:
    """parse_answer reads prompt ids from the answer's bytes without a Python int each: what it
    gives is what orjson gives, with the answer's and its choices' ids as arrays; ids anywhere
    else, or values that are not ids, or the key's text inside a string, leave plain JSON."""
    choices: list[Any] = [
        {"index": i, **({} if ids is None else {"prompt_token_ids": ids})} for i, ids in enumerate(in_choices)
    ]
    body: dict[str, Any] = {**noise, "choices": choices, "text": '"prompt_token_ids":[1,2]'}
    if top is not None:
        body["prompt_token_ids"] = top
    if nested is not None:
        body["kv_transfer_params"] = {"prompt_token_ids": nested}
    raw = orjson.dumps(body)
    parsed = parse_answer(raw)
    assert _lists(parsed) == orjson.loads(raw)
    given = [ids for ids in (top, *in_choices) if ids is not None]
    as_ids = nested is None and all(all(isinstance(x, int) and 0 <= x < 2**31 for x in ids) for ids in given)
    arrays = [h for h in (parsed, *parsed["choices"]) if isinstance(h.get("prompt_token_ids"), array)]
    assert len(arrays) == (len(given) if as_ids else 0)  # all of them, or plain JSON whole


def test_an_answers_prompt_ids_as_vllm_writes_them() -> None:
    ids = list(range(100_000, 230_000, 7))
    raw = orjson.dumps({"id": "c", "choices": [{"index": 0, "token_ids": [5]}], "prompt_token_ids": ids})
    parsed = parse_answer(raw)
    assert isinstance(parsed["prompt_token_ids"], array) and parsed["prompt_token_ids"].tolist() == ids
    capture = Capture()
    capture.add_response(parsed)
    assert capture.prompt_token_ids is parsed["prompt_token_ids"]  # kept, not copied
    assert client_view(parsed, keep_tokens=True, keep_logprobs=False)["prompt_token_ids"] == ids  # a list again
    spaced = raw.replace(b'"prompt_token_ids":[', b'"prompt_token_ids": [')  # not vLLM's: plain JSON
    assert parse_answer(spaced)["prompt_token_ids"] == ids
    for not_ids in ([1.5, 2], [2, 1.0], [-1], [2**31], [7, "8"]):  # plain JSON: numpy would read some as ids
        assert parse_answer(orjson.dumps({"prompt_token_ids": not_ids}))["prompt_token_ids"] == not_ids
    # What token-in sent is taken as sent where the answer repeats it byte for byte, and only there.
    for sent in ([], ids[:500], ids, [*ids[:499], 1], [ids[0] // 10], [*ids, 5]):
        json = orjson.dumps(sent)[1:-1]
        assert parse_answer(raw, (json, array("i", sent)))["prompt_token_ids"].tolist() == ids, sent[-1:]


@given(
    tokens=st.one_of(IDS, NOT_IDS),
    nested=st.one_of(st.none(), IDS),
    noise=st.dictionaries(st.sampled_from(["count", "max_model_len", "token_strs", "detail"]), JSON, max_size=3),
)
def test_a_renderings_tokens_are_parsed_as_orjson_parses_them(tokens: Any, nested: Any, noise: dict[str, Any]) -> None:
    """A /tokenize answer's ids as an array (token-in's bridge cut by the proxy), read as
    parse_answer reads prompt ids; anything else, or the key elsewhere, leaves plain JSON."""
    body: dict[str, Any] = {**({} if nested is None else {"detail": {"tokens": nested}}), **noise, "tokens": tokens}
    raw = orjson.dumps(body)
    parsed = parse_rendering(raw)
    assert _lists(parsed) == orjson.loads(raw)
    plain = all(isinstance(x, int) and 0 <= x < 2**31 for x in tokens)
    first = raw.find(b'"tokens":[') == raw.rfind(b'"tokens":[')  # the only one: the answer's
    assert isinstance(parsed["tokens"], array) == (plain and first)


ENDS = st.lists(st.sampled_from([7, 7, 1, 2, 3]), max_size=30)  # 7: the end-of-turn token


@given(
    rendered=ENDS,
    history=st.one_of(ENDS, st.just("no rendering")),
    n=st.integers(1, 6),
    later=st.integers(0, 3),
    closed=st.booleans(),
)
def test_a_bridge_cut_from_an_array_is_the_one_cut_from_a_list(
    rendered: list[int], history: Any, n: int, later: int, closed: bool
) -> None:
    """The proxy cuts the bridge from /tokenize's ids as an array (numpy), the plugin from vLLM's
    list: the same bridge, or the same reason why none, either way."""
    thread = {"eot": 7, "n": n, "later": later, "closed": closed}

    def cut(ids: Any) -> Any:
        held = history if isinstance(history, str) else type(ids)(*(["i"] if isinstance(ids, array) else []), history)
        made = asyncio.run(bridge(ids, thread, lambda: _returns(held)))
        return made if isinstance(made, str) else list(made)

    assert cut(array("i", rendered)) == cut(list(rendered))


def test_recent_responses_drop_the_least_recently_used() -> None:
    """A long previous_response_id chain keeps reading its oldest turns: reading one keeps it."""
    first, second, third = (replace(call("s", n, [n]), response_id=f"resp_{n}") for n in (1, 2, 3))
    one = ENTRY + len(orjson.dumps(first.request)) + len(orjson.dumps(first.response))
    recent = RecentResponses(budget=2 * one + one // 2)  # room for two answers
    recent.remember(first)
    recent.remember(second)
    assert recent.get("s", "resp_1") == (first.request, first.response)
    recent.remember(third)  # the full cache drops resp_2, read less recently than resp_1
    assert recent.get("s", "resp_1") is not None and recent.get("s", "resp_3") is not None
    assert recent.get("s", "resp_2") is None
    assert recent.get("other-session", "resp_1") is None
    recent.remember(replace(call("s", 4, [4], ok=False), response_id="resp_4"))  # a failed call is not kept
    assert recent.get("s", "resp_4") is None
    huge = replace(call("s", 5, [5]), response_id="resp_5", request={"input": "x" * 3 * one})
    recent.remember(huge)  # over the whole budget: not kept, and nothing else is dropped for it
    assert recent.get("s", "resp_5") is None and recent.get("s", "resp_1") is not None
    assert recent.cache.usage()["bytes"] <= recent.cache.usage()["budget"]


def test_vllm_start_progress_in_a_log_is_a_line_every_few_seconds(tmp_path: Path, capsys: Any) -> None:
    """Output that is not a terminal (make train > log) gets whole lines, not `\\r` updates."""
    ready_at = time.monotonic() + 3

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if time.monotonic() > ready_at else 503)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        VllmServer("m", "m", log_file=tmp_path / "log", port=server.server_address[1]).wait_ready(60, progress=True)
    finally:
        server.shutdown()
    lines = capsys.readouterr().out.splitlines(keepends=True)
    assert lines[0] == "starting vLLM (m): 0 s\n" and len(lines) == 2 and lines[1].startswith("vLLM ready after")


async def test_slow_version_reads_are_not_warnings_until_they_last(caplog: Any) -> None:
    """A busy vLLM answers /weight_info late at start: quiet, unless it goes on for a while."""
    upstream = Upstream("http://127.0.0.1:9/v1", timeout=5, connect_timeout=1)  # nothing listens there
    try:
        with caplog.at_level(logging.DEBUG, logger="rl_proxy.upstream"):
            for _ in range(3):
                await upstream.refresh_version()
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
            for _ in range(VERSION_PATIENCE):
                await upstream.refresh_version()
        assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    finally:
        await upstream.close()


async def _weight_info_server(handler: Any) -> tuple[web.AppRunner, Upstream]:
    """A stub (NOT vLLM) answering GET /weight_info with `handler`, and an Upstream on it."""
    app = web.Application()
    app.router.add_get("/weight_info", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, Upstream(f"http://127.0.0.1:{port}/v1", timeout=5, connect_timeout=1)


async def test_a_late_answer_to_an_older_version_read_does_not_undo_a_newer_one() -> None:
    """The poll's read, sent before a swap and answered after the trainer's own read of the new
    version, must not set the old version back (seen in CI: 16 streams ended stamped "0")."""
    served = {"version": "0"}
    delays = [0.5, 0.0]  # in order of arrival: the poll's read is slow, the announce's is not

    async def weight_info(request: web.Request) -> web.Response:
        version = served["version"]  # read when the request arrives, answered after its delay
        await asyncio.sleep(delays.pop(0))
        return web.json_response({"weight_version": version})

    runner, upstream = await _weight_info_server(weight_info)
    try:
        poll = asyncio.create_task(upstream.refresh_version())
        await asyncio.sleep(0.2)
        served["version"] = "1"  # the swap
        await upstream.refresh_version(patient=False)  # the trainer's announce: answered first
        assert upstream.version == "1"
        await poll
        assert upstream.version == "1"
    finally:
        await upstream.close()
        await runner.cleanup()


async def test_the_announce_reads_the_version_until_it_is_read_or_says_it_was_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trainer's announce (a read with patient=False) whose first read times out (a busy vLLM
    in CI) reads again: the proxy had kept the old version and said nothing, and 16 streams that
    ended after the swap were stamped "0". A server that never answers is an error naming it."""
    monkeypatch.setattr(upstream_module, "VERSION_READ_TIMEOUT", 0.2)
    monkeypatch.setattr(upstream_module, "ANNOUNCE_PATIENCE", 1.0)
    delays = [0.5, 0.0]  # the first read is answered after the read's timeout

    async def weight_info(request: web.Request) -> web.Response:
        await asyncio.sleep(delays.pop(0) if delays else 5.0)
        return web.json_response({"weight_version": "1"})

    runner, upstream = await _weight_info_server(weight_info)
    try:
        upstream.version = "0"
        await upstream.refresh_version(patient=False)
        assert upstream.version == "1"
        upstream.version = "0"  # from now on every read times out
        with pytest.raises(UpstreamUnreachable, match=f"weight version not read from {upstream.root}"):
            await upstream.refresh_version(patient=False)
        assert upstream.version == "0"
    finally:
        await upstream.close()
        await runner.cleanup()


async def test_a_weight_info_without_a_version_records_none_not_the_string(caplog: Any) -> None:
    """vLLM answers {"weight_version": null} before any version is set; that read "None"."""
    runner, upstream = await _weight_info_server(lambda request: web.json_response({"weight_version": None}))
    try:
        with caplog.at_level(logging.WARNING, logger="rl_proxy.upstream"):
            for _ in range(3):
                assert await upstream.refresh_version()
        assert upstream.version is None
        assert [r.message for r in caplog.records].count(
            f"{upstream.root}/weight_info names no weight_version: calls are recorded without one"
        ) == 1
    finally:
        await upstream.close()
        await runner.cleanup()


async def test_streams_are_asked_for_whole_only_after_a_real_gap_and_not_for_good(caplog: Any) -> None:
    whole = Capture()
    whole.add_chunk({"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [5]}], "prompt_token_ids": [1]})
    whole.add_chunk({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1}})
    assert whole.incomplete() and not whole.text_without_ids  # a count off (a batch): no gap in the stream
    gap = Capture()
    gap.add_chunk({"choices": [{"index": 0, "delta": {"content": "a"}}]})
    assert gap.text_without_ids
    upstream = Upstream("http://127.0.0.1:9/v1", timeout=5, connect_timeout=1)
    with caplog.at_level(logging.WARNING, logger="rl_proxy.upstream"):
        upstream.note_stream_gap("lost ids")
        assert upstream.streams_whole()
        upstream.version = "1"  # new weights: streams are tried again
        assert not upstream.streams_whole()
        upstream.note_stream_gap("lost ids")
        upstream._gap_until = time.monotonic() - 1  # a while later
        assert not upstream.streams_whole()
    assert [r.getMessage().split(": ", 1)[1][:21] for r in caplog.records] == [
        "a stream lost token i",
        "streams are streamed ",
        "a stream lost token i",
        "streams are streamed ",
    ]
    await upstream.close()


async def test_token_in_bridges_after_the_echoed_answer(monkeypatch: Any) -> None:
    """Threads on hand-built ids (E is the end-of-turn token): the bridge is the rendering after
    the end-of-turn token closing the echoed answer, which the template re-rendered differently;
    an answer cut before its end-of-turn token gets the template's."""
    E, NL, A = 2, 198, 7  # end of turn, newline, "assistant" header
    ask = [{"role": "user", "content": "hi"}]
    prompt = [1, 50, 51, E, NL, A]
    rendered = [1, 50, 51, E, NL, A, 90, 91, E, NL, 60, 61, E, NL, A]  # answer re-rendered as 90 91
    history = rendered[:10]  # up to the echoed answer, closed as the template closes it
    histories: list[Any] = []  # the history is rendered only when the whole rendering's count is off

    def render(upstream: Any, body: dict[str, Any], generation: bool = True) -> Any:
        histories.extend([] if generation else [body["messages"]])
        return _returns(rendered if generation else history)

    monkeypatch.setattr("proxy.threads.render", render)
    monkeypatch.setattr("proxy.threads.end_of_turn", lambda upstream, body: _returns(E))
    upstream: Any = SimpleNamespace(base_url="http://upstream/v1", bridges=False)  # rendered through the patches
    for sampled, finish, expected in (
        ([80, 81, E], "stop", [*prompt, 80, 81, E, NL, 60, 61, E, NL, A]),  # sampled, then the bridge
        ([80, 81], "length", [*prompt, 80, 81, E, NL, 60, 61, E, NL, A]),
    ):
        threads = Threads()
        answers = [Answer({"role": "assistant", "content": "ok"}, array("i", sampled), finish)]
        threads.add(
            "s", "c1", thread_state({"model": "m", "messages": ask}, answers, None), array("i", prompt), answers
        )
        follow = {
            "model": "m",
            "messages": [*ask, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}],
        }
        plan = await threads.plan(upstream, "s", follow)
        assert plan == Plan(array("i", expected), None, None, {"call": "c1", "choice": 0})
        other = {
            **follow,
            "messages": [*ask, {"role": "assistant", "content": "not ok"}, {"role": "user", "content": "more"}],
        }
        assert (await threads.plan(upstream, "s", other)).why == "message 2 is not the assistant answer sampled there"
        tools = {**follow, "tools": [{"type": "function", "function": {"name": "f"}}]}
        assert (await threads.plan(upstream, "s", tools)).why == "the tools or the chat template changed"
    assert histories == []
    # An answer that sampled the end-of-turn token before its end, and a template that renders the
    # history with another count of them than the thread's tokens hold: a new thread, not a guess.
    for sampled, why in (([80, E, 81, E], "before its end"), ([80, 81, 81], "renders the conversation with 2")):
        threads = Threads()
        answers = [Answer({"role": "assistant", "content": "ok"}, array("i", sampled), "stop")]
        threads.add(
            "s", "c1", thread_state({"model": "m", "messages": ask}, answers, None), array("i", [*prompt, E]), answers
        )
        assert why in str((await threads.plan(upstream, "s", follow)).why)
    assert histories == [follow["messages"][:2]]  # the answer that holds the end-of-turn token is refused first
    # A rendering whose last token is the end-of-turn token closing the echoed answer, or that
    # holds fewer of them than the thread: nothing to bridge with (the history as the thread's).
    for cut in (rendered[:9], rendered[:4]):
        rendered[:] = cut
        threads = Threads()
        answers = [Answer({"role": "assistant", "content": "ok"}, array("i", [80, 81, E]), "stop")]
        threads.add(
            "s", "c1", thread_state({"model": "m", "messages": ask}, answers, None), array("i", prompt), answers
        )
        why = (await threads.plan(upstream, "s", follow)).why
        assert "has no end-of-turn token 2 after the echoed answer" in str(why)


# Digests as stores already hold them (CallRecord.thread): a proxy that digested a message
# otherwise would continue no thread another version recorded (a restart, another proxy).
DIGESTS = [
    ({"role": "user", "content": "Fix the bug in shapes/area.py."}, "76fc96a7f32e8b253c7fe1844f8fc61b"),
    (
        {"role": "user", "content": [{"type": "text", "text": "Fix it.", "cache_control": {"type": "ephemeral"}}]},
        "64e697a232c34068025acef365c510fb",
    ),
    (
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}
            ],
        },
        "ebd6ed40c21b9a4e1809a38f5c33f4e8",
    ),
    (
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": [
                {"type": "text", "text": "a.py\nb.py"},
                {"type": "text", "text": "ü ✓", "cache_control": {"type": "ephemeral"}},
            ],
        },
        "1d747bc55d5c650beba0f545da89e823",
    ),
    ({"role": "system", "content": "cache_control", "name": "x"}, "f25077bad40b66c4b12fc99f58980a8c"),
]


@pytest.mark.parametrize("message, recorded", DIGESTS)
def test_a_messages_digest_is_the_one_stores_hold_and_leaves_the_message_as_it_was(
    message: dict[str, Any], recorded: str
) -> None:
    """Also: the same without its `cache_control` hints, and one text part as its string."""
    sent = orjson.dumps(message)
    assert exact(message).hex() == recorded and orjson.dumps(message) == sent
    content = message["content"]
    if isinstance(content, list):
        plain = [{k: v for k, v in part.items() if k != "cache_control"} for part in content]
        assert exact({**message, "content": plain}).hex() == recorded
        if len(plain) == 1:
            assert exact({**message, "content": plain[0]["text"]}).hex() == recorded


# JSON values whose text holds what a bytes repr escapes: quotes, backslashes, DEL, non-ASCII.
TEXT = st.text(st.characters(max_codepoint=0x7F)) | st.text(st.characters(exclude_categories=["Cs"]))
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)


@given(st.dictionaries(TEXT, VALUES, max_size=4))
def test_a_digest_made_without_the_repr_is_the_reprs(message: dict[str, Any]) -> None:
    data = orjson.dumps(message, option=orjson.OPT_SORT_KEYS)
    assert _digest(data) == hashlib.blake2b(repr(("exact", data)).encode(), digest_size=16).digest()


MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"])}, optional={"content": VALUES})
    | st.dictionaries(TEXT, VALUES, max_size=3)
    | st.just({"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}),
    min_size=1,
    max_size=6,
)


@given(MESSAGES, st.integers(0, 6), st.integers(-1, 5))
def test_a_calls_keys_made_from_its_sessions_newest_thread_are_its_keys_made_whole(
    messages: list[dict[str, Any]], held: int, edited: int
) -> None:
    """`Threads.keys` digests only the messages after the session's newest thread when the
    history before them is that thread's as JSON; whatever the history (edited at `edited`, hinted
    with `cache_control`, of one text part), the keys are `keys_of`'s. And the digests are skipped:
    a continuing history of no hint makes no digest of the held messages."""
    import proxy.threads as threads_module

    threads, prefix = Threads(), messages[:held]
    start = threads_module.keys_of({"messages": prefix})
    answers = [Answer({"role": "assistant", "content": "a"}, array("i", [1]), "stop")]
    threads.add(
        "s", "c1", thread_state({"messages": prefix}, answers, None, start), array("i", [1]), answers, start.whole
    )
    sent = [{**m, "name": "edited"} if i == edited else m for i, m in enumerate(messages)]
    body = {"model": "m", "messages": sent}
    digested: list[int] = []

    def counted(body: dict[str, Any]) -> Any:
        digested.append(len(body.get("messages") or []))
        return keys_of(body)

    keys_of = threads_module.keys_of
    threads_module.keys_of = counted
    try:
        made = threads.keys("s", body)
    finally:
        threads_module.keys_of = keys_of
    assert made == keys_of(body)
    continuing = 0 < len(prefix) < len(sent) and not 0 <= edited < len(prefix)
    if continuing and start.whole is not None:
        assert not digested


async def _returns(value: Any) -> Any:
    return value


def test_a_named_tool_choice_is_forced_only_where_offered_and_never_raises() -> None:
    """The session's named tool (`sampling.tool_choice: NAME`): forced, and made strict in the
    body's own copy of the tools, where offered; a malformed tool list leaves the call as sent
    (the upstream answers it), rather than failing in the proxy."""
    add = {"type": "function", "function": {"name": "add", "parameters": {}}}
    body = {"tools": [{"type": "function", "function": "not a function"}, add]}
    sent = body["tools"]
    assert forced_tool_choice("add", body) == {"type": "function", "function": {"name": "add"}}
    assert (
        body["tools"][1]["function"]["strict"] is True and "strict" not in add["function"] and body["tools"] is not sent
    )
    assert forced_tool_choice("echo", {"tools": [add]}) is None
    assert forced_tool_choice("add", {"tools": [{"function": "x"}, "y", None]}) is None
    assert forced_tool_choice("required", {"tools": [add]}) == "required" and forced_tool_choice("add", {}) is None


def test_a_messages_request_translated_to_chat_is_left_as_the_client_sent_it() -> None:
    """litellm's translator changes the request it is given, and the request is recorded as the
    client sent it: `to_chat` translates a copy (made by orjson, not deepcopy: 0.4 against 2.4 ms
    at 160 turns of an agent's history)."""
    result = [{"type": "tool_result", "tool_use_id": "t1", "content": "total 0"}]
    use = [{"type": "text", "text": "Listing."}, {"type": "tool_use", "id": "t1", "name": "bash", "input": {"c": "ls"}}]
    body = {
        "model": "m",
        "max_tokens": 64,
        "system": [{"type": "text", "text": "You code.", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "bash", "description": "run", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "ls"},
            {"role": "assistant", "content": use},
            {"role": "user", "content": result},
        ],
    }
    sent = orjson.dumps(body)
    chat, _, _ = to_chat(body)
    assert orjson.dumps(body) == sent and chat["messages"][-1]["role"] == "tool"


def test_threads_read_back_know_which_a_later_call_continued() -> None:
    """Threads read back from the store (another proxy's, or before a restart) learn from the
    records which answer a later call continued, so that beyond THREADS_PER_SESSION a continued
    thread is forgotten before a branch's latest, as for threads served here."""
    answer = {"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}

    def record(seq: int, continues: int | None) -> ThreadRecord:
        state: dict[str, Any] = {"messages": [], "tools": "00", "answers": [answer]}
        if continues is not None:
            state["continues"] = {"call": f"c{continues}", "choice": 0}
        return ThreadRecord(f"c{seq}", seq, [1, 2], [[3]], state)

    threads = Threads()
    assert threads.restore("s", [record(3, 1), record(2, None), record(1, None)])  # newest first
    kept = {t.call_id: t.continued for t in threads.cache["s"]}
    assert kept == {"c1": {0: "c3"}, "c2": {}, "c3": {}}  # by call id, which renumbering cannot move


async def test_only_a_call_that_holds_an_answer_reads_the_sessions_threads_back() -> None:
    """Issue 49: every call that no thread in memory continued read the session's recorded threads
    (one query, a third of a call's cost in a long session), though a call whose messages hold no
    assistant answer continues nothing. A call that does hold one still reads them."""
    reads: list[str] = []

    async def recorded() -> list[ThreadRecord]:
        reads.append("read")
        return []

    threads, upstream = Threads(), cast(Any, SimpleNamespace(base_url="http://upstream/v1"))
    ask = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    first = await threads.plan(upstream, "s", {"model": "m", "messages": ask}, "c1", recorded)
    assert first.prompt_ids is None and reads == []
    follow = [*ask, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    await threads.plan(upstream, "s", {"model": "m", "messages": follow}, "c2", recorded)
    assert reads == ["read"]


async def test_a_thread_read_back_is_continued_though_the_cache_cannot_hold_it() -> None:
    """Threads read back were kept through the cache and looked for there: a session's threads
    larger than the thread cache's budget were read back on every call, kept nowhere, and each
    continuing call went as messages, silently (session 27: bench_proxy's read-back proxy)."""
    ask = [{"role": "user", "content": "hi"}]
    answer = Answer({"role": "assistant", "content": "ok"}, array("i", [7, 2]), "stop")
    state = orjson.loads(orjson.dumps(thread_state({"messages": ask}, [answer], None)))

    async def recorded() -> list[ThreadRecord]:
        return [ThreadRecord("c1", 1, [1, 5], [[7, 2]], state)]

    body = {"model": "m", "messages": [*ask, answer.message, {"role": "user", "content": "more"}]}
    upstream = cast(Any, SimpleNamespace(base_url="http://upstream/v1", bridges=True))
    for budget in (2**20, 100):  # one that holds the thread, one that cannot
        threads = Threads(budget)
        threads.end_of_turn[tools_key({**body, "tools": None}) + b"m"] = 2
        plan = await threads.plan(upstream, "s", body, "c2", recorded)
        assert plan.prompt_ids is not None, (budget, plan)
        assert (plan.prompt_ids.tolist(), plan.continues) == ([1, 5, 7, 2], {"call": "c1", "choice": 0}), budget


def test_vllm_on_a_cpu_without_bf16_instructions_serves_float32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's CPU build downcasts to bfloat16, which such a CPU emulates at half the speed."""
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    without, with_amx = tmp_path / "without", tmp_path / "with"
    without.write_text("flags\t\t: fpu sse avx2 avx512f avx512_vnni\n")
    with_amx.write_text("flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16\n")
    assert dtype_args([], without) == ["--dtype", "float32"]
    assert dtype_args([], with_amx) == []
    assert dtype_args(["--dtype=bfloat16"], without) == dtype_args(["--dtype", "half"], without) == []
    assert dtype_args([], tmp_path / "no-cpuinfo") == []


def test_the_thread_cache_counts_what_its_threads_hold() -> None:
    """The thread cache's budget bounds the memory it holds. Counted by their JSON, the answers'
    messages and the objects around the token arrays were about half the memory the threads held
    (tracemalloc), and a soak's memory rose past what /healthz showed for the caches."""
    import tracemalloc

    threads = Threads()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for session in range(100):  # agent episodes of tool calls and text, 12 calls each
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"Task {session}: add 2 and 3."}]
            for turn in range(12):
                arguments = orjson.dumps({"a": turn, "b": session}).decode()
                function = {"name": "add", "arguments": arguments}
                tool_call = {"id": f"call_{session}_{turn}", "type": "function", "function": function}
                message = {"role": "assistant", "content": None, "tool_calls": [tool_call]}
                if turn % 3 == 2:
                    message = {"role": "assistant", "content": f"The sum is {turn + session}, so far."}
                answers = [Answer(message, array("i", range(1000, 1040)), "tool_calls")]
                state = thread_state({"messages": messages}, answers, None)
                threads.add(
                    f"session-{session}", f"call-{session}-{turn}", state, array("i", range(60 * turn + 80)), answers
                )
                messages = [*messages, message, {"role": "tool", "tool_call_id": tool_call["id"], "content": "5"}]
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.85 < threads.cache.currsize / held < 1.3, (threads.cache.currsize, held)  # 1.10 here; more is safe


def test_a_server_thread_holds_its_port_from_the_start_and_free_ports_are_not_the_kernels() -> None:
    """A port found free and bound later can be taken in between: the kernel hands ports of its
    ephemeral range to every bind to port 0 and every outgoing connection (a CI run failed so)."""
    server = AppThread(FastAPI())  # made, not yet started
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", server.port))
    with server:
        assert httpx.get(f"{server.url}/docs").status_code == 200
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert not any(low <= free_port() <= high for _ in range(50))
    picks = []
    for _ in range(2):  # two test workers that seed `random` alike (the trainer's runs do) pick apart
        random.seed(0)
        picks.append([free_port() for _ in range(3)])
    assert picks[0] != picks[1]


def test_settling_the_heap_freezes_what_lives_and_collects_the_young_less_often() -> None:
    """`rl-proxy serve` settles its heap before it serves (proxy/heap.py): at Python's defaults the
    collector walked every object of the start-up about once a second under load. In a process
    that never settled (a test's, the demo's), `resettle` after litellm's import changes nothing.
    In a process of its own: freezing is for the whole process."""
    script = (
        "import gc, json\n"
        "from proxy import heap\n"
        "heap.resettle()\n"
        "before = [gc.get_freeze_count(), gc.get_threshold()[0]]\n"
        "heap.settle()\n"
        "print(json.dumps([before, [gc.get_freeze_count(), gc.get_threshold()[0]]]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    before, after = orjson.loads(done.stdout.splitlines()[-1])
    assert before == [0, 700]
    assert after[0] > 1_000 and after[1] == heap.YOUNG  # every object of the imports frozen


def test_the_vllm_it_starts_logs_its_warnings_though_trl_was_imported(tmp_path: Path, monkeypatch: Any) -> None:
    """TRL's import sets VLLM_LOGGING_LEVEL=ERROR in its process's environment (trl/_compat.py),
    which a vLLM started from that process (`rl-proxy train`, the tests) inherited: its log held
    only errors, not why a thread was not bridged."""
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")  # as TRL's import leaves it
    server = VllmServer("m", "m", log_file=tmp_path / "log")
    server.command = [sys.executable, "-c", "import os; print(os.environ['VLLM_LOGGING_LEVEL'])"]
    server.launch()
    try:
        assert server.process is not None and server.process.wait(30) == 0
    finally:
        server.stop()
    assert (tmp_path / "log").read_text().strip() == "INFO"


def test_the_workers_marks_name_each_ended_session_until_the_ring_laps(tmp_path: Path) -> None:
    """Two workers' maps of one file: what one writes the other reads, and a worker that missed
    more ended sessions than the ring holds is told to forget all it holds."""
    ending, reading = Marks(tmp_path / "marks"), Marks(tmp_path / "marks")
    digests = [key_digest(f"key {i}") for i in range(RING + 3)]
    for digest in digests[:3]:
        ending.end(digest)
    assert reading.ended_since(0) == (3, digests[:3])
    assert reading.ended_since(2) == (3, digests[2:3])
    said = ending.announce()
    assert reading.announced() == said != bytes(8)
    for digest in digests[3:]:
        ending.end(digest)
    assert reading.ended_since(3) == (RING + 3, digests[3:])  # just the ring's worth
    assert reading.ended_since(2) == (RING + 3, None)
