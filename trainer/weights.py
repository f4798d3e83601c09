"""A step's loss as one explicit weighted sum, and the terms the learner adds to TRL's.

The loss of a step is the sum over its trained tokens of w(t) x TRL's per-token loss for the
run's `loss_type` (`token_weights` gives w). TRL computes the per-token policy loss and then
averages it in a way of its own per loss type; `Learner.loss` undoes that average, so that the
weights are the whole normalization. Every type's policy loss is linear in the advantage (a
positive scale keeps each clip and sign test as it was), so a row's weight goes in with its
advantage: the clipped-ratio types are computed as dapo (a token sum over `num_items_in_batch`
per process, made 1), cispo and vespo sum alike, and sapo's mean of row means is undone by each
row's token count and the row count. The KL term is not linear in the advantage: TRL runs
without it (beta 0) and `kl_term` adds it, weighted the same. tests/trainer/test_grpo_loss.py
checks every type against the formula, so a TRL upgrade that changes its averages fails there.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.sample import Sample

log = logging.getLogger("rl_proxy.trainer")

# The loss types whose per-token loss is TRL's clipped ratio (they differ only in how they average
# it): TRL computes it under "dapo", whose sum the weights below make explicit.
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def token_weights(samples: list[Sample], loss_type: str, max_completion_length: int | None) -> dict[int, float]:
    """The weight of each trained token in a step's loss, which is the sum over the step's trained
    tokens of weight x TRL's per-token loss (its policy term and, with beta, its KL term alike).
    A token's weight is its sample's (keyed by `id(sample)`; fillers weigh 0). With E the step's
    episodes (those with a trained token), N_e an episode's trained tokens over all its sequences,
    N the step's and L `max_completion_length`:

    - grpo, sapo: 1 / (E N_e): each episode's token mean, averaged over episodes;
    - bnpo, dapo, cispo, vespo: 1 / N: the mean over the step's tokens;
    - dr_grpo: 1 / (E L): each episode's token sum over a fixed length, averaged over episodes;
    - luspo: 1 / E: each episode's token sum, averaged over episodes.

    So an episode counts once however it was cut into sequences (a subagent, a compaction, a
    fork), and each of its tokens weighs the same wherever it sits: TRL's row means made a
    10-token subagent's tokens weigh 10x the main thread's in an episode cut 100/10/10."""
    trained = [s for s in samples if not s.filler and s.sequence.sampled_tokens]
    per_episode = Counter[str]()
    for s in trained:
        per_episode[s.sequence.session_id] += s.sequence.sampled_tokens
    episodes, tokens = len(per_episode), sum(per_episode.values())
    if loss_type in ("grpo", "sapo"):
        return {id(s): 1.0 / (episodes * per_episode[s.sequence.session_id]) for s in trained}
    if loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type dr_grpo divides by grpo.max_completion_length: set it")
        return {id(s): 1.0 / (episodes * max_completion_length) for s in trained}
    if loss_type == "luspo":
        return {id(s): 1.0 / episodes for s in trained}
    return {id(s): 1.0 / tokens for s in trained}


def learner_settings(bf16: bool, grpo: dict[str, Any]) -> dict[str, Any]:
    """The GRPOConfig fields the learner sets unless the run's `grpo` section does. Gradient
    checkpointing (TRL's default) trades a second forward pass for memory: off unless asked for.
    ddp_timeout: with several processes the other ranks wait for rank 0's batches through vLLM's
    start and every evaluation; torch's default 30 min would end the run. The importance-sampling
    correction is per token: TRL's default, sequence_mask, multiplies the ratios of every sampled
    token of a sequence, and an agent's sequence merges many calls, so whole sequences were
    masked; the recorded behaviour logprobs are exact per token."""
    settings = {
        "bf16": bf16,
        "gradient_checkpointing": False,
        "ddp_timeout": 7 * 86400,
        "vllm_importance_sampling_mode": "token_truncate",
        **grpo,
    }
    mode = str(settings["vllm_importance_sampling_mode"])
    if settings.get("vllm_importance_sampling_correction", True) and mode.startswith("sequence"):
        log.warning(
            "vllm_importance_sampling_mode %s multiplies the ratios of every sampled token of a merged "
            "multi-call sequence: a long agent sequence is masked or truncated whole; token_truncate "
            "corrects each token",
            mode,
        )
    return settings


def importance_ratio(old: Any, behaviour: Any, mask: Any, args: Any) -> tuple[Any, Any]:
    """(the log ratio, the ratio as capped or masked) of the old-policy to the behaviour logprobs,
    per token or per sequence, as TRL makes it for samples from vLLM."""
    import torch

    diff = ((old - behaviour) * mask).nan_to_num(0.0)
    if args.vllm_importance_sampling_mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    if args.vllm_importance_sampling_mode.endswith("truncate"):
        return diff, torch.clamp(ratio, min=low, max=high)
    outside = (ratio < (low if low is not None else -math.inf)) | (ratio > (high if high is not None else math.inf))
    return diff, ratio.masked_fill(outside, 0.0)


def kl_term(logps: Any, batch: dict[str, Any], mask: Any, weights: Any, args: Any) -> tuple[Any, Any]:
    """(the weighted sum of the per-token KL to the reference, its token mean for the metrics):
    TRL's estimator (k3), with its importance-sampling correction where `use_bias_correction_kl`
    asks for it."""
    import torch

    diff = batch["ref_per_token_logps"] - logps
    kl = torch.exp(diff) - diff - 1
    if args.use_bias_correction_kl:
        log_ratio = logps - batch["old_per_token_logps"]
        if args.importance_sampling_level == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
        kl = kl * torch.exp(log_ratio)
    shown = (kl.detach() * mask).sum() / mask.sum().clamp(min=1.0)
    return (kl * mask * weights[:, None]).sum(), shown
