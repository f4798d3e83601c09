"""Hot swap of new weights into running vLLM servers, without failing a request.

On each server, in turn: `POST /pause?mode=keep` (requests in flight freeze, new ones queue),
`POST /collective_rpc reload_weights` from the new safetensors directory, `POST
/update_weight_version`, then the proxy is told to read the new version (so every call that
starts after `resume` is stamped with it), then `POST /resume`. These are vLLM's development
routes (`VLLM_SERVER_DEV_MODE=1`); the servers bind to loopback and the proxy never forwards
them. If a reload fails, the previous weights are loaded back before resuming and SwapError
names the server and the cause: the old version keeps serving, never a half-loaded one.

On GPU clusters the same sequence works per server; vLLM's NCCL weight-transfer endpoints
(`init_weight_transfer_engine`, `update_weights` with `--weight-transfer-config`) skip the
disk round-trip and are the faster path there. They need CUDA and are not used here.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx


class SwapError(RuntimeError):
    """A server refused or failed the new weights; it serves the previous ones."""


async def _post(client: httpx.AsyncClient, url: str, **kwargs: object) -> None:
    try:
        answer = await client.post(url, **kwargs)  # type: ignore[arg-type]
    except httpx.HTTPError as exc:
        raise SwapError(f"{url}: {exc!r}") from exc
    if not answer.is_success:
        raise SwapError(f"{url}: HTTP {answer.status_code}: {answer.text[:500]}")


async def _reload(client: httpx.AsyncClient, root: str, weights: Path) -> None:
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(weights.resolve())}}
    await _post(client, f"{root}/collective_rpc", json=body)


async def hot_swap(
    roots: list[str],
    weights: Path,
    version: str,
    previous: Path,
    announce: Callable[[], Awaitable[None]] | None = None,
) -> float:
    """Swap `weights` in as `version` on every server (root URLs, without /v1); `previous` is
    loaded back if a reload fails. `announce` runs while paused, after the version is set.
    Returns the longest time a server was paused, in seconds."""
    if not (weights / "model.safetensors").exists() and not any(weights.glob("*.safetensors")):
        raise SwapError(f"{weights}: no safetensors weights to load")
    longest = 0.0
    # A connection of its own per request: vLLM drops a connection after a failed RPC.
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for root in roots:
            start = time.perf_counter()
            await _post(client, f"{root}/pause", params={"mode": "keep"})
            try:
                try:
                    await _reload(client, root, weights)
                except SwapError as failed:
                    await _reload(client, root, previous)
                    raise SwapError(f"vLLM at {root} refused the weights in {weights} ({failed}); "
                                    f"it serves the previous ones from {previous}") from failed  # fmt: skip
                await _post(client, f"{root}/update_weight_version", json={"new_version": version})
                if announce is not None:
                    await announce()
            finally:
                await _post(client, f"{root}/resume")
            longest = max(longest, time.perf_counter() - start)
    return longest


async def set_version(root: str, version: str) -> None:
    """Name the weights a server was started with (no reload)."""
    async with httpx.AsyncClient(timeout=60) as client:
        await _post(client, f"{root}/update_weight_version", json={"new_version": version})
