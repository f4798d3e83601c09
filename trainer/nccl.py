"""Weight sync over NCCL, for GPU clusters (`train.weight_sync: nccl`): rank 0 of the trainer
broadcasts its parameters straight into the GPUs of every vLLM server with vLLM's own
trainer-side engine (`NCCLTrainerWeightTransferEngine`, over the server's
`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights` and
`/finish_weight_update` routes), instead of saving safetensors for vLLM to read back. The
swap around it is the same (proxy/vllm.py `hot_swap`: pause, load, version, announce, resume).

vLLM must be started with `--weight-transfer-config '{"backend": "nccl"}'` (the launcher adds
it for the vLLM it starts) and be able to reach the trainer's address. Not run here: these
machines have no GPU, so everything up to the NCCL rendezvous is tested (tests/trainer/test_nccl.py)
and the rest is vLLM's own code.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from proxy.vllm import free_port
from trainer.groups import TrainError
from trainer.weight_sync import SwapError


@dataclass(frozen=True)
class Rendezvous:
    """Where the trainer (NCCL rank 0) and one server's workers (ranks 1..) meet."""

    root: str
    address: str
    port: int
    world_size: int


def plan(roots: list[str]) -> list[Rendezvous]:
    """A rendezvous per server: its workers (tensor x pipeline x data parallel) plus the trainer,
    at this machine's address as the server sees it."""
    found = []
    for root in roots:
        try:
            answer = httpx.get(f"{root}/get_world_size", timeout=30)
            answer.raise_for_status()
            workers = int(answer.json()["world_size"])
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise TrainError(
                f"weight_sync nccl: vLLM at {root} did not give its world size ({exc!r}); it needs "
                "VLLM_SERVER_DEV_MODE=1 for its weight routes"
            ) from exc
        found.append(Rendezvous(root, _address_towards(root), free_port(), workers + 1))
    return found


def _address_towards(root: str) -> str:
    """This machine's address on the route to `root` (loopback for a local server)."""
    parts = urlsplit(root)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
        probe.connect((parts.hostname or "127.0.0.1", parts.port or 80))
        return str(probe.getsockname()[0])


class NcclSync:
    """One NCCL group per vLLM server, opened once; `send` is `hot_swap`'s way to load."""

    def __init__(self, roots: list[str], model: Any) -> None:
        """`model`: the trained module (unwrapped), whose parameters are sent as they are."""
        import torch

        meetings = plan(roots)
        if not torch.cuda.is_available():
            raise TrainError(
                "weight_sync: nccl needs CUDA on the trainer and on vLLM, and this machine has none; "
                "use weight_sync: disk (the default)"
            )
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        self.engines = {
            m.root: NCCLTrainerWeightTransferEngine.trainer_init(
                NCCLTrainerInitInfo(master_address=m.address, master_port=m.port, world_size=m.world_size, rank=0),
                client=HTTPVLLMWeightSyncClient(m.root),
                source=ModuleSource(model),
            )
            for m in meetings
        }

    async def send(self, root: str) -> None:
        try:
            await asyncio.to_thread(self.engines[root].send_weights)
        except Exception as exc:  # vLLM's engine raises what NCCL or its HTTP client raise
            raise SwapError(f"NCCL weight transfer to {root} failed: {exc!r}") from exc
