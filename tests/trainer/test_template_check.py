"""`rl-proxy doctor`'s template check on the default model and on templates built to fail."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from proxy.model import prepare_default_model
from trainer.template_check import check_template

TURN = "<|im_start|>{{ m.role }}\n"
APPEND_ONLY = (
    "{% for m in messages %}" + TURN + "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
    "{% endif %}{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Like Qwen3's: reasoning is shown only in the last assistant turn.
DROPS_REASONING = APPEND_ONLY.replace("{% if m.reasoning_content %}", "{% if m.reasoning_content and loop.last %}")
DATED = "Today is {{ strftime_now('%Y-%m-%d') }}.\n" + APPEND_ONLY


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(prepare_default_model())


def with_template(tokenizer: Any, template: str | None) -> Any:
    copy = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    copy.chat_template = template
    return copy


def test_default_model_template(tokenizer: Any) -> None:
    found = {(f.conversation, f.problem) for f in check_template(tokenizer)}
    assert ("tools", "drops tool calls from the assistant's turn") in found
    assert ("reasoning", "does not render the assistant's reasoning") in found
    assert not any(conversation == "plain" for conversation, _ in found)  # plain chat merges


def test_append_only_template_has_no_findings(tokenizer: Any) -> None:
    assert check_template(with_template(tokenizer, APPEND_ONLY)) == []


def test_template_that_drops_earlier_reasoning(tokenizer: Any) -> None:
    [finding] = check_template(with_template(tokenizer, DROPS_REASONING))
    assert (finding.conversation, finding.turn, finding.problem) == ("reasoning", 1, "drops earlier reasoning")
    assert "Two plus two" in finding.detail


def test_template_that_adds_the_date(tokenizer: Any) -> None:
    problems = {f.problem for f in check_template(with_template(tokenizer, DATED))}
    assert any("current date" in p for p in problems)


def test_no_template(tokenizer: Any) -> None:
    [finding] = check_template(with_template(tokenizer, None))
    assert finding.problem == "the tokenizer has no chat template"
