"""Reasoning text through the proxy, from a real vLLM CPU server of this module's own started with
a reasoning parser. vLLM's `olmo3` parser runs with the default model (it matches `</think>` as
text) and, streaming, calls everything before `</think>` reasoning; SmolLM2 never writes that, so
every streamed token arrives as vLLM 0.32's `delta.reasoning`."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from openai import OpenAI

from proxy.model import resolve_model
from proxy.vllm import VllmServer

pytestmark = pytest.mark.vllm

ASK = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def thinking_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of a vLLM with `--reasoning-parser olmo3` (RLP_TEST_REASONING_UPSTREAM: one
    started elsewhere)."""
    given = os.environ.get("RLP_TEST_REASONING_UPSTREAM")
    if given:
        yield given
        return
    path, name = resolve_model("default")
    log: Path = tmp_path_factory.mktemp("vllm-reasoning") / "vllm.log"
    extra = ["--enforce-eager", "--reasoning-parser", "olmo3"]
    with VllmServer(path, name, log_file=log, max_model_len=4096, extra_args=extra) as server:
        yield server.base_url


def test_streamed_reasoning_reaches_every_api_and_the_record(make_proxy: Any, thinking_vllm: str) -> None:
    proxy = make_proxy(thinking_vllm)
    model = OpenAI(base_url=thinking_vllm, api_key="x").models.list().data[0].id
    openai = OpenAI(base_url=proxy.v1, api_key="r-chat", max_retries=0)
    chat = list(openai.chat.completions.create(model=model, messages=ASK, max_tokens=12, temperature=0, stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in chat if c.choices)
    assert reasoning.strip() and not any(c.choices[0].delta.content for c in chat if c.choices)

    claude = anthropic.Anthropic(base_url=proxy.url, api_key="r-messages", max_retries=0)
    with claude.messages.stream(model=model, max_tokens=12, messages=ASK, extra_body={"temperature": 0}) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    thinking = [block for block in message.content if block.type == "thinking"]
    assert thinking and thinking[0].thinking == reasoning and "message_stop" in kinds

    openai = OpenAI(base_url=proxy.v1, api_key="r-responses", max_retries=0)
    events = list(
        openai.responses.create(model=model, input=ASK[0]["content"], max_output_tokens=12, temperature=0, stream=True)
    )
    assert events[-1].type == "response.incomplete"  # max_output_tokens
    items = [item for item in events[-1].response.output if item.type == "reasoning"]
    assert any(e.type.startswith("response.reasoning") for e in events) and items
    shown = "".join(part.text for item in items for part in (item.content or []) or item.summary)
    assert shown == reasoning

    for key in ("r-chat", "r-messages", "r-responses"):
        [call] = proxy.calls(key)
        assert call.ok and len(call.completions[0].token_ids) == 12, key
    [messages_call] = proxy.calls("r-messages")
    assert messages_call.response is not None
    assert [b["thinking"] for b in messages_call.response["content"] if b["type"] == "thinking"] == [reasoning]
