"""The learner's forward pass where it differs from TRL's padded batch: each GRPO group's prompt
run once for all its rows (`shared_prefix_logps`), rows in passes of like lengths
(`length_buckets`), the check that a model can take that path (`prompt_cache_fits`), what each
path costs on this device (`pass_overhead`, `sharing_pays`), and freed heap handed back to the OS
between steps. grpo.py decides when to use it; TRL's loss is the same either way.

The cost of a pass is taken as a fixed part plus a part per token, and the fixed part is counted
in tokens (`pass_overhead`): on two CPU cores it is tens of tokens, so passes of like lengths and
a prompt run once pay; on a GPU a pass costs thousands (issue 48, an H200), so the shared
prompt pays only where it saves many tokens per pass it adds (long agent prompts), and a batch
of short prompts goes through TRL's padded batch.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import time
from collections.abc import Sequence
from typing import Any

from trainer.sharding import sharded


def release_memory() -> None:
    """Hand freed heap back to the OS. glibc keeps it in per-thread arenas: a training run on
    CPU grew from 5 to 20 GB in 12 steps and was killed; with this, a step ends at 2.5 GB."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


CPU_OVERHEAD = 16.0  # a pass's fixed cost in tokens on two CPU cores, where the learner was first tuned


def length_buckets(lengths: Sequence[int], most: int, overhead: float = CPU_OVERHEAD) -> list[list[int]]:
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
    wrapper around it (DDP, FSDP; a PEFT model and FSDP2, which wraps nothing, are fine), no
    layer checkpointed by transformers (it drops the cache; `sharding.checkpoint_layers` keeps
    it), a plain key/value cache in every layer (a sliding window keeps only its last keys, a
    linear attention layer has none), and RoPE whose frequencies do not depend on a pass's longest
    position (dynamic, longrope)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    unwrapped = accelerator.unwrap_model(model)
    config = unwrapped.config
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return (
        unwrapped is model
        and not unwrapped.is_gradient_checkpointing
        and not (isinstance(rope, dict) and rope.get("rope_type") in ("dynamic", "longrope"))
        and all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)
    )


def replayable(config: Any, head: Any = None, rows: int = 1) -> Any:
    """A key/value cache for the shared-prompt passes that a checkpointed layer can run twice (its
    forward again in the backward pass, `sharding.checkpoint_layers`). Without `head`, a head
    pass's: each layer keeps the keys and values of its first call only (its replay must not
    append them again). With `head` (such a cache, filled), a rows' pass's: each layer returns
    the head's keys and values (expanded to `rows`) and the pass's, and keeps nothing."""
    import torch
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class Replayable(DynamicLayer):
        def __init__(self, keys: Any = None, values: Any = None) -> None:
            super().__init__()
            self.prefix = None if keys is None else (keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1))
            self.reached = 0  # the positions its last pass attended over

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            if self.prefix is None:
                if not self.is_initialized:
                    self.lazy_initialization(key_states, value_states)
                    self.keys, self.values = key_states, value_states
                keys, values = key_states, value_states
            else:
                keys = torch.cat([self.prefix[0], key_states], dim=-2)
                values = torch.cat([self.prefix[1], value_states], dim=-2)
            self.reached = keys.size(-2)
            return keys, values

        def get_seq_length(self) -> int:
            return self.prefix[0].size(-2) if self.prefix is not None else super().get_seq_length()

    cache = DynamicCache(config=config)
    if head is None:
        cache.layers = [Replayable() for _ in cache.layers]
    else:
        cache.layers = [Replayable(layer.keys, layer.values) for layer in head.layers]
    return cache


def pass_overhead(model: Any, accelerator: Any, vocab: int, length: int = 4096, rows: int = 4) -> float:
    """The fixed cost of a forward and backward pass on this device, in tokens: a pass of one
    row of 32 random tokens (all fixed cost) over what a token costs in a pass of `rows` rows of
    `length` (a size a step's passes have), both through `model` as the learner runs it
    (autocast, TRL's fused LM head), timed after a warm-up, the fastest of three (what the device
    does, not what else ran meanwhile). The gradients it made are dropped. On a CPU it is
    CPU_OVERHEAD, not measured: there a pass of 16,384 tokens takes minutes, and two cores
    shared with vLLM time it too unsteadily.

    Not a line through two small passes: on an H200 a pass of SmolLM2-135M took as long for
    32 tokens as for 1,024, and as for 16,384 as for four passes of 4,096 (the GPU waits on
    the launches), so both fits said a pass was worth 100,000 tokens, and the agent shape went
    through the padded batch at 0.60x of the shared path (issue 48)."""
    if accelerator.device.type == "cpu":
        return CPU_OVERHEAD
    return measured_overhead(model, accelerator, vocab, length, rows)


