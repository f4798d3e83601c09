"""The YAML config of `rl-proxy collect` (and of the episodes `rl-proxy train` runs).

Unknown keys are refused by name. Paths are relative to the config file. Example:

    run: arithmetic
    tasks: tasks.jsonl          # JSONL, a save_to_disk directory, or a hub dataset ("name:split")
    split: train                # train, heldout, or all (default)
    episodes_per_task: 4        # a GRPO group
    concurrency: 4
    timeout: 120                # seconds per episode
    harness:
      type: python              # python | command | mini | claude-code | codex | agents_sdk | langchain
      agent: agent.py:agent
    environment:
      type: host                # host | bubblewrap | container (harness_adapters/environments/)
    rollouts:
      engine: local             # local | ray (harness_adapters/engines.py)
    rewards:
      - type: python
        function: agent.py:score
    proxy:
      upstream: null            # attach to this OpenAI-compatible URL; else launch vLLM for `model`
      model: default
    sampling:                   # set on every call, whatever the harness asks (optional)
      tool_choice: required     # e.g. a small model in Claude Code calls a tool every turn
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from harness_adapters.engines import LocalRollouts, RolloutsConfig
from harness_adapters.environments import ContainerEnvironment, Environment, HostEnvironment
from harness_adapters.harnesses import (
    Adapter,
    AgentsSdkAdapter,
    CommandAdapter,
    LangChainAdapter,
    PresetError,
    PresetName,
    PythonAdapter,
    load_callable,
    preset,
)
from harness_adapters.rewards import Reward, RewardSource
from harness_adapters.tasks import Task
from proxy.settings import Settings
from recorder.episodes import Sampling


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and the file."""


class Strict(BaseModel):
    """Unknown keys are refused by name."""

    model_config = ConfigDict(extra="forbid")


class PythonHarness(Strict):
    """An agent written as a Python function, run in this process."""

    type: Literal["python"]
    agent: str = Field(description="module:function or file.py:function")

    def adapter(self, path: Callable[[str], str]) -> Adapter:
        return PythonAdapter(load_callable(path(self.agent)))


class CommandHarness(Strict):
    """Any CLI harness, run as a process in the episode's workdir."""

    type: Literal["command"]
    argv: list[str] = Field(description="the command line, templated; a file beside the config is found there")
    env: dict[str, str] = Field(default_factory=dict, description="extra variables, templated")
    files: dict[str, str] = Field(default_factory=dict, description="files to write in the workdir")

    def adapter(self, path: Callable[[str], str]) -> Adapter:
        return CommandAdapter([path(arg) for arg in self.argv], self.env, self.files)


class AgentsSdkHarness(Strict):
    """An OpenAI Agents SDK agent, from a factory."""

    type: Literal["agents_sdk"]
    make_agent: str = Field(description="the factory: module:function or file.py:function")
    api: Literal["responses", "chat"] = "responses"
    max_turns: int = 10

    def adapter(self, path: Callable[[str], str]) -> Adapter:
        return AgentsSdkAdapter(load_callable(path(self.make_agent)), self.api, self.max_turns)


class LangChainHarness(Strict):
    """A LangChain or LangGraph runnable, from a factory."""

    type: Literal["langchain"]
    make_agent: str = Field(description="the factory: module:function or file.py:function")
    use_responses_api: bool = False

    def adapter(self, path: Callable[[str], str]) -> Adapter:
        return LangChainAdapter(load_callable(path(self.make_agent)), self.use_responses_api)


class PresetHarness(Strict):
    """mini-swe-agent, Claude Code or Codex CLI, unchanged, inside the episode's container, its
    runtime mounted from this machine (harnesses/presets.py)."""

    type: PresetName
    args: list[str] = Field(default_factory=list, description="more arguments for its command line, templated")
    env: dict[str, str] = Field(default_factory=dict, description="extra variables, templated")
    files: dict[str, str] = Field(
        default_factory=dict, description="more files written before it starts (path: text), templated"
    )
    runtime: str | None = Field(None, description="the host path of its runtime [default: found on this machine]")

    def command(self) -> CommandHarness:
        found = preset(self.type, self.runtime)
        return CommandHarness(
            type="command",
            argv=found.argv + self.args,
            env={**found.env, **self.env},
            files={**found.files, **self.files},
        )


# The kinds a config's `harness:` may name, told apart by `type`.
HarnessConfig = Annotated[
    PythonHarness | CommandHarness | PresetHarness | AgentsSdkHarness | LangChainHarness, Field(discriminator="type")
]


