"""Weight hot swap into the real vLLM while clients stream through the proxy, and a reload that
vLLM refuses. Both leave the shared server serving the prepared default weights (`restore`)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from openai import AsyncOpenAI

from benchmarks.support.stack import RunningProxy, Upstream
from benchmarks.support.streams import first_logprob, streams_in_flight
from proxy.admin_client import AdminClient
from proxy.server import AppThread
from proxy.upstream import Upstreams
from proxy.vllm import VllmServer
from trainer.loop import refresh_version
from trainer.weight_sync import SwapError, hot_swap, sampling_mode_problem, set_version


@pytest.fixture(scope="module")
def changed(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default weights with the embeddings scaled: other logprobs, same shapes."""
    from safetensors.torch import load_file, save_file

    weights = load_file(base / "model.safetensors")
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] * 1.5
    out = tmp_path_factory.mktemp("changed")
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(base / "config.json", out / "config.json")
    return out


async def _announce(proxy: RunningProxy) -> None:
    """What the trainer does while vLLM is paused: the proxy reads the new version."""
    async with httpx.AsyncClient() as admin:
        (await admin.post(f"{proxy.url}/admin/policy_version/refresh")).raise_for_status()


async def _checked_announce(proxy: RunningProxy, version: str) -> None:
    """The trainer's announce: the proxy reads the new version, and every replica must report it
    (the announce inside a per-replica loop failed on the first of two: the other was still on 0)."""
    async with AdminClient(proxy.url) as admin:
        await refresh_version(admin, version)


def test_swap_while_16_streams(proxy: RunningProxy, vllm: Upstream, restore: str, changed: Path, base: Path) -> None:
    async def main() -> tuple[list[str | BaseException], float, float, float]:
        await set_version(restore, "0")
        await _announce(proxy)
        client = AsyncOpenAI(base_url=proxy.v1, api_key="swap-test", max_retries=0, timeout=120)
        before = await first_logprob(client, vllm.model)
        streams = await streams_in_flight(client, vllm.model, 16, 96, freeze=restore)  # sampling the old weights
        paused = await hot_swap([restore], changed, "1", base, lambda version: _checked_announce(proxy, version))
        results = await asyncio.gather(*streams, return_exceptions=True)
        after = await first_logprob(client, vllm.model)
        return results, before, after, paused

    results, before, after, paused = asyncio.run(main())
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, failed
    assert all(isinstance(r, str) and r for r in results)
    assert after != pytest.approx(before, abs=1e-3), "the new weights are not serving"
    assert 0 < paused < 60
    calls = sorted(proxy.calls(), key=lambda c: c.started_at)
    assert len(calls) == 18 and all(c.ok for c in calls)
    streamed = [c for c in calls if c.stream]
    # Every stream started before the swap and finished after it: both versions recorded.
    versions = [(c.policy_version, c.policy_version_end) for c in streamed]
    assert versions == [("0", "1")] * 16, versions
    assert (calls[0].policy_version, calls[-1].policy_version) == ("0", "1")
    assert calls[-1].policy_version_end == "1"


def test_refused_reload_keeps_old_weights(
    proxy: RunningProxy, vllm: Upstream, restore: str, base: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"not safetensors at all")

    async def main() -> tuple[float, float, str]:
        await set_version(restore, "0")
        client = AsyncOpenAI(base_url=proxy.v1, api_key="refused", max_retries=0, timeout=120)
        before = await first_logprob(client, vllm.model)
        with pytest.raises(SwapError, match="refused the weights"):
            await hot_swap([restore], broken, "1", base)
        after = await first_logprob(client, vllm.model)
        version = httpx.get(f"{restore}/weight_info").json()["weight_version"]
        return before, after, version

    before, after, version = asyncio.run(main())
    assert after == pytest.approx(before, abs=1e-4)  # the old weights serve
    assert version == "0"
    with pytest.raises(SwapError, match="no safetensors"):
        asyncio.run(hot_swap([restore], tmp_path / "missing", "1", base))
    # The previous weights refused too: vLLM is left paused (it would serve unknown weights), and says so.
    with pytest.raises(SwapError, match="left paused"):
        asyncio.run(hot_swap([restore], broken, "1", broken))
    assert httpx.get(f"{restore}/is_paused").json()["is_paused"] is True
    httpx.post(f"{restore}/resume").raise_for_status()  # the shared server goes on (`restore` reloads the weights)


def test_a_swap_whose_announce_fails_after_every_reload_rolls_back(
    proxy: RunningProxy, vllm: Upstream, restore: str, changed: Path, base: Path
) -> None:
    """Defect 4 of issue 39: every server took the new weights, then the announce failed (the
    proxy gone, a version it did not read): all resumed on the new weights under the old
    version's name, and the trainer deleted their directory. Now all or none: the old weights
    and version serve again, and SwapError says so."""

    async def refused(version: str) -> None:  # the new version's announce fails; the old one's goes through
        if version == "1":
            raise SwapError("the proxy did not take the new policy version: connection refused (fault injected)")
        await _checked_announce(proxy, version)

    async def main() -> tuple[float, float, str]:
        await set_version(restore, "0")
        await _announce(proxy)
        client = AsyncOpenAI(base_url=proxy.v1, api_key="announce-fails", max_retries=0, timeout=120)
        before = await first_logprob(client, vllm.model)
        with pytest.raises(SwapError, match=r"was not set and announced .* serves the previous ones .* again"):
            await hot_swap([restore], changed, "1", base, refused)
        after = await first_logprob(client, vllm.model)
        return before, after, httpx.get(f"{restore}/weight_info").json()["weight_version"]

    before, after, version = asyncio.run(main())
    assert after == pytest.approx(before, abs=1e-4) and version == "0"
    assert httpx.get(f"{restore}/is_paused").json()["is_paused"] is False
    calls = proxy.calls("announce-fails")
    assert [c.policy_version for c in calls] == ["0", "0"]