def measured_overhead(model: Any, accelerator: Any, vocab: int, length: int = 4096, rows: int = 4) -> float:
    """`pass_overhead` as timed on the model's device (any device)."""
    import torch

    device = accelerator.device
    length = min(length, getattr(model.config, "max_position_embeddings", None) or length)

    def seconds(shape: tuple[int, int]) -> float:
        ids = torch.randint(0, vocab, shape, device=device)
        found = []
        for _ in range(4):
            _synchronize(device)
            start = time.perf_counter()
            with torch.enable_grad(), accelerator.autocast():
                out = model(input_ids=ids, labels=ids, fused_lm_head=True)
            out.log_probs.sum().backward()
            _synchronize(device)
            found.append(time.perf_counter() - start)
        return min(found[1:])

    fixed, full = seconds((1, 32)), seconds((rows, length))
    model.zero_grad(set_to_none=True)
    return min(max(fixed / full * rows * length, 1.0), 1e5)


def _synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The shared-prompt path's passes: per distinct prompt, its buckets of rows; and each row's length.
SharePlan = tuple[list[tuple[tuple[int, ...], list[list[int]]]], list[int]]


def share_plan(input_ids: Any, attention_mask: Any, keep: int, batch_size: int, overhead: float) -> SharePlan:
    """The shared-prompt path's passes for a TRL batch (prompts left-padded, completions
    right-padded): per distinct prompt, its rows in buckets of like completion lengths (at most
    `batch_size` rows a pass, `length_buckets`); and each row's completion length, up to its last
    attended column (at least one, so that a row wholly masked stays in the graph). Worked out
    on the CPU: row by row on a GPU, each row's prompt would wait for the work queued before."""
    input_ids, attention_mask = input_ids.cpu(), attention_mask.cpu()
    width = input_ids.size(1) - keep
    groups: dict[tuple[int, ...], list[int]] = {}
    for row in range(input_ids.size(0)):
        prompt = input_ids[row, :width][attention_mask[row, :width].bool()]
        groups.setdefault(tuple(prompt.tolist()), []).append(row)
    lengths = (attention_mask[:, width:].cumsum(1).argmax(1) + 1).tolist()
    plan = [
        (prompt, [[rows[i] for i in b] for b in length_buckets([lengths[r] for r in rows], batch_size, overhead)])
        for prompt, rows in groups.items()
    ]
    return plan, lengths


def sharing_pays(input_ids: Any, plan: SharePlan, batch_size: int, overhead: float) -> bool:
    """Whether the shared-prompt path's `plan` (`share_plan`) costs fewer tokens than TRL's padded
    batch, a pass counted as `overhead` tokens: TRL's runs passes of `batch_size` rows, each row
    padded to the batch's width; the shared path one pass per prompt (but its last token) and one
    per bucket of rows."""
    rows = input_ids.size(0)
    padded = math.ceil(rows / batch_size) * overhead + rows * input_ids.size(1)
    passes, lengths = plan
    shared = sum(
        (len(prompt) - 1 + overhead if len(prompt) > 1 else 0.0)
        + sum(overhead + len(bucket) * (1 + max(lengths[r] for r in bucket)) for bucket in buckets)
        for prompt, buckets in passes
    )
    return shared < padded


