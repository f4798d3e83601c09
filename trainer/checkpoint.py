"""What a version directory holds. The weights vLLM serves, in the dtype it serves them in
(`serving_dtype`; the LoRA adapters, for a LoRA run), and the tokenizer: a directory vLLM loads
or reloads at a swap. A checkpoint, to resume from, also holds the learner's own state in
`learner/`: its float32 master weights and optimizer state in torch's distributed checkpoint
format (each FSDP2 rank writes and reads its own shards: no rank holds the whole optimizer
state), and the scheduler's. The loop's `state.json` goes beside them (trainer/loop.py).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Protocol


class Versioned(Protocol):
    """What a version directory is written from and resumed into: the learner (trainer/grpo.py)."""

    trl: Any  # TRL's GRPOTrainer: its accelerator, optimizer and scheduler
    model: Any
    tokenizer: Any
    rank: int
    fsdp: bool
    lora: dict[str, Any] | None  # the LoRA settings of a LoRA run
    sharding: str
    serve_dtype: Any


def save_version(learner: Versioned, directory: Path, with_optimizer: bool) -> None:
    """`Learner.save` on every rank: rank 0 writes what vLLM serves, gathered from the shards
    when sharded; with `with_optimizer`, each rank its part of the learner's state."""
    import torch

    model = learner.trl.accelerator.unwrap_model(learner.model)
    weights = full_weights(learner.model) if learner.fsdp else None  # onto rank 0 (FSDP2 refuses LoRA)
    directory.mkdir(parents=True, exist_ok=True)
    if not learner.rank:
        if learner.lora:
            model.save_pretrained(directory, safe_serialization=True)
        else:
            save_served(model, model.state_dict() if weights is None else weights, directory, learner.serve_dtype)
        learner.tokenizer.save_pretrained(directory)
    del weights
    if with_optimizer:
        save_state(learner.model, learner.trl.optimizer, directory / "learner", distributed=learner.fsdp)
        if not learner.rank:
            kept = {"scheduler": learner.trl.lr_scheduler.state_dict(), "sharding": learner.sharding}
            torch.save(kept, directory / "learner" / "scheduler.pt")


def resume(learner: Versioned, directory: Path) -> None:
    """Put a checkpoint's learner state into `learner` (every rank)."""
    import torch

    if not (directory / "learner" / "scheduler.pt").exists():
        older = (
            " (optimizer.pt: written before checkpoints kept learner/)" if (directory / "optimizer.pt").exists() else ""
        )
        raise ValueError(
            f"{directory} holds no learner state (learner/){older}: resume it with the rl-proxy that wrote it, "
            "or start a new run"
        )
    # To the CPU first: under torchrun a CPU rank's device reads "cpu:0", which torch.load cannot restore to.
    kept = torch.load(directory / "learner" / "scheduler.pt", map_location="cpu", weights_only=True)
    if kept["sharding"] != learner.sharding:
        raise ValueError(
            f"{directory} holds the state of a {kept['sharding']} run; this one is {learner.sharding}: resume "
            "with the sharding the run started with"
        )
    load_state(learner.model, learner.trl.optimizer, directory / "learner", distributed=learner.fsdp)
    learner.trl.lr_scheduler.load_state_dict(kept["scheduler"])


def full_weights(model: Any) -> dict[str, Any]:
    """The whole model's state dict gathered from every rank's shards onto rank 0's CPU (a
    collective: every rank calls it; the others get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_state(model: Any, optimizer: Any, directory: Path, distributed: bool) -> None:
    """What the learner resumes from: its trained parameters (the float32 masters, not the
    weights vLLM serves) and its optimizer state, in torch's distributed checkpoint format.
    `distributed` (FSDP2; a collective): each rank writes its own shards, and no rank gathers
    the whole; else this process writes it all."""
    import torch.distributed.checkpoint as dcp

    weights, state = _state(model, optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # what no_dist means
        dcp.save({"model": weights, "optimizer": state}, checkpoint_id=directory, no_dist=not distributed)


def load_state(model: Any, optimizer: Any, directory: Path, distributed: bool) -> None:
    """Put a `save_state` checkpoint into the model and optimizer: each FSDP2 rank reads its own
    shards only (a rank never holds the whole optimizer state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    weights, state = _state(model, optimizer)
    loaded = {"model": weights, "optimizer": state}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(loaded, checkpoint_id=directory, no_dist=not distributed)
    set_state_dict(
        model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"], options=_trained()
    )


def _state(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, optimizer, options=_trained())


def _trained() -> Any:
    """The parameters a checkpoint keeps: the trained ones (a LoRA run's adapters only; the frozen
    base is not missing from a model they are loaded into)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=False)


def serving_dtype(choice: str, checkpoint: str) -> Any:
    """The dtype versions are saved in for vLLM: `choice`, or with "auto" what vLLM's own dtype
    auto serves `checkpoint` in: its 16-bit dtype, and bfloat16 for a float32 one (vLLM downcasts
    float32 to bfloat16 on CPU and on GPUs that have it; one without converts bf16 to fp16)."""
    import torch
    from transformers import AutoConfig

    if choice != "auto":
        return getattr(torch, choice)
    given = AutoConfig.from_pretrained(checkpoint).dtype
    given = getattr(torch, given) if isinstance(given, str) else given
    return given if given in (torch.bfloat16, torch.float16) else torch.bfloat16


def save_served(model: Any, weights: dict[str, Any], directory: Path, dtype: Any) -> None:
    """Write whole weights as the model's own safetensors directory for vLLM (rank 0), in the
    dtype vLLM serves (`dtype`), its config saying so: float32 masters saved for a bf16 server
    doubled the disk per version and the bytes each swap reads. A parameter shared by two
    modules (tied embeddings) is gathered once per name, as copies that save_pretrained cannot
    tell are one: kept under its first name only, as unsharded."""
    first: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            tied.add(name)
    served = {k: v.to("cpu", dtype if v.is_floating_point() else v.dtype) for k, v in weights.items() if k not in tied}
    model.save_pretrained(directory, state_dict=served, safe_serialization=True)
    config = json.loads((directory / "config.json").read_text())  # save_pretrained wrote the masters' dtype
    config["dtype"] = str(dtype).removeprefix("torch.")
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
