"""LoRA on the real vLLM CPU build: adapters loaded at runtime while clients stream through the
proxy (nothing pauses, no call fails, each call stamped with the adapter that served it), and
`rl-proxy train` with a `lora:` section for two steps. On a second vLLM beside the shared one,
started as the launcher starts it for LoRA (`max_lora_rank`; tests/trainer/conftest.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from benchmarks.support.stack import RunningProxy, Upstream, read_store
from benchmarks.support.streams import first_logprob, streams_in_flight
from harness_adapters.config import load_config
from proxy.upstream import adapter_name
from proxy.vllm import VllmServer
from recorder import CallRecord, Store
from trainer.config import TrainConfig
from trainer.grpo import Learner
from trainer.run import train
from trainer.weight_sync import SwapError, load_adapter, set_version

EXAMPLE = Path(__file__).resolve().parents[2] / "harness_adapters" / "examples" / "arithmetic"
LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}


@pytest.fixture
def lora_vllm(second_vllm: VllmServer, vllm: Upstream) -> Upstream:
    return Upstream(second_vllm.base_url, second_vllm.served_name, vllm.max_model_len, second_vllm.log_file)


def _adapter(base: Path, out: Path, seed: int) -> Path:
    """A LoRA adapter that changes the model (PEFT starts B at zero: the base model's answers)."""
    import torch

    learner = Learner(str(base), out / "trl", {}, total_steps=1, lora=LORA)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in learner.model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)
    learner.save(out / "adapter", with_optimizer=False)
    return out / "adapter"


def test_adapters_swap_in_under_8_streams_without_a_pause(
    make_proxy: Any, lora_vllm: Upstream, base: Path, tmp_path: Path
) -> None:
    root = lora_vllm.url.removesuffix("/v1")
    proxy: RunningProxy = make_proxy(lora_vllm.url)
    adapters = [_adapter(base, tmp_path / f"a{i}", seed=i) for i in (1, 2, 3)]

    async def announce() -> None:
        async with httpx.AsyncClient() as admin:
            (await admin.post(f"{proxy.url}/admin/policy_version/refresh")).raise_for_status()

    async def main() -> tuple[list[str | BaseException], list[float], float]:
        await set_version(root, "0")
        await announce()
        client = AsyncOpenAI(base_url=proxy.v1, api_key="lora-swap", max_retries=0, timeout=120)
        logprobs = [await first_logprob(client, lora_vllm.model)]
        # On the base model; 192 tokens: 64 ran out before the swap on a busy machine (CI).
        streams = await streams_in_flight(client, lora_vllm.model, 8, 192)
        announced = await load_adapter([root], adapters[0], lora_vllm.model, "1", announce)
        logprobs.append(await first_logprob(client, lora_vllm.model))  # while the 8 still stream
        results = await asyncio.gather(*streams, return_exceptions=True)
        for version, adapter in ((2, adapters[1]), (3, adapters[2])):
            await load_adapter([root], adapter, lora_vllm.model, str(version), announce, retire=str(version - 2))
            logprobs.append(await first_logprob(client, lora_vllm.model))
        return results, logprobs, announced

    results, logprobs, announced = asyncio.run(main())
    assert all(isinstance(r, str) and r for r in results), results
    assert len({round(lp, 4) for lp in logprobs}) == 4, logprobs  # base, then each adapter, served
    assert 0 < announced < 60
    calls = read_store(proxy.db, lambda s: _all_calls(s))
    assert all(c.ok for c in calls)
    streamed = [c for c in calls if c.stream]
    # The streams started on the base model and finished on it, though version 1 came in meanwhile.
    assert [(c.policy_version, c.policy_version_end, c.rewrites.get("model")) for c in streamed] == [
        ("0", "0", None)
    ] * 8
    probes = [c for c in calls if not c.stream]
    assert [(c.policy_version, c.policy_version_end, c.rewrites.get("model")) for c in probes] == [
        ("0", "0", None),
        *[(v, v, [lora_vllm.model, adapter_name(lora_vllm.model, v)]) for v in ("1", "2", "3")],
    ]
    # Versions 1 (retired by 3) is unloaded; 2 stays for calls routed before 3 came in.
    served = {m["id"] for m in httpx.get(f"{lora_vllm.url}/models").json()["data"]}
    assert served == {lora_vllm.model, adapter_name(lora_vllm.model, "2"), adapter_name(lora_vllm.model, "3")}
    with pytest.raises(SwapError, match="no LoRA adapter"):
        asyncio.run(load_adapter([root], base, lora_vllm.model, "4"))


async def _all_calls(store: Store) -> list[CallRecord]:
    return [c for s in await store.list_sessions() async for c in store.iter_calls(s.id)]


@pytest.mark.timeout(600)
def test_train_two_steps_with_lora(lora_vllm: Upstream, tmp_path: Path) -> None:
    config = load_config(EXAMPLE / "train.yaml", TrainConfig)
    config.out = str(tmp_path / "run")
    config.episodes_per_task, config.concurrency = 4, 8
    config.proxy.upstream, config.proxy.vllm_args = lora_vllm.url, []
    config.train = config.train.model_copy(update={"steps": 2, "groups_per_step": 1, "micro_batch": 4, "lora": LORA})
    config.eval = None
    asyncio.run(set_version(lora_vllm.url.removesuffix("/v1"), "0"))
    summary = train(config, progress=False)
    assert (summary.state.step, summary.state.version) == (2, 2)
    versions = tmp_path / "run" / "versions"
    for version in ("v1", "v2"):  # adapters only: a few MB, not the model
        assert (versions / version / "adapter_model.safetensors").exists()
        assert not (versions / version / "model.safetensors").exists()
    calls = read_store(str(tmp_path / "run" / "rl-proxy.db"), lambda s: _all_calls(s))
    assert calls and all(c.ok for c in calls)
    # The example's harness asks for "policy": the proxy sends the base model, then the adapter.
    stamped = {(c.policy_version, c.policy_version_end, c.rewrites["model"][1]) for c in calls}
    # Step 1's groups came from the base model, step 2's from the first adapter.
    assert stamped == {("0", "0", lora_vllm.model), ("1", "1", adapter_name(lora_vllm.model, "1"))}, stamped
    served = {m["id"] for m in httpx.get(f"{lora_vllm.url}/models").json()["data"]}
    assert adapter_name(lora_vllm.model, "2") in served

    # Resumed: the adapter of step 2 trains on, and vLLM serves it again before step 3's groups.
    config.train = config.train.model_copy(update={"steps": 3})
    resumed = train(config, resume=True, progress=False)
    assert (resumed.state.step, resumed.state.version) == (3, 3)
    calls = read_store(str(tmp_path / "run" / "rl-proxy.db"), lambda s: _all_calls(s))
    assert all(c.ok for c in calls)
    assert ("2", "2", adapter_name(lora_vllm.model, "2")) in {
        (c.policy_version, c.policy_version_end, c.rewrites["model"][1]) for c in calls
    }
