"""Proxy and recorder settings: one pydantic-settings class, from the environment (RLP_*) and
from CLI flags."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from recorder.paths import data_dir, default_db

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class Settings(BaseSettings):
    """Everything `rl-proxy serve` needs. Each field reads `RLP_<NAME>` from the environment."""

    model_config = SettingsConfigDict(env_prefix="RLP_", extra="forbid")

    upstream: str | None = Field(
        None, description="OpenAI-compatible base URL (http://HOST:PORT/v1); none: launch vLLM"
    )
    model: str = Field("default", description="model to launch: 'default', an HF dir or hub name")
    served_model_name: str | None = Field(None, description="name clients use; default: derived")
    db: str = Field(default_factory=default_db, description="SQLAlchemy URL or SQLite path")
    host: str = Field("127.0.0.1", description="address to bind (off loopback, /admin needs a token)")
    port: int = Field(8000, description="port to bind")
    workers: int = Field(1, ge=1, description="processes serving the port, each a core's worth of calls")
    admin_token: str | None = Field(None, description="bearer token of /admin (needed off loopback)")
    create_sessions: bool = Field(True, description="create unknown sessions on first use")
    max_body_bytes: int = 32 * 1024 * 1024
    body_timeout: float = Field(60.0, description="seconds a client may take to send its request body")
    # What harnesses ask for that the backend cannot serve; every rewrite is recorded with the call.
    model_aliases: dict[str, str] = Field(default_factory=dict, description="requested model -> served model")
    route_unknown_models: bool = Field(True, description="send models the upstream does not serve to the policy")
    policy_model: str | None = Field(None, description="the served model to route to; default: the first served")
    max_completion_tokens: int | None = Field(
        2048, description="cap on a completion's length (harnesses often ask for none, or 32000)"
    )
    max_choices: int = Field(16, description="largest 'n' (choices per call) a client may ask for")
    # Per-process caches, each a shortcut to the store: what they cannot hold is read back.
    thread_cache_mb: float = Field(256, gt=0, description="MiB of token-in threads kept in memory")
    response_cache_mb: float = Field(64, gt=0, description="MiB of Responses answers kept in memory")
    # Any other OpenAI-compatible upstream (a provider, a litellm proxy): calls are recorded as
    # text, without token ids, for distillation or evaluation; trajectories skip them.
    upstream_token_ids: bool = Field(True, description="ask the upstream for token ids and logprobs (vLLM)")
    messages_mode: bool = Field(
        False, description="no token-in: the upstream renders every call's messages itself, as the harness sent them"
    )
    upstream_api_key: str | None = Field(None, description="sent upstream as a Bearer token")
    upstream_timeout: float = Field(600.0, description="seconds to wait for upstream data")
    upstream_connect_timeout: float = 10.0
    version_poll_interval: float = Field(1.0, description="seconds between GET /weight_info")
    # Launching vLLM
    vllm_port: int = Field(0, description="port of a launched vLLM; 0 picks a free one")
    max_model_len: int = Field(4096, description="context length of a launched vLLM")
    tool_call_parser: str = Field("hermes", description="vLLM tool-call parser for the model")
    vllm_startup_timeout: float = 900.0
    vllm_args: list[str] = Field(default_factory=list, description="extra vLLM arguments")
    max_lora_rank: int = Field(
        0, ge=0, le=512, description="a launched vLLM takes LoRA adapters loaded at runtime up to this rank; 0: none"
    )
    log_dir: Path = Field(default_factory=lambda: data_dir() / "logs")

    @property
    def admin_open(self) -> bool:
        """The admin API needs no token only when nothing off this machine can reach it."""
        return self.admin_token is None and self.host in LOOPBACK
