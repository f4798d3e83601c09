"""The learner on several processes: plain data parallel (every rank holds the whole model, the
gradients are averaged in buckets once a step) or FSDP2 (`fully_shard`: parameters, gradients
and optimizer state sharded across ranks, each layer gathered for its forward and backward,
gradients reduce-scattered). grpo.py decides when; this module holds the collectives, and the
per-layer activation checkpointing that composes with both.

FSDP2 wraps modules in place (the model stays the same object, its parameters DTensors), unlike
DDP's wrapper. Every forward pass gathers each layer from every rank, so every rank must run the
same passes: the shared-prompt step plans its passes per prompt and length bucket of a rank's
own rows, and tops them up to the same plan on every rank (`forward.in_step`). The weights for
vLLM are gathered whole onto rank 0; a checkpoint is written by every rank, its own shards
(trainer/checkpoint.py).
"""

from __future__ import annotations

from typing import Any

SHARDINGS = ("replicate", "fsdp2")


def decoder_layers(model: Any) -> list[Any]:
    """The model's decoder layers (the classes it names in `_no_split_modules`), in order."""
    layers = set(getattr(model, "_no_split_modules", None) or [])
    base = getattr(model, "get_base_model", lambda: model)()  # a PEFT model names them on its base
    layers |= set(getattr(base, "_no_split_modules", None) or [])
    if not layers:
        raise ValueError(f"{type(base).__name__} names no decoder layer class (_no_split_modules)")
    return [m for m in model.modules() if type(m).__name__ in layers]


def shard(model: Any) -> None:
    """FSDP2 over `model`: each decoder layer a unit of its own, then the rest (embeddings, final
    norm, LM head) as the root. Checkpointed layers (`checkpoint_layers`) stay so: the
    checkpoint runs inside the unit's forward, where FSDP2 has gathered the layer's weights (and
    gathers them again for its backward, before the replay)."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)


def checkpoint_layers(model: Any) -> None:
    """Activation checkpointing per decoder layer (torch's, non-reentrant): a layer keeps only its
    inputs for the backward pass and runs its forward again there. Not transformers' own, which
    drops the key/value cache that the shared-prompt step runs on (forward.replayable is the
    cache a layer can run twice on). The model makes no cache of its own (a replayed layer would
    append its keys to it twice): set here, not left to the Trainer that sets it today."""
    from torch.utils.checkpoint import checkpoint

    model.config.use_cache = False
    for layer in decoder_layers(model):

        def forward(*args: Any, _forward: Any = layer.forward, **kwargs: Any) -> Any:
            import torch

            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = forward


def sharded(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


def average_gradients(parameters: list[Any], world: int) -> None:
    """What DDP does, bucket by bucket (25 MB, as DDP's reducer): each bucket of trained
    parameters' gradients flattened, all-reduced and copied back, so that at most one bucket is
    held twice (one flat buffer of every gradient doubled their memory). A parameter this rank's
    passes left unused (a mixture-of-experts expert no row of this rank reached) gets a zero
    gradient first, so that every rank sends the same buckets."""
    import torch
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    trained = [p for p in parameters if p.requires_grad]
    for param in trained:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    buckets: list[list[Any]] = []
    size = BUCKET_BYTES
    for param in trained:
        if size >= BUCKET_BYTES or param.grad.dtype != buckets[-1][0].grad.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(param)
        size += param.grad.numel() * param.grad.element_size()
    for bucket in buckets:
        grads = [p.grad for p in bucket]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat /= world
        for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(averaged)


def full_norm(norm: Any) -> float:
    """A gradient norm as a number: over FSDP2's DTensor gradients it is a DTensor itself."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
