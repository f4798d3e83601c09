"""The learner on several processes: plain data parallel (every rank holds the whole model, the
gradients are averaged in one flat all-reduce a step) or FSDP2 (`fully_shard`: parameters,
gradients and optimizer state sharded across ranks, each layer gathered for its forward and
backward, gradients reduce-scattered). grpo.py decides when; this module holds the collectives.

FSDP2 wraps modules in place (the model stays the same object, its parameters DTensors), unlike
DDP's wrapper. But every forward pass gathers each layer from every rank, so every rank must run
as many passes: the shared-prompt path runs one per prompt and length bucket of a rank's own
rows, a number that differs between ranks (tried: the ranks waited on each other's collectives
for good). Sharded, the learner runs TRL's padded batch, one pass a micro-batch, as many on
every rank (forward.prompt_cache_fits says no). What a rank writes (weights for vLLM, a
checkpoint) is first gathered whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHARDINGS = ("replicate", "fsdp2")


def shard(model: Any) -> None:
    """FSDP2 over `model`: each decoder layer (the classes the model names in `_no_split_modules`)
    a unit of its own, then the rest (embeddings, final norm, LM head) as the root."""
    from torch.distributed.fsdp import fully_shard

    layers = set(getattr(model, "_no_split_modules", None) or [])
    base = getattr(model, "get_base_model", lambda: model)()  # a PEFT model names them on its base
    layers |= set(getattr(base, "_no_split_modules", None) or [])
    if not layers:
        raise ValueError(f"{type(base).__name__} names no decoder layer class (_no_split_modules) to shard by")
    for module in model.modules():
        if type(module).__name__ in layers:
            fully_shard(module)
    fully_shard(model)


def sharded(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def average_gradients(parameters: list[Any], world: int) -> None:
    """What DDP does, in one flat all-reduce: every trained parameter's gradient, a zero one where
    this rank's passes left it unused (a mixture-of-experts expert no row of this rank reached),
    so that every rank sends the same buffer."""
    import torch
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    trained = [p for p in parameters if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in trained]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= world
    for param, grad in zip(trained, _unflatten_dense_tensors(flat, grads), strict=True):
        param.grad = grad


def full_norm(norm: Any) -> float:
    """A gradient norm as a number: over FSDP2's DTensor gradients it is a DTensor itself."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def full_states(model: Any, optimizer: Any | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The whole model's state dict and the optimizer's, gathered from every rank's shards (a
    collective: every rank calls it), on the CPU."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    return weights, None if optimizer is None else get_optimizer_state_dict(model, optimizer, options=options)


def load_full_optimizer(model: Any, optimizer: Any, state: dict[str, Any]) -> None:
    """Put a whole optimizer state (saved by `full_states`) into every rank's shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def save_full(model: Any, weights: dict[str, Any], directory: Path) -> None:
    """Write gathered weights as the model's own safetensors directory (rank 0). A parameter
    shared by two modules (tied embeddings) is gathered once per name, as copies that
    save_pretrained cannot tell are one: kept under its first name only, as unsharded."""
    first: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            tied.add(name)
    model.save_pretrained(
        directory, state_dict={k: v for k, v in weights.items() if k not in tied}, safe_serialization=True
    )
