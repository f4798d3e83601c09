"""Token-in against the real vLLM CPU server: a tool-using session through real SDKs becomes one
training sequence whose masked-in tokens are exactly the sampled ids, where the chat template
(SmolLM2's drops tool calls) breaks it into one sequence per call in messages mode."""

from __future__ import annotations

import signal
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from benchmarks.support.sessions import (
    anthropic_session,
    masked_in,
    responses_session,
    sampled,
    think_session,
    tool_session,
)
from benchmarks.support.stack import Upstream, direct_chat, process, read_store
from proxy.vllm import free_port
from recorder import CallRecord, Store
from recorder.graph import build_sequences

pytestmark = pytest.mark.vllm


def assert_one_exact_sequence(calls: list[CallRecord]) -> None:
    report = build_sequences(calls)
    [sequence] = report.sequences
    assert [span.seq for span in sequence.spans] == [c.seq for c in calls]
    assert masked_in(sequence) == sampled(sequence, calls)
    logprobs = [lp for c in calls for lp in c.completions[0].logprobs]
    assert [lp for lp, m in zip(sequence.logprobs, sequence.loss_mask, strict=True) if m] == logprobs
    assert [c.token_in for c in calls] == [False] + [True] * (len(calls) - 1)
    assert calls[0].thread_start == "first call of the session seen by this proxy"
    assert all(c.thread_start is None for c in calls[1:])


def bridging(path: str, make_proxy: Any, vllm: Upstream, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A proxy in front of the test's vLLM whose bridges are made by vLLM (rl-proxy's plugin,
    proxy/bridge.py: "bridged") or by the proxy from a `/tokenize` of each continuing call."""
    if path == "tokenize":  # a proxy that finds no bridging card
        monkeypatch.setattr("proxy.upstream.CARD", "no-such-card")
    proxy = make_proxy(vllm.url)
    if vllm.log is not None:  # this environment's vLLM, with its plugins
        assert httpx.get(f"{proxy.url}/healthz").json()["upstreams"][0]["bridges"] is (path == "bridged")
    return proxy


@pytest.mark.parametrize(("stream", "path"), [(False, "bridged"), (True, "bridged"), (False, "tokenize")])
def test_a_tool_calling_session_is_one_exact_sequence(
    make_proxy: Any, vllm: Upstream, stream: bool, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = bridging(path, make_proxy, vllm, monkeypatch)
    tool_session(proxy.v1, "ti-tools", vllm.model, stream)
    assert_one_exact_sequence(proxy.calls("ti-tools"))


def test_a_tool_calling_session_is_one_exact_sequence_across_proxies_on_one_store(
    make_proxy: Any, vllm: Upstream, tmp_path: Path
) -> None:
    """Each call to another proxy on one store, as round robin behind a load balancer sends them
    (the third a proxy that never saw the session, as after a restart): each reads the thread
    back from the store. With threads in one proxy's memory, every call started a new one."""
    db = str(tmp_path / "shared.db")
    proxies = [make_proxy(vllm.url, db=db) for _ in range(3)]
    tool_session([p.v1 for p in proxies], "ti-across", vllm.model)
    assert_one_exact_sequence(proxies[0].calls("ti-across"))


def test_a_tool_calling_session_is_one_exact_sequence_though_its_proxy_is_killed_between_calls(
    vllm: Upstream, tmp_path: Path
) -> None:
    """`rl-proxy serve` in a process of its own, stopped after each call and started again (as a
    supervisor restarts it) before the next: with SIGTERM after the first call, SIGKILL after
    the second. Each new process reads the thread back from the store."""
    db = str(tmp_path / "calls.db")
    with ExitStack() as running:
        served: list[subprocess.Popen[bytes]] = []

        def restarted(turn: int) -> str:
            if served:
                served[-1].send_signal([signal.SIGTERM, signal.SIGKILL][turn - 1])
                served[-1].wait(30)
            port = free_port()
            cmd = [sys.executable, "-m", "proxy.cli", "serve", "--upstream", vllm.url, "--db", db, "--port", str(port)]
            health, log = f"http://127.0.0.1:{port}/healthz", tmp_path / f"proxy-{turn}.log"
            served.append(running.enter_context(process(cmd, health, log)))
            return f"http://127.0.0.1:{port}/v1"

        tool_session(restarted, "ti-restarts", vllm.model)
    assert [p.returncode for p in served[:2]] == [0, -signal.SIGKILL]  # SIGTERM stops it cleanly
    assert_one_exact_sequence(read_store(db, lambda s: _calls(s, "ti-restarts")))


async def _calls(store: Store, session_id: str) -> list[CallRecord]:
    return [c async for c in store.iter_calls(session_id)]


def test_in_messages_mode_the_template_breaks_the_same_session_apart(make_proxy: Any, vllm: Upstream) -> None:
    proxy = make_proxy(vllm.url, messages_mode=True)
    tool_session(proxy.v1, "ti-messages", vllm.model)
    calls = proxy.calls("ti-messages")
    assert len(build_sequences(calls).sequences) == 3 and not any(c.token_in for c in calls)


def test_an_anthropic_tool_use_round_trip_is_one_sequence(make_proxy: Any, vllm: Upstream) -> None:
    proxy = make_proxy(vllm.url)
    anthropic_session(proxy.url, "ti-claude", vllm.model)
    assert_one_exact_sequence(proxy.calls("ti-claude"))


def test_a_responses_function_call_chain_is_one_sequence(make_proxy: Any, vllm: Upstream) -> None:
    proxy = make_proxy(vllm.url)
    responses_session(proxy.v1, "ti-responses", vllm.model)
    assert_one_exact_sequence(proxy.calls("ti-responses"))


