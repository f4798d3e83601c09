"""The YAML config of `rl-proxy collect` (and of the episodes `rl-proxy train` runs).

Unknown keys are refused by name. Paths are relative to the config file. Example:

    run: arithmetic
    tasks: tasks.jsonl          # JSONL, a save_to_disk directory, or a hub dataset ("name:split")
    split: train                # train, heldout, or all (default)
    episodes_per_task: 4        # a GRPO group
    concurrency: 4
    timeout: 120                # seconds per episode
    harness:
      type: python              # python | command | agents_sdk | langchain
      agent: agent.py:agent
    rewards:
      - type: python
        function: agent.py:score
    proxy:
      upstream: null            # attach to this OpenAI-compatible URL; else launch vLLM for `model`
      model: default
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from harness_adapters.episode import (
    Adapter,
    AgentsSdkAdapter,
    CommandAdapter,
    LangChainAdapter,
    PythonAdapter,
    load_callable,
)
from harness_adapters.rewards import Reward


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and the file."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HarnessConfig(_Strict):
    type: Literal["python", "command", "agents_sdk", "langchain"]
    agent: str | None = Field(None, description="python: module:function or file.py:function")
    argv: list[str] | None = Field(None, description="command: the command line, templated")
    env: dict[str, str] = Field(default_factory=dict, description="command: extra variables, templated")
    files: dict[str, str] = Field(default_factory=dict, description="command: files to write in the workdir")
    make_agent: str | None = Field(None, description="agents_sdk, langchain: the factory")
    api: Literal["responses", "chat"] = "responses"
    use_responses_api: bool = False
    max_turns: int = 10

    @model_validator(mode="after")
    def needed(self) -> HarnessConfig:
        need = {"python": "agent", "command": "argv", "agents_sdk": "make_agent", "langchain": "make_agent"}[self.type]
        if not getattr(self, need):
            raise ValueError(f"a {self.type} harness needs '{need}'")
        return self


class RewardConfig(_Strict):
    type: Literal["python", "command", "harness", "judge"]
    weight: float = 1.0
    function: str | None = None
    command: list[str] | None = None
    timeout: float = 120.0
    rubric: str | None = None
    judge_model: str | None = None
    judge_base_url: str | None = None
    judge_api_key_env: str | None = Field(None, description="the variable holding the judge's API key")


class ProxyConfig(_Strict):
    url: str | None = Field(None, description="use this running rl-proxy (its root URL) instead of starting one")
    admin_token: str | None = None
    upstream: str | None = Field(None, description="attach the proxy to this OpenAI-compatible base URL")
    model: str = Field("default", description="launch vLLM for this model when there is no upstream")
    db: str | None = Field(None, description="the store [default: <out>/rl-proxy.db]")
    max_model_len: int | None = None
    max_completion_tokens: int | None = None
    token_ids: bool = Field(True, description="false for an upstream other than vLLM: calls recorded as text")
    upstream_api_key_env: str | None = Field(None, description="the variable holding the upstream's API key")
    vllm_args: list[str] = Field(default_factory=list, description="extra arguments of a launched vLLM")


class CollectConfig(_Strict):
    run: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    tasks: str
    split: Literal["train", "heldout", "all"] = "all"
    episodes_per_task: int = Field(1, ge=1)
    concurrency: int = Field(4, ge=1)
    timeout: float = Field(600.0, gt=0)
    success_at: float = Field(1.0, description="an episode succeeds with at least this reward")
    out: str | None = Field(None, description="workdirs, results and the store [default: runs/<run>]")
    harness: HarnessConfig
    rewards: list[RewardConfig] = Field(default_factory=list)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)

    base: Path = Field(Path("."), exclude=True, description="the config file's directory")

    def path(self, value: str) -> str:
        """A path from the config, relative to the config file (module references pass through)."""
        head, sep, name = value.rpartition(":")
        if sep and head.endswith(".py"):
            return f"{self.path(head)}:{name}"
        candidate = self.base / value
        return str(candidate) if not Path(value).is_absolute() and candidate.exists() else value

    @property
    def out_dir(self) -> Path:
        return Path(self.out) if self.out else Path("runs") / self.run

    def adapter(self) -> Adapter:
        h = self.harness
        try:
            if h.type == "python":
                return PythonAdapter(load_callable(self.path(h.agent or "")))
            if h.type == "command":
                return CommandAdapter(list(h.argv or []), h.env, h.files)
            factory = load_callable(self.path(h.make_agent or ""))
            if h.type == "agents_sdk":
                return AgentsSdkAdapter(factory, h.api, h.max_turns)
            return LangChainAdapter(factory, h.use_responses_api)
        except (ValueError, ImportError, OSError) as exc:
            raise ConfigError(f"harness: {exc}") from exc

    def reward_sources(self) -> list[Reward]:
        sources = []
        for i, r in enumerate(self.rewards):
            fields = r.model_dump(exclude={"judge_api_key_env"})
            if r.function:
                fields["function"] = self.path(r.function)
            key = os.environ.get(r.judge_api_key_env) if r.judge_api_key_env else None
            try:
                sources.append(Reward(**fields, judge_api_key=key))
            except (ValueError, ImportError, OSError) as exc:
                raise ConfigError(f"rewards[{i}]: {exc}") from exc
        return sources


C = TypeVar("C", bound=CollectConfig)


def load_config(path: str | Path, kind: type[C]) -> C:
    path = Path(path)
    try:
        raw: Any = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the config must be a YAML mapping")
    if "base" in raw:
        raise ConfigError(f"{path}: base: extra inputs are not permitted")
    try:
        return kind.model_validate({**raw, "base": path.resolve().parent})
    except ValidationError as exc:
        problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise ConfigError(f"{path}: " + "; ".join(problems)) from exc
