"""vLLM's development routes (pause, resume, reload, RPC, version) are never reachable through
the proxy, under any prefix: the hot swap is the trainer's, on vLLM's loopback port only."""

from __future__ import annotations

import httpx
import pytest

from benchmarks.support.stack import RunningProxy, Upstream

DEV_ROUTES = [
    "/pause",
    "/resume",
    "/collective_rpc",
    "/update_weight_version",
    "/reset_prefix_cache",
    "/sleep",
    "/wake_up",
    "/is_paused",
    "/weight_info",
]


@pytest.mark.parametrize("prefix", ["", "/v1", "/s/some-session", "/s/some-session/v1"])
def test_dev_routes_not_forwarded(proxy: RunningProxy, vllm: Upstream, prefix: str) -> None:
    root = vllm.url.removesuffix("/v1")
    version = httpx.get(f"{root}/weight_info").json()["weight_version"]
    for route in DEV_ROUTES:
        for method in ("GET", "POST"):
            answer = httpx.request(
                method,
                f"{proxy.url}{prefix}{route}",
                json={"method": "reload_weights"},
                headers={"Authorization": "Bearer k"},
            )
            assert answer.status_code in (404, 405), (method, prefix, route, answer.status_code)
            assert "error" in answer.json()
    assert httpx.get(f"{root}/is_paused").json()["is_paused"] is False
    assert httpx.get(f"{root}/weight_info").json()["weight_version"] == version
    assert proxy.calls() == []
