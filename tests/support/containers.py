"""What the container tests ask of the engine."""

from __future__ import annotations

from typing import Any

from harness_adapters.environments.containers import OWNER


def left(engine: Any) -> list[str]:
    """The containers any rl-proxy run started that are still there."""
    return [c.name for c in engine.containers.list(all=True, filters={"label": OWNER})]
