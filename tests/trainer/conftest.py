"""Fixtures of the trainer tests that change the shared vLLM's weights."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Upstream
from trainer.model import resolve_model
from trainer.swap import hot_swap


@pytest.fixture(scope="module")
def base() -> Path:
    """The prepared default weights, which the shared vLLM serves."""
    return Path(resolve_model("default")[0])


@pytest.fixture
def restore(vllm: Upstream, base: Path) -> Iterator[str]:
    """The vLLM root; afterwards it serves the default weights again, as version 0."""
    root = vllm.url.removesuffix("/v1")
    yield root
    asyncio.run(hot_swap([root], base, "0", base))
