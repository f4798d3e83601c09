"""Bad input at scale: schemathesis against the proxy's own OpenAPI document (every route, valid
and invalid bodies, headers and path parameters), and hypothesis on the session-key parser and
the translators. No 500, no traceback, every error in the API's own shape, and every record the
store holds afterwards intact. The upstream is the stub (NOT vLLM): the proxy is under test.

RLP_FUZZ_EXAMPLES sets the examples per route and store (default 15; `make soak` runs 200).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.support.stack import new_database, read_store
from benchmarks.support.stub_upstream import COMPLETION, stub_app
from proxy.anthropic import to_chat
from proxy.app import create_app
from proxy.errors import BadRequest
from proxy.server import AppThread
from proxy.sessions import MAX_LABEL, parse_key
from proxy.settings import Settings

EXAMPLES = int(os.environ.get("RLP_FUZZ_EXAMPLES", "15"))


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def fuzzed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A proxy on each kind of store: PostgreSQL refuses values SQLite takes (NUL characters)."""
    if request.param == "sqlite":
        db = str(tmp_path_factory.mktemp("fuzz") / "fuzz.db")
    else:
        db = new_database(request.getfixturevalue("postgres"))
    with AppThread(stub_app()) as stub, AppThread(create_app(Settings(upstream=f"{stub.url}/v1", db=db))) as proxy:
        yield proxy.url, db


@pytest.fixture(scope="module")
def proxy_schema(fuzzed: tuple[str, str]) -> Any:
    return schemathesis.openapi.from_url(f"{fuzzed[0]}/openapi.json")


schema = schemathesis.pytest.from_fixture("proxy_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_route_answers_500_or_a_foreign_error_shape(case: Any) -> None:
    response = case.call(timeout=30)
    assert response.status_code < 500, response.text[:500]
    assert "Traceback" not in response.text
    if response.status_code >= 400:
        error = orjson.loads(response.content)
        if case.path.endswith(("/messages", "/messages/count_tokens")):
            assert error["type"] == "error" and error["error"]["message"], error
        else:
            assert error["error"]["message"] and error["error"]["type"], error


def test_after_the_fuzz_every_record_is_intact(fuzzed: tuple[str, str]) -> None:
    """Runs after the fuzz (same module): what was recorded reads back whole."""

    async def everything(store: Any) -> tuple[list[Any], list[Any]]:
        return [c async for c in store.iter_calls()], await store.list_sessions()

    calls, sessions = read_store(fuzzed[1], everything)
    assert calls, "the fuzz recorded no call at all: it did not reach the model routes"
    known = {s.id for s in sessions}
    for call in calls:
        assert call.session_id in known and call.seq >= 1
        assert isinstance(call.request, dict)
        if call.ok:
            assert call.completions and all(c.token_ids == COMPLETION for c in call.completions)
            assert all(len(c.logprobs) == len(COMPLETION) for c in call.completions)
    per_session: dict[str, list[int]] = {}
    for call in calls:
        per_session.setdefault(call.session_id, []).append(call.seq)
    for seqs in per_session.values():
        assert len(seqs) == len(set(seqs))  # no number twice


TEXT = st.text(st.characters(codec="utf-8"), max_size=80)
INT = st.integers(-(2**63), 2**63 - 1)  # what orjson parses a request into (larger ones are floats)
JSON = st.recursive(
    st.none() | st.booleans() | INT | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=20,
)


@given(
    st.text(min_size=1, max_size=400)
    | st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=6).map(lambda pairs: ",".join(f"{k}={v}" for k, v in pairs))
)
@settings(max_examples=EXAMPLES * 20, deadline=None)
def test_any_session_key_parses_to_a_storable_session_or_a_400(key: str) -> None:
    try:
        info = parse_key(key)
    except BadRequest as exc:
        assert "over" in exc.message or ("NUL" in exc.message and "\x00" in key)
        return
    assert info.key == key and info.id and len(info.id) <= MAX_LABEL
    for label in (info.run, info.task_id, info.group_id, *info.metadata.values()):
        assert label is None or len(label) <= MAX_LABEL
    if key.startswith("sk-") and "=" not in key:
        assert key not in info.id


def test_a_tool_that_litellm_refuses_is_a_400() -> None:
    """litellm's translator raises its own UnsupportedParamsError for a tool of the wrong shape
    (`make soak`'s fuzz found the 500)."""
    ask = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    for tool in ({"function": ["x"]}, {"eager_input_streaming": "yes"}):
        with pytest.raises(BadRequest, match="cannot translate"):
            to_chat(ask | {"tools": [{"name": "t", "input_schema": {"type": "object"}, **tool}]})


MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]), "content": JSON}
)
MESSAGES_BODY = st.fixed_dictionaries(
    {},
    optional={
        "model": JSON | TEXT,
        "messages": st.lists(MESSAGE | JSON, max_size=4),
        "max_tokens": JSON | INT,
        "system": JSON,
        "tools": st.lists(JSON, max_size=2),
        "tool_choice": JSON,
        "stop_sequences": JSON,
    },
)


@given(MESSAGES_BODY)
@settings(max_examples=EXAMPLES * 20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_messages_body_translates_or_is_a_400(body: dict[str, Any]) -> None:
    try:
        chat, _, dropped = to_chat(body)
    except BadRequest:
        return
    assert isinstance(chat["messages"], list) and chat["model"] == body["model"] and not dropped.keys() & chat.keys()
    orjson.dumps(chat)  # what goes upstream is plain JSON
