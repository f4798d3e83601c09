"""The NCCL weight sync up to the CUDA call: these machines have no GPU, so the rendezvous is
planned against the real vLLM, the swap's `send` hook runs while vLLM is paused, and a run
that asks for NCCL stops with a clear error before any rollout."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from benchmarks.support.stack import Upstream
from harness_adapters.config import load_config
from proxy.vllm import WEIGHT_TRANSFER_ARGS
from trainer.config import TrainConfig
from trainer.groups import TrainError
from trainer.nccl import plan
from trainer.run import train
from trainer.weight_sync import SwapError, hot_swap

torch = pytest.importorskip("torch")
EXAMPLE = Path(__file__).resolve().parents[2] / "harness_adapters" / "examples" / "arithmetic"


def test_the_rendezvous_is_planned_from_the_server(vllm: Upstream) -> None:
    root = vllm.url.removesuffix("/v1")
    (meeting,) = plan([root])
    assert (meeting.root, meeting.address, meeting.world_size) == (root, "127.0.0.1", 2)  # one CPU worker + trainer
    assert 0 < meeting.port < 65536
    with pytest.raises(TrainError, match="world size"):
        plan(["http://127.0.0.1:9"])  # nothing listens there


def test_send_runs_while_vllm_is_paused_and_a_failed_one_leaves_it_paused(restore: str, base: Path) -> None:
    seen: list[bool] = []

    async def send(root: str) -> None:
        async with httpx.AsyncClient() as client:
            seen.append((await client.get(f"{root}/is_paused")).json()["is_paused"])

    async def fail(root: str) -> None:
        raise SwapError("NCCL weight transfer failed: the peer went away")

    asyncio.run(hot_swap([restore], base / "not-there", "1", base, send=send))
    assert seen == [True]
    assert httpx.get(f"{restore}/weight_info").json()["weight_version"] == "1"
    assert httpx.get(f"{restore}/is_paused").json()["is_paused"] is False
    with pytest.raises(SwapError, match="left paused"):
        asyncio.run(hot_swap([restore], base, "2", base, send=fail))
    assert httpx.get(f"{restore}/is_paused").json()["is_paused"] is True  # `restore` resumes it


def _config(**train: object) -> TrainConfig:
    config = load_config(EXAMPLE / "train.yaml", TrainConfig)
    return TrainConfig.model_validate({**config.model_dump(exclude_unset=True), "train": {**train}})


def test_the_config_asks_vllm_for_its_nccl_side_and_refuses_lora_over_nccl() -> None:
    assert _config(weight_sync="nccl").proxy.vllm_args[-2:] == WEIGHT_TRANSFER_ARGS
    assert WEIGHT_TRANSFER_ARGS[0] not in _config().proxy.vllm_args
    with pytest.raises(ValueError, match="LoRA adapters go to vLLM from disk"):
        _config(weight_sync="nccl", lora={"r": 8})


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the NCCL group would open")
def test_a_run_over_nccl_without_cuda_stops_with_a_clear_error(vllm: Upstream, tmp_path: Path) -> None:
    config = load_config(EXAMPLE / "train.yaml", TrainConfig)
    config.out, config.proxy.upstream, config.eval = str(tmp_path / "run"), vllm.url, None
    config.train = config.train.model_copy(update={"weight_sync": "nccl", "steps": 1})
    with pytest.raises(TrainError, match="needs CUDA"):
        train(config, progress=False)
    assert not (tmp_path / "run" / "episodes").exists()  # stopped before any rollout
