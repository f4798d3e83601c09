"""The session graph (recorder/graph.py) on calls a real SDK made through the proxy: the openai
SDK's own retry, after a timeout shorter than the call, against the STUB upstream (not vLLM)
whose first answer is slow."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest

from benchmarks.support.stub_upstream import MODEL, stub_app
from proxy.server import AppThread
from recorder.graph import place
from recorder.validation import check


def test_the_openai_sdks_retry_is_linked_to_its_original_and_only_it_is_trained(make_proxy: Any) -> None:
    with AppThread(stub_app(first_latency=2.5)) as stub:
        proxy = make_proxy(f"{stub.url}/v1")
        client = openai.OpenAI(base_url=proxy.v1, api_key="s-retry", timeout=1.0, max_retries=1)
        ask = [{"role": "user", "content": "hi"}]
        answer = client.chat.completions.create(model=MODEL, messages=ask)  # type: ignore[arg-type]
        follow = [*ask, {"role": "assistant", "content": answer.choices[0].message.content}]
        client.chat.completions.create(model=MODEL, messages=[*follow, {"role": "user", "content": "and?"}])  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while len(calls := proxy.calls("s-retry")) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)  # the timed-out call is recorded once the upstream's slow answer comes
    assert [c.http_status for c in calls] == [499, 200, 200]  # the first timed out at the client, then was re-sent
    placed = place(calls)
    assert [(p.edge, p.parent) for p in placed] == [("new", None), ("retry", 1), ("continue", 2)]
    assert [p.trained for p in placed] == [False, True, True]
    assert check(calls).grade.level in ("OK", "INFO")


@pytest.fixture(autouse=True)
def _quiet_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK waits about 0.5-1 s before its retry; no need to wait longer."""
    monkeypatch.setattr(openai._base_client, "INITIAL_RETRY_DELAY", 0.1, raising=False)