def shared_prefix_logps(
    model: Any,
    input_ids: Any,
    attention_mask: Any,
    keep: int,
    accelerator: Any,
    plan: SharePlan,
    compute_entropy: bool = False,
) -> tuple[Any, Any]:
    """Per-token logprobs (and entropies) of the last `keep` columns of a TRL batch (prompts
    left-padded, completions right-padded), as TRL's fused LM head gives them, with each prompt
    run once for all the rows that share it: its keys and values are computed once (gradients
    flow back through them from every row) and the rows run only their completions, in the passes
    of like lengths that `plan` holds (`share_plan`) instead of padded to the longest. A GRPO
    group's rows share their prompt (system, demo, task), most of each sequence in the example.
    Positions are those vLLM sampled at (no left padding)."""
    import torch

    width = input_ids.size(1) - keep
    passes, lengths = plan
    unwrapped = accelerator.unwrap_model(model)
    causal = unwrapped.get_base_model() if hasattr(unwrapped, "peft_config") else unwrapped  # LoRA layers inside
    units = [m for m in causal.modules() if sharded(m) and m is not causal]  # FSDP2's decoder layers
    if units:
        passes = in_step(passes)
    rows_done, logps, entropies, idle = [], [], [], []
    for prompt, buckets in passes:
        # The prompt but its last token, whose output scores the first sampled one; sharded, a
        # prompt of one token gets a head too (a masked token), so that every rank runs one.
        head = prompt[:-1] or ((0,) if units else ())
        seen = [int(bool(prompt[:-1]))] * len(head) + [1]  # what the rows attend to of the head and the last token
        cache = replayable(unwrapped.config)
        if head:
            with accelerator.autocast():
                causal(
                    input_ids=torch.tensor([head], device=input_ids.device),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            if units:  # see `in_step`
                for unit, layer in zip(units, cache.layers, strict=True):
                    for kv in (layer.keys, layer.values):
                        if kv.requires_grad:
                            kv.register_hook(lambda _, unit=unit: unit.unshard())
        for part in buckets:
            used = max((lengths[r] for r in part), default=1)
            tail = attention_mask[part, width : width + used] if part else attention_mask.new_ones(1, 1)
            rest = input_ids[part, width : width + used] if part else input_ids.new_zeros(1, 1)
            ids = torch.cat([input_ids.new_full((len(rest), 1), prompt[-1]), rest], 1)
            mask = torch.cat([tail.new_tensor([seen]).expand(len(rest), -1), tail], 1)
            labels = ids.masked_fill(mask[:, -ids.size(1) :] == 0, -100)
            labels[:, 0] = -100
            shared = replayable(unwrapped.config, cache if head else None, len(rest))
            positions = torch.arange(len(prompt) - 1, len(prompt) + used, device=input_ids.device).expand(len(rest), -1)
            with accelerator.autocast():
                out = model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=shared,
                    labels=labels,
                    fused_lm_head=True,
                )
            if (reached := min(layer.reached for layer in shared.layers)) != len(head) + 1 + used:
                raise RuntimeError(  # a layer that did not take the cache
                    f"a pass on the shared prompt's cache attended over {reached} positions, not "
                    f"{len(head) + 1 + used}: this model's layers did not take it, and "
                    "prompt_cache_fits should have sent TRL's own path"
                )
            if not part:  # a pass that keeps the ranks in step
                idle.append(out.log_probs.sum())
                continue
            rows_done += part
            logps.append(torch.nn.functional.pad(out.log_probs, (0, keep - used)))
            entropies.append(torch.nn.functional.pad(out.entropy, (0, keep - used)) if compute_entropy else None)
    order = torch.tensor(rows_done, device=input_ids.device).argsort()  # back to the batch's rows
    found = torch.cat(logps)[order]
    if idle:  # in the loss at weight 0: their backward passes run, as many as the other ranks'
        found = found + 0.0 * torch.stack(idle).sum()
    return found, torch.cat(entropies)[order] if compute_entropy else None


def in_step(plan: list[tuple[tuple[int, ...], list[list[int]]]]) -> list[tuple[tuple[int, ...], list[list[int]]]]:
    """A rank's plan of passes (per prompt, its buckets of rows) topped up so that every rank runs
    the same passes in the same order: under FSDP2 each pass gathers every layer from every rank,
    and its backward reduce-scatters the layer's gradient, so the ranks' collectives pair up only
    if their passes do. A missing prompt is a one-token head with one idle bucket, a missing
    bucket an idle one (a row of one token, in the loss at weight 0).

    The head's layers get their gradients through its keys and values, which the rows' passes
    read from the cache, and not through the layers' outputs, where FSDP2 hooks the gather of
    their weights for the backward pass: `shared_prefix_logps` hooks it on the keys and values."""
    import torch.distributed as dist

    shapes: list[list[int]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(shapes, [len(buckets) for _, buckets in plan])
    most = [max(s[g] for s in shapes if g < len(s)) for g in range(max(map(len, shapes)))]
    padded = plan + [((0, 0), [])] * (len(most) - len(plan))
    return [(prompt, buckets + [[]] * (n - len(buckets))) for (prompt, buckets), n in zip(padded, most, strict=True)]
