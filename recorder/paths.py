"""Where rl-proxy keeps its data unless told otherwise: one per-user directory holding the
default database, the prepared default model and the logs of a launched vLLM."""

from __future__ import annotations

from pathlib import Path

from platformdirs import user_data_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def data_dir() -> Path:
    return Path(user_data_dir("rl-proxy", appauthor=False))


def default_db() -> str:
    return f"sqlite+aiosqlite:///{data_dir() / 'rl-proxy.db'}"


def default_model_dir() -> Path:
    """Where `rl-proxy model prepare` writes the default model as an HF directory."""
    return data_dir() / "models" / DEFAULT_MODEL_NAME
