"""Harness presets: mini-swe-agent, Claude Code and Codex CLI, unchanged, each one config line
(`harness: {type: mini}`, `{type: claude-code}`, `{type: codex}`), run *inside* the episode's
container (`environment: {type: container}`): the model's commands act on the task's files with
the task's toolchain, the task's tests score what they did, and the harness reaches the model only
through the episode's gateway (docs/environments.md).

Each harness's runtime comes from this machine, mounted read-only under /opt/rl-proxy (nothing is
installed into the task's image):

- claude-code: Claude Code's native executable (npm @anthropic-ai/claude-code, which `make
  install` puts in .harnesses/); the image needs glibc 2.17 or newer.
- codex: Codex CLI's static (musl) executable (npm @openai/codex); any image.
- mini: mini-swe-agent from this interpreter's site-packages, run by the image's python3 with its
  text-based config and model class; the image's Python must be this one's minor version (3.11: Debian bookworm,
  the tasks' base image). For another image, point `runtime` at a folder filled with
  `pip install --target DIR --python-version X.Y --only-binary=:all: mini-swe-agent`.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from harness_adapters.harnesses.base import command_env

PresetName = Literal["mini", "claude-code", "codex"]
INSIDE = "/opt/rl-proxy"
# Where `make install` puts the npm harnesses of a checkout.
CHECKOUT_BIN = Path(__file__).resolve().parents[2] / ".harnesses" / "node_modules" / ".bin"


class PresetError(ValueError):
    """A preset's runtime is not on this machine: the message says how to get it."""


@dataclass(frozen=True)
class Preset:
    """A command harness's parts (templated as CommandAdapter's) and what the container mounts."""

    argv: list[str]
    env: dict[str, str]
    files: dict[str, str]
    mounts: dict[str, str]  # host path -> container path, read-only


def preset(name: PresetName, runtime: str | None = None) -> Preset:
    """The preset `name`, its runtime at `runtime` (a host path) or found on this machine."""
    if name == "mini":
        found = Path(runtime) if runtime else Path(sysconfig.get_paths()["purelib"])
        if not (found / "minisweagent").is_dir():
            raise PresetError(f"mini: no mini-swe-agent in {found}: pip install mini-swe-agent (or set runtime)")
        return Preset(
            [
                *("python3", "-m", "minisweagent.run.mini", "-c", "mini_textbased.yaml"),
                *("--model-class", "litellm_textbased", "-m", "openai/{model}", "-t", "{prompt}"),
                *("--yolo", "--exit-immediately", "-o", "/logs/agent/trajectory.json"),
            ],
            {
                "PYTHONPATH": f"{INSIDE}/python",
                "MSWEA_CONFIGURED": "true",
                "MSWEA_COST_TRACKING": "ignore_errors",
                "MSWEA_GLOBAL_CONFIG_DIR": "/tmp/mini",
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # the container has no network to fetch it
            },
            {},
            {str(found): f"{INSIDE}/python"},
        )
    if name == "claude-code":
        binary = _executable(runtime, "claude", "npm install @anthropic-ai/claude-code")
        return Preset(
            [
                *(f"{INSIDE}/claude", "-p", "{prompt}", "--model", "claude-sonnet-4-5"),
                *("--dangerously-skip-permissions", "--tools", "Bash,Read,Write,Edit"),  # all its tools: over 8,192
            ],
            # Its permission prompts are skipped (IS_SANDBOX lets it as root): the container is the sandbox.
            {"IS_SANDBOX": "1", "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"},
            {},
            {str(binary): f"{INSIDE}/claude"},
        )
    binary = _executable(runtime, "codex", "npm install @openai/codex")
    config = (
        'model = "gpt-5-codex"\nmodel_provider = "rlp"\nweb_search = "disabled"\n[model_providers.rlp]\n'
        'name = "rl-proxy"\nbase_url = "{openai_base_url}"\nenv_key = "RLP_SESSION_KEY"\nwire_api = "responses"\n'
    )
    return Preset(
        [f"{INSIDE}/codex", "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", "{prompt}"],
        {"CODEX_HOME": "/tmp/codex"},
        {"/tmp/codex/config.toml": config},
        {str(binary): f"{INSIDE}/codex"},
    )


def _executable(runtime: str | None, command: str, install: str) -> Path:
    """The native executable of an npm harness: `runtime`, else `command` on PATH or in the
    checkout's .harnesses/ (npm's launcher script followed to the platform package's binary)."""
    path = os.pathsep.join([command_env()["PATH"], str(CHECKOUT_BIN)])
    found = Path(runtime) if runtime else Path(shutil.which(command, path=path) or command)
    if not found.is_file():
        raise PresetError(f"{command}: not found on PATH or in {CHECKOUT_BIN} ({install}, or set runtime)")
    found = found.resolve()
    if not _is_elf(found):  # Codex's launcher (bin/codex.js) runs the binary of its platform's package
        vendor = sorted(found.parents[2].glob(f"{command}-linux-*/vendor/*/bin/{command}"))
        if not vendor:
            raise PresetError(f"{command}: {found} is a script, and no native {command} executable is beside it")
        found = vendor[0]
    if sys.platform != "linux" or not _is_elf(found):
        raise PresetError(f"{command}: {found} is not a Linux executable, which the container could run")
    return found


def _is_elf(path: Path) -> bool:
    with open(path, "rb") as file:
        return file.read(4) == b"\x7fELF"
