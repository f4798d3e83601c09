"""Putting new weights into running vLLM servers: the trainer is their only user.

- The weight hot swap, without failing a request. On each server, in turn: `POST
  /pause?mode=keep` (requests in flight freeze, new ones queue), `POST /collective_rpc
  reload_weights` from the new safetensors directory, `POST /update_weight_version`, then the
  proxy is told to read the new version (so every call that starts after `resume` is stamped
  with it), then `POST /resume`. If a reload fails, the previous weights are loaded back
  before resuming and SwapError names the server and the cause: the old version keeps
  serving, never a half-loaded one. On GPU clusters vLLM's NCCL weight-transfer endpoints
  (`init_weight_transfer_engine`, `update_weights` with `--weight-transfer-config`) skip the
  disk round-trip: `hot_swap`'s `send` hook, which trainer/nccl.py fills (`weight_sync: nccl`).
  They need CUDA and were not run here.
- LoRA (`load_adapter`): each version is a runtime-loaded adapter under its own name; nothing
  pauses, since a call keeps the adapter it started with.
- `set_version`: name the weights a server was started with.

The servers are launched with these development routes on (proxy/vllm.py), bound to 127.0.0.1,
and the proxy never forwards them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from proxy.upstream import adapter_name

log = logging.getLogger("rl_proxy.weight_sync")


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


def sampling_mode_problem(root: str) -> str | None:
    """Why the vLLM at `root` cannot serve a training run, if it cannot: its logprobs must be
    those of the distribution it samples from (`--logprobs-mode processed_logprobs`; vLLM's
    default, raw_logprobs, is wrong whenever the temperature is not 1), which it reports, with
    its whole config, on its development route `/server_info` (the swap needs those routes too)."""
    try:
        answer = httpx.get(f"{root}/server_info", params={"config_format": "json"}, timeout=60)
    except httpx.HTTPError as exc:
        return f"vLLM at {root} did not answer /server_info: {exc!r}"
    if answer.status_code == 404:
        return (
            f"vLLM at {root} has no development routes (/server_info, /pause, /collective_rpc): "
            "start it with VLLM_SERVER_DEV_MODE=1, which the weight swap needs"
        )
    try:
        mode = answer.json()["vllm_config"]["model_config"]["logprobs_mode"]
    except (ValueError, KeyError, TypeError) as exc:
        return f"vLLM at {root} did not say its logprobs mode on /server_info ({exc!r}): {answer.text[:200]}"
    if mode != "processed_logprobs":
        return (
            f"vLLM at {root} records {mode}, not the logprobs of the distribution it samples from: "
            "restart it with --logprobs-mode processed_logprobs"
        )
    return None


async def hot_swap(
    roots: list[str],
    weights: Path,
    version: str,
    previous: Path,
    announce: Callable[[str], Awaitable[None]] | None = None,
    send: Callable[[str], Awaitable[None]] | None = None,
) -> float:
    """Swap `weights` in as `version` on every server (root URLs, without /v1), all or none.
    Every server is paused, every one takes the new weights, then each is given the version and
    it is announced once (`announce(version)`, while all are paused: no call starts on one server under
    the new version while another serves the old), then all resume. If a server refuses the
    weights, or a version cannot be set or announced after every server took them, every server
    that took them loads `previous` back (and its version before, announced again), all resume
    on the old weights, and SwapError names the server or the step. A server that cannot load
    `previous` back either, or that failed over `send` (NCCL, trainer/nccl.py: nothing to load
    back from), is left paused: it would serve unknown weights. Returns the seconds the servers
    were paused."""
    if send is None and not (weights / "model.safetensors").exists() and not any(weights.glob("*.safetensors")):
        raise SwapError(f"{weights}: no safetensors weights to load")
    start = time.perf_counter()
    paused: list[str] = []
    lost: list[str] = []  # left paused: their weights are in an unknown state
    # A connection of its own per request: vLLM drops a connection after a failed RPC.
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        before = {root: await _version(client, root) for root in roots}

        async def give_up(taken: list[str], failed: SwapError, what: str) -> SwapError:
            lost.extend(await _roll_back(client, taken, previous, send is not None))
            restored = [root for root in taken if root not in lost]
            try:
                for root in restored:
                    if before[root] is not None:
                        await _post(client, f"{root}/update_weight_version", json={"new_version": before[root]})
                if announce is not None and restored and before[restored[0]] is not None:
                    await announce(str(before[restored[0]]))
            except SwapError as again:  # the weights are the old ones; the proxy's poll catches up
                log.error("the previous version was not announced again: %s", again)
            left = (
                f"{lost} are left paused with weights in an unknown state; restart them"
                if lost
                else f"every server serves the previous ones from {previous} again"
            )
            return SwapError(f"{what} ({failed}); {left}")

        try:
            for root in roots:
                await _post(client, f"{root}/pause", params={"mode": "keep"})
                paused.append(root)
            for taken, root in enumerate(roots):
                try:
                    await (_reload(client, root, weights) if send is None else send(root))
                except SwapError as failed:
                    what = f"vLLM at {root} refused the weights in {weights}"
                    raise await give_up(roots[: taken + 1], failed, what) from failed
            try:
                for root in roots:
                    await _post(client, f"{root}/update_weight_version", json={"new_version": version})
                if announce is not None:
                    await announce(version)
            except SwapError as failed:  # all or none: not the new weights under the old version's name
                raise await give_up(roots, failed, f"version {version} was not set and announced") from failed
        finally:
            for root in paused:
                if root not in lost:
                    await _post(client, f"{root}/resume")
    return time.perf_counter() - start


async def _version(client: httpx.AsyncClient, root: str) -> str | None:
    """The weight version a server serves (vLLM's development route `/weight_info`)."""
    try:
        answer = await client.get(f"{root}/weight_info")
        return str(answer.json()["weight_version"]) if answer.is_success else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


async def _roll_back(client: httpx.AsyncClient, roots: list[str], previous: Path, sent: bool) -> list[str]:
    """Load `previous` back into `roots` (those that took the new weights, and the one that
    refused them); the servers it could not be loaded into. Over NCCL there is nothing to load
    back from: all of them."""
    if sent:
        return list(roots)
    lost = []
    for root in roots:
        try:
            await _reload(client, root, previous)
        except SwapError as again:
            log.error("vLLM at %s did not load the previous weights back from %s: %s", root, previous, again)
            lost.append(root)
    return lost


async def load_adapter(
    roots: list[str],
    adapter: Path,
    model: str,
    version: str,
    announce: Callable[[], Awaitable[None]] | None = None,
    retire: str | None = None,
) -> float:
    """Load the LoRA `adapter` into every server as `version` of `model` (named by
    `adapter_name`), set the weight version to match and `announce` it: calls from then on go
    to it (proxy/upstream.py), and calls already running finish on the adapter they started
    with. Nothing pauses. The adapter of version `retire` is then unloaded. Returns the seconds
    until the new version was announced."""
    if not (adapter / "adapter_config.json").exists():
        raise SwapError(f"{adapter}: no LoRA adapter (adapter_config.json) to load")
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        body = {"lora_name": adapter_name(model, version), "lora_path": str(adapter.resolve()), "load_inplace": True}
        for root in roots:
            try:
                await _post(client, f"{root}/v1/load_lora_adapter", json=body)
            except SwapError as exc:
                raise SwapError(
                    f"vLLM at {root} did not load the adapter ({exc}); it takes adapters at runtime when "
                    "started with --enable-lora --max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
                    "(the proxy's max_lora_rank does this for the vLLM it launches)"
                ) from exc
        for root in roots:
            await _post(client, f"{root}/update_weight_version", json={"new_version": version})
        if announce is not None:
            await announce()
        announced = time.perf_counter() - start
        if retire is not None:
            old = {"lora_name": adapter_name(model, retire)}
            for root in roots:
                try:
                    await _post(client, f"{root}/v1/unload_lora_adapter", json=old)
                except SwapError as exc:  # already gone (a restarted vLLM): nothing to free
                    log.info("adapter of version %s not unloaded from %s: %s", retire, root, exc)
    return announced


async def set_version(root: str, version: str) -> None:
    """Name the weights a server was started with (no reload)."""
    async with httpx.AsyncClient(timeout=60) as client:
        await _post(client, f"{root}/update_weight_version", json={"new_version": version})
