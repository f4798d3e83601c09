"""The episode's gateway (harness_adapters/environments/gateway.py), in this process's own network
namespace (entered as a container's is: as root)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator

import pytest
from starlette.applications import Starlette

from harness_adapters.environments import gateway as module
from harness_adapters.environments.gateway import GatewayError, gateway


@pytest.mark.skipif(os.geteuid() != 0, reason="the gateway enters a network namespace: root only")
def test_a_gateway_that_fails_to_start_fails_its_episode_not_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen in `train`'s SIGTERM test (issue 46): uvicorn ends a start that failed (there, its
    lifespan interrupted) with sys.exit(3), and that SystemExit ended the whole run with 3, past
    the run's clean-up. The fault injected here: the gateway app's start fails."""

    @contextlib.asynccontextmanager
    async def failing(app: Starlette) -> AsyncIterator[None]:
        raise RuntimeError("injected: the app's start failed")
        yield

    monkeypatch.setattr(module, "gateway_app", lambda url, key: Starlette(lifespan=failing))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def episode() -> None:
        async with gateway(os.getpid(), f"http://127.0.0.1:{port}/v1", "key"):
            pass

    with pytest.raises(GatewayError, match="did not start"):
        asyncio.run(episode())