def test_two_replicas_pinned_swapped_and_one_lost(
    make_proxy: Any, vllm: Upstream, second_vllm: VllmServer, restore: str, changed: Path, base: Path
) -> None:
    """Two real vLLM servers behind one proxy (the shared one and the second, LoRA enabled,
    serving the base model): each session stays on the server the hash gives it, both record
    token ids, one hot swap moves both to the new weights, and when the second dies its sessions
    go on on the first."""
    second = second_vllm
    try:
        urls = [vllm.url, second.base_url]
        asyncio.run(set_version(restore, "0"))
        asyncio.run(set_version(second.base_url.removesuffix("/v1"), "0"))
        proxy = make_proxy(",".join(urls), version_poll_interval=0.2)
        pinning = Upstreams.from_urls(",".join(urls), timeout=1, connect_timeout=1, api_key=None)
        home: dict[str, str] = {}  # three sessions the hash puts on each server
        for key in (f"replica-{i}" for i in range(100)):
            url = pinning.for_session(key).base_url
            if list(home.values()).count(url) < 3:
                home[key] = url
        assert len(home) == 6

        def ask(key: str) -> float:
            client = AsyncOpenAI(base_url=proxy.v1, api_key=key, max_retries=0, timeout=120)
            return asyncio.run(first_logprob(client, vllm.model))

        before = {key: ask(key) for key in home}
        roots = [u.removesuffix("/v1") for u in urls]
        asyncio.run(hot_swap(roots, changed, "1", base, lambda version: _checked_announce(proxy, version)))
        after = {key: ask(key) for key in home}
        second.stop()
        lost = {key: ask(key) for key in home if home[key] == second.base_url}
        health = httpx.get(f"{proxy.url}/healthz").json()["upstreams"]
    finally:  # a failure above leaves no changed weights behind
        second.stop()
    calls = proxy.calls()
    by_session: dict[str, list[Any]] = {}
    for call in calls:
        by_session.setdefault(call.session_id, []).append(call)
    for key, url in home.items():
        first, swapped, *rest = by_session[key]
        assert (first.upstream, swapped.upstream) == (url, url)  # pinned where the hash put it
        assert (first.policy_version, swapped.policy_version) == ("0", "1")
        assert first.completions[0].token_ids and first.prompt_token_ids == swapped.prompt_token_ids
        assert after[key] != pytest.approx(before[key], abs=1e-3)  # the new weights serve on both
        for moved in rest:  # the second died: its sessions moved to the first, already swapped
            assert moved.ok and moved.upstream == vllm.url and moved.policy_version == "1"
            assert lost[key] == pytest.approx(after[key], abs=1e-3)
    assert sorted(len(v) for v in by_session.values()) == [2, 2, 2, 3, 3, 3]
    assert max(before.values()) - min(before.values()) < 1e-3  # one model on both: one answer
    assert [u["alive"] for u in health] == [True, False]


def _refusing_replica(previous: Path) -> FastAPI:
    """Fault injection (a stub, NOT vLLM): a replica that pauses, resumes and takes versions like
    vLLM's development routes, and refuses to reload any weights but `previous`."""
    app = FastAPI()
    for route in ("/pause", "/resume", "/update_weight_version"):
        app.post(route)(lambda: {})

    @app.post("/collective_rpc")
    def reload(body: dict[str, Any]) -> JSONResponse:
        if body["kwargs"]["weights_path"] == str(previous.resolve()):
            return JSONResponse({})
        return JSONResponse({"error": "out of memory (injected)"}, 500)

    return app


def test_a_replica_that_refuses_the_weights_rolls_every_replica_back(
    vllm: Upstream, restore: str, changed: Path, base: Path
) -> None:
    """All or none: the real vLLM takes the new weights, the second replica refuses them, and the
    real one loads the previous weights back and serves them under the old version. Swapped one
    server at a time, the first had gone on serving version 1 beside the other's 0."""

    async def main(second: str) -> tuple[float, float, str, bool]:
        await set_version(restore, "0")
        client = AsyncOpenAI(base_url=vllm.url, api_key="unused", max_retries=0, timeout=120)
        before = await first_logprob(client, vllm.model)
        with pytest.raises(SwapError, match=r"refused the weights .*every server serves the previous ones"):
            await hot_swap([restore, second], changed, "1", base)
        after = await first_logprob(client, vllm.model)
        version = httpx.get(f"{restore}/weight_info").json()["weight_version"]
        return before, after, version, httpx.get(f"{restore}/is_paused").json()["is_paused"]

    with AppThread(_refusing_replica(base)) as second:
        before, after, version, paused = asyncio.run(main(second.url))
    assert after == pytest.approx(before, abs=1e-4) and version == "0" and paused is False


def test_an_attached_vllm_is_checked_for_its_logprobs_mode(vllm: Upstream) -> None:
    """With `proxy.upstream` nothing checked that the server records the logprobs of what it
    samples: vLLM's default (raw logprobs) is wrong whenever the temperature is not 1. The real
    server, launched as the project launches it, passes; stubs (NOT vLLM) stand for the others."""
    assert sampling_mode_problem(vllm.url.removesuffix("/v1")) is None
    raw = FastAPI()
    raw.get("/server_info")(lambda: {"vllm_config": {"model_config": {"logprobs_mode": "raw_logprobs"}}})
    with AppThread(raw) as server:
        assert "restart it with --logprobs-mode processed_logprobs" in str(sampling_mode_problem(server.url))
    with AppThread(FastAPI()) as server:
        assert "VLLM_SERVER_DEV_MODE=1" in str(sampling_mode_problem(server.url))