def test_an_edited_history_starts_a_new_thread_and_says_why(make_proxy: Any, vllm: Upstream) -> None:
    proxy = make_proxy(vllm.url)
    client = OpenAI(base_url=proxy.v1, api_key="ti-edit", max_retries=0)
    ask = [{"role": "user", "content": "What is 2 + 3? Answer with one number."}]
    first = client.chat.completions.create(model=vllm.model, messages=ask, max_tokens=30, temperature=0)
    assert first.choices[0].finish_reason == "stop"  # so the end-of-turn token is known
    answer = {"role": "assistant", "content": first.choices[0].message.content}
    edited = {"role": "assistant", "content": "Something the model never said."}
    for said in (edited, answer):
        client.chat.completions.create(
            model=vllm.model, messages=[*ask, said, {"role": "user", "content": "Go on."}], max_tokens=8, temperature=0
        )
    _, rewritten, continued = proxy.calls("ti-edit")
    assert not rewritten.token_in and rewritten.thread_start == "message 2 is not the assistant answer sampled there"
    assert continued.token_in and continued.thread_start is None
    shown = build_sequences([_, rewritten])
    assert shown.breaks and shown.breaks[0].thread_start == rewritten.thread_start


def test_a_template_that_strips_earlier_thinking_still_gives_one_sequence(make_proxy: Any, vllm: Upstream) -> None:
    token_in, messages_mode = make_proxy(vllm.url), make_proxy(vllm.url, messages_mode=True)
    think_session(token_in.v1, "ti-think", vllm.model)
    think_session(messages_mode.v1, "ti-think", vllm.model)
    assert_one_exact_sequence(token_in.calls("ti-think"))
    assert len(build_sequences(messages_mode.calls("ti-think")).sequences) == 4


# A template that shows what vLLM's chat route hands it besides the messages.
INPUTS = {
    "chat_template": (Path(__file__).parents[2] / "benchmarks" / "support" / "inputs_template.jinja").read_text(),
    "reasoning_effort": "low",
    "documents": [{"title": "a", "text": "b"}, {"title": "c", "text": "d"}],
}


@pytest.mark.parametrize(
    ("extra", "path"),
    [({}, "bridged"), (INPUTS, "bridged"), ({}, "tokenize"), (INPUTS, "tokenize")],
    ids=["smollm2", "template-inputs", "smollm2-tokenize", "template-inputs-tokenize"],
)
def test_on_text_the_bridge_is_what_the_template_renders(
    make_proxy: Any, vllm: Upstream, extra: dict[str, Any], path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SmolLM2's template is append-only on plain text: there a token-in prompt must be exactly
    vLLM's own rendering of the whole conversation (when the answer re-tokenizes as sampled),
    which checks the bridge's content and not only that it extends the thread. So must it be with
    the inputs vLLM's chat route gives a template (`reasoning_effort`, `documents`), whether vLLM
    or the proxy cuts the bridge."""
    proxy = bridging(path, make_proxy, vllm, monkeypatch)
    client = OpenAI(base_url=proxy.v1, api_key="ti-text", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3? Answer with one number."}]
    for ask in ("And 4 + 4?", "And 1 + 1?"):
        reply = client.chat.completions.create(
            model=vllm.model,
            messages=messages,
            max_tokens=30,
            temperature=0,  # type: ignore[arg-type]
            extra_body=extra,
        )
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": ask},
        ]
    client.chat.completions.create(model=vllm.model, messages=messages, max_tokens=30, temperature=0, extra_body=extra)  # type: ignore[arg-type]
    calls = proxy.calls("ti-text")
    assert [c.token_in for c in calls] == [False, True, True], [c.thread_start for c in calls]
    for n, call in ((3, calls[1]), (5, calls[2])):
        rendered = direct_chat(vllm, messages=messages[:n], max_tokens=1, temperature=0, **extra)["prompt_token_ids"]
        assert call.prompt_token_ids == rendered


# A template that shows the model only the last message: no bridge can be cut from its renderings.
LAST_ONLY = (
    "{% for m in messages[-1:] %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("path", ["bridged", "tokenize"])
def test_a_template_that_drops_turns_starts_a_new_thread_and_says_why(
    make_proxy: Any, vllm: Upstream, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prompt is then vLLM's own rendering, recorded as a new thread: with the reason when the
    proxy cut the bridge, with where to read it (vLLM's log) when vLLM was to."""
    proxy = bridging(path, make_proxy, vllm, monkeypatch)
    client = OpenAI(base_url=proxy.v1, api_key="ti-last", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say hi."}]
    ask = {"model": vllm.model, "max_tokens": 8, "temperature": 0, "extra_body": {"chat_template": LAST_ONLY}}
    reply = client.chat.completions.create(messages=messages, **ask)  # type: ignore[call-overload]
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "Again."},
    ]
    client.chat.completions.create(messages=messages, **ask)  # type: ignore[call-overload]
    _, second = proxy.calls("ti-last")
    assert not second.token_in
    assert (
        second.prompt_token_ids
        == direct_chat(vllm, messages=messages, max_tokens=1, **ask["extra_body"])["prompt_token_ids"]
    )
    if httpx.get(f"{proxy.url}/healthz").json()["upstreams"][0]["bridges"]:
        assert second.thread_start == "the upstream did not bridge the thread (its log says why)"
        assert vllm.log is None or "is not bridged (the template renders" in vllm.log.read_text(errors="replace")
    else:
        assert str(second.thread_start).startswith("the template renders the conversation with 1 end-of-turn tokens")
