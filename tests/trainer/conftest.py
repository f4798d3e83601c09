"""Fixtures of the trainer tests that change the shared vLLM's weights."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proxy.vllm import hot_swap, resolve_model
from tests.support.stack import Upstream


@pytest.fixture(scope="module")
def base() -> Path:
    """The prepared default weights, which the shared vLLM serves."""
    return Path(resolve_model("default")[0])


@pytest.fixture
def restore(vllm: Upstream, base: Path) -> Iterator[str]:
    """The vLLM root; afterwards it serves the default weights again, as version 0, and is not
    left paused by a test that failed mid-swap (every later test would wait on it)."""
    root = vllm.url.removesuffix("/v1")
    yield root
    httpx.post(f"{root}/resume", timeout=60).raise_for_status()
    asyncio.run(hot_swap([root], base, "0", base))
