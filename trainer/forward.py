"""The learner's forward pass where it differs from TRL's padded batch: each GRPO group's prompt
run once for all its rows (`shared_prefix_logps`), rows in passes of like lengths
(`length_buckets`), the check that a model can take that path (`prompt_cache_fits`), and freed
heap handed back to the OS between steps. grpo.py decides when to use it; TRL's loss is the same
either way.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
from collections.abc import Sequence
from typing import Any

from trainer.sharding import sharded


def release_memory() -> None:
    """Hand freed heap back to the OS. glibc keeps it in per-thread arenas: a training run on
    CPU grew from 5 to 20 GB in 12 steps and was killed; with this, a step ends at 2.5 GB."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def length_buckets(lengths: Sequence[int], most: int, overhead: int = 16) -> list[list[int]]:
    """The rows (indices into `lengths`) split into forward passes of at most `most` rows, each
    padded to its longest, so that the padded tokens plus `overhead` per pass are fewest: sorted
    by length, the best cut points by dynamic programming (a handful of rows per group)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    cost = [0.0] + [math.inf] * len(order)  # cost[j]: the best split of the j shortest rows
    cut = [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        for i in range(max(0, j - most), j):  # rows i..j-1 in one pass, padded to row j-1's length
            c = cost[i] + (j - i) * lengths[order[j - 1]] + overhead
            if c < cost[j]:
                cost[j], cut[j] = c, i
    passes, j = [], len(order)
    while j:
        passes.append(order[cut[j] : j])
        j = cut[j]
    return passes[::-1]


def prompt_cache_fits(model: Any, accelerator: Any) -> bool:
    """Whether `shared_prefix_logps` computes what TRL's padded batch does for this model: no
    wrapper around it (DDP, FSDP; a PEFT model is fine), not sharded by FSDP2 (its passes differ in
    number between ranks, and each gathers from all: trainer/sharding.py), no checkpointed layer
    (it drops the cache), a
    plain key/value cache in every layer (a sliding window keeps only its last keys, a linear
    attention layer has none), and RoPE whose frequencies do not depend on a pass's longest
    position (dynamic, longrope)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    unwrapped = accelerator.unwrap_model(model)
    config = unwrapped.config
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return (
        unwrapped is model
        and not sharded(unwrapped)
        and not unwrapped.is_gradient_checkpointing
        and not (isinstance(rope, dict) and rope.get("rope_type") in ("dynamic", "longrope"))
        and all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)
    )


def shared_prefix_logps(
    model: Any,
    input_ids: Any,
    attention_mask: Any,
    keep: int,
    accelerator: Any,
    batch_size: int | None = None,
    compute_entropy: bool = False,
) -> tuple[Any, Any]:
    """Per-token logprobs (and entropies) of the last `keep` columns of a TRL batch (prompts
    left-padded, completions right-padded), as TRL's fused LM head gives them, with each prompt
    run once for all the rows that share it: its keys and values are computed once (gradients
    flow back through them from every row) and the rows run only their completions, in passes of
    like lengths (`length_buckets`) instead of padded to the longest. A GRPO group's rows share
    their prompt (system, demo, task), most of each sequence in the example. Positions are those
    vLLM sampled at (no left padding)."""
    import torch
    from transformers import DynamicCache

    width = input_ids.size(1) - keep
    groups: dict[tuple[int, ...], list[int]] = {}
    for row in range(input_ids.size(0)):
        prompt = input_ids[row, :width][attention_mask[row, :width].bool()]
        groups.setdefault(tuple(prompt.tolist()), []).append(row)
    # Up to the last attended column (at least one, so that a row wholly masked stays in the graph).
    lengths = (attention_mask[:, width:].cumsum(1).argmax(1) + 1).tolist()
    rows_done, logps, entropies = [], [], []
    unwrapped = accelerator.unwrap_model(model)
    causal = unwrapped.get_base_model() if hasattr(unwrapped, "peft_config") else unwrapped  # LoRA layers inside
    for prompt, rows in groups.items():
        head = torch.tensor([prompt[:-1]], device=input_ids.device)
        cache = DynamicCache(config=unwrapped.config)
        if head.size(1):  # the prompt but its last token, whose output scores the first sampled one
            with accelerator.autocast():
                causal.base_model(input_ids=head, past_key_values=cache, use_cache=True)
        for bucket in length_buckets([lengths[r] for r in rows], batch_size or len(rows)):
            part = [rows[i] for i in bucket]
            used = max(lengths[r] for r in part)
            tail = attention_mask[part, width : width + used]
            ids = torch.cat([input_ids.new_full((len(part), 1), prompt[-1]), input_ids[part, width : width + used]], 1)
            mask = torch.cat([tail.new_ones(len(part), len(prompt)), tail], 1)
            labels = ids.masked_fill(mask[:, -ids.size(1) :] == 0, -100)
            labels[:, 0] = -100
            shared = DynamicCache(config=unwrapped.config)
            if head.size(1):
                kv = [(k.expand(len(part), -1, -1, -1), v.expand(len(part), -1, -1, -1)) for k, v, *_ in cache]
                shared = DynamicCache(kv, config=unwrapped.config)
            with accelerator.autocast():
                out = model(
                    input_ids=ids, attention_mask=mask, past_key_values=shared, labels=labels, fused_lm_head=True
                )
            if shared.get_seq_length() != len(prompt) + used:  # a layer that did not take the cache
                raise RuntimeError(
                    f"the shared prompt's cache holds {shared.get_seq_length()} positions after a pass, "
                    f"not {len(prompt) + used}: this model's layers did not take it, and "
                    "prompt_cache_fits should have sent TRL's own path"
                )
            rows_done += part
            logps.append(torch.nn.functional.pad(out.log_probs, (0, keep - used)))
            entropies.append(torch.nn.functional.pad(out.entropy, (0, keep - used)) if compute_entropy else None)
    order = torch.tensor(rows_done, device=input_ids.device).argsort()  # back to the batch's rows
    return torch.cat(logps)[order], torch.cat(entropies)[order] if compute_entropy else None
