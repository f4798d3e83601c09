"""Fixtures of the trainer tests: a tiny model, and the shared vLLM's weights put back."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.support.stack import Upstream
from proxy.model import resolve_model
from proxy.vllm import VllmServer
from tests.support.collected import collected_use
from trainer.weight_sync import hot_swap

HELD = 2.0  # GB: a learner of SmolLM2-135M and its optimizer; the tiny model's hold a few MB


@pytest.fixture(autouse=True)
def _memory_back() -> Iterator[None]:
    """After a trainer test that left its process holding more than HELD, what its learners held
    goes back to the OS: the tests run beside the shared vLLM on a 24 GB machine. A collection
    costs 1.4-2.5 s a test, which the tiny model's tests, a hundred of them, skip."""
    yield
    import gc

    from trainer.forward import release_memory
    from trainer.loop import resident_gb

    held = resident_gb()
    if held is None or held > HELD:  # None: not Linux, so always
        gc.collect()
        release_memory()


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


@pytest.fixture(scope="session")
def _second(vllm: Upstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    path, name = resolve_model("default")
    log = tmp_path_factory.mktemp("second-vllm") / "vllm.log"
    server = VllmServer(
        path, name, log_file=log, max_model_len=vllm.max_model_len, extra_args=["--enforce-eager"], lora_rank=16
    )
    server.launch()  # waited for by second_vllm: the tests before the first that needs it run meanwhile
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _second_ahead(request: pytest.FixtureRequest) -> None:
    """The second vLLM starts in the background at the first trainer test on the shared vLLM's
    worker, so that its start (60-90 s on 2 cores) overlaps the tests before the LoRA tests
    instead of being waited for by the first of them, on the run's longest chain. Only where a
    collected test needs it."""
    if "vllm" in request.fixturenames and collected_use(request.session, "second_vllm"):
        request.getfixturevalue("_second")


@pytest.fixture
def second_vllm(_second: VllmServer) -> VllmServer:
    """A second vLLM beside the shared one, started as the launcher starts it for LoRA
    (`max_lora_rank`): the LoRA tests' server, then the second replica of the replica test, which
    stops it (test files run in name order: test_lora_vllm.py before test_swap_vllm.py); started
    again if a later test asks for it. One start instead of two, 45-90 s each on 2 cores, and
    that one in the background (`_second_ahead`). Each test gets it serving the base model
    alone: adapters an earlier test left are unloaded."""
    if _second.process is None or _second.process.poll() is not None:
        _second.start()
    else:
        _second.wait_ready(900)
    for model in httpx.get(f"{_second.base_url}/models").json()["data"]:
        if model.get("parent"):
            unload = {"lora_name": model["id"]}
            httpx.post(f"{_second.base_url}/unload_lora_adapter", json=unload, timeout=60).raise_for_status()
    return _second


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer: the learner's tests run in seconds."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default")[0])
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