class ProxyConfig(Settings):
    """The `proxy:` section: any setting of `rl-proxy serve`, by the same names (see
    proxy/settings.py), plus a running proxy to use instead of starting one (`url`) and the
    variable that holds the upstream's API key. The store defaults to `<out>/rl-proxy.db`."""

    url: str | None = Field(None, description="use this running rl-proxy (its root URL) instead of starting one")
    upstream_api_key_env: str | None = Field(None, description="the variable holding the upstream's API key")

    @model_validator(mode="after")
    def _one_process(self) -> ProxyConfig:
        if self.workers > 1 and self.url is None:  # the run's own proxy is a thread of the run
            raise ValueError(
                "workers: the run's own proxy is one process; run `rl-proxy serve --workers N` and give its URL as url"
            )
        return self

    def settings(self, out_dir: Path) -> Settings:
        """The proxy's settings for a run whose outputs go to `out_dir`."""
        given = self.model_dump(exclude={"url", "upstream_api_key_env"})
        if "db" not in self.model_fields_set:
            given["db"] = str(out_dir / "rl-proxy.db")
        if self.upstream_api_key_env:
            given["upstream_api_key"] = os.environ.get(self.upstream_api_key_env)
        return Settings(**given)


class CollectConfig(Strict):
    run: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    tasks: str
    split: Literal["train", "heldout", "all"] = "all"
    episodes_per_task: int = Field(1, ge=1)
    concurrency: int = Field(4, ge=1)
    timeout: float = Field(600.0, gt=0)
    success_at: float = Field(1.0, description="an episode succeeds with at least this reward")
    out: str | None = Field(None, description="workdirs, results and the store [default: runs/<run>]")
    harness: HarnessConfig
    environment: Environment = Field(default_factory=HostEnvironment)
    rollouts: RolloutsConfig = Field(default_factory=LocalRollouts)
    rewards: list[Reward] = Field(default_factory=list)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    sampling: Sampling | None = Field(
        None,
        description="set by the proxy on every call of an episode, whatever the harness asks: temperature, top_p, "
        "top_k, seed, tool_choice (`required`, or a tool's name: Claude Code's Agent)",
    )

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
        harness = self.harness
        if isinstance(harness, PresetHarness):
            if not isinstance(self.environment, ContainerEnvironment):
                raise ConfigError(f"harness: the {harness.type} preset runs in `environment: {{type: container}}`")
            try:
                harness = harness.command()
            except PresetError as exc:
                raise ConfigError(f"harness: {exc}") from exc
        if isinstance(harness, CommandHarness):  # its argv in the environment's sandbox, if any
            harness = harness.model_copy(update={"argv": self.environment.wrap(harness.argv)})
        elif isinstance(self.environment, ContainerEnvironment):
            raise ConfigError(f"environment: a container runs a command harness inside it, not a {harness.type} one")
        try:
            return harness.adapter(self.path)
        except (ValueError, ImportError, OSError) as exc:
            raise ConfigError(f"harness: {exc}") from exc

    def resolved_environment(self) -> Environment:
        """The environment with its mounts relative to the config's directory."""
        if isinstance(self.environment, ContainerEnvironment):
            mounts = {self.path(host): inside for host, inside in self.environment.mounts.items()}
            if isinstance(self.harness, PresetHarness):  # its runtime (adapter() named what is missing)
                mounts |= preset(self.harness.type, self.harness.runtime).mounts
            return self.environment.model_copy(update={"mounts": mounts})
        return self.environment

    def check_tasks(self, tasks: list[Task]) -> None:
        """Harbor tasks need a container: their image, and their tests run inside it."""
        harbor = [t.id for t in tasks if t.harbor is not None]
        if harbor and not isinstance(self.environment, ContainerEnvironment):
            raise ConfigError(
                f"tasks {', '.join(harbor[:5])}{' ...' if len(harbor) > 5 else ''} are Harbor tasks: they run in "
                f"`environment: {{type: container}}`, not {self.environment.type}"
            )

    def reward_sources(self) -> list[RewardSource]:
        """The rewards with their references resolved (one that cannot be loaded is named now,
        before any episode runs)."""
        sources = []
        for i, source in enumerate(self.rewards):
            gateway = isinstance(self.environment, ContainerEnvironment) and self.environment.network == "gateway"
            if source.type == "harness" and gateway:
                raise ConfigError(
                    f"rewards[{i}]: a harness reward is what the agent posts itself, and a container's agent "
                    "cannot reach the admin API (docs/environments.md): score it with its tests or another source"
                )
            try:
                sources.append(source.resolved(self.path))
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
