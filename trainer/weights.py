"""A step's loss as one explicit weighted sum, written here term by term.

The loss of a step is the sum over its trained tokens of w(t) x the per-token loss of the run's
`loss_type` (`token_weights` gives w), plus, with beta, w(t) x beta x the KL to the reference
(`kl_term`). The per-token loss is TRL 1.16's (`GRPOTrainer._compute_loss`, before it averages):
`per_token_loss` writes it out, with TRL's own functions for the parts TRL exposes (the
off-policy sequence mask, VESPO's gamma weights, the high-entropy mask), and never calls TRL's
`compute_loss` or sets an attribute of TRL's trainer: TRL averages each type its own way, and
undoing that by setting its attributes would break silently when TRL reads one more.
tests/trainer/test_grpo_loss.py checks every type against TRL's own `compute_loss` on single
rows and against the formula written out, so a TRL upgrade that changes its per-token loss fails
there.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.sample import Sample

log = logging.getLogger("rl_proxy.trainer")

# The loss types whose per-token loss is the clipped ratio (they differ only in how TRL averages it,
# which the token weights replace).
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# What TRL's compute_loss adds beyond the per-token loss, which the learner does not build.
UNBUILT = {
    "entropy_coef": "an entropy bonus",
    "use_adaptive_entropy": "an adaptive entropy bonus",
}


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


def kl_term(logps: Any, batch: dict[str, Any], mask: Any, args: Any) -> Any:
    """The per-token KL to the reference: TRL's estimator (k3), with its importance-sampling
    correction where `use_bias_correction_kl` asks for it."""
    import torch

    diff = batch["ref_per_token_logps"] - logps
    kl = torch.exp(diff) - diff - 1
    if args.use_bias_correction_kl:
        log_ratio = logps - batch["old_per_token_logps"]
        if args.importance_sampling_level == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
        kl = kl * torch.exp(log_ratio)
    return kl


def per_token_loss(trl: Any, logps: Any, entropies: Any, batch: dict[str, Any], mask: Any) -> tuple[Any, Any]:
    """(the per-token policy loss of `args.loss_type`, (B, T) or (B, 1) at sequence level; the
    clipped tokens, for the metrics, or None), as TRL 1.16's `_compute_loss` makes it before its
    average: the importance ratio to the old policy (per token or per sequence), the type's
    clipped or soft objective, then TRL's off-policy mask, its high-entropy mask and vLLM's
    importance-sampling correction where the run asks for them. `trl` is TRL's GRPOTrainer:
    only read (its `args`, and its high-entropy mask, which takes the quantile over every
    process's tokens)."""
    import torch
    from trl import GRPOTrainer

    args = trl.args
    advantages = batch["advantages"][:, None]
    log_ratio = logps - batch["old_per_token_logps"]
    if args.importance_sampling_level == "sequence":
        log_ratio_used = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    else:
        log_ratio_used = log_ratio
    ratio = torch.exp(log_ratio_used)
    low, high = args.epsilon, args.epsilon_high if args.epsilon_high is not None else args.epsilon
    clipped = None
    if args.loss_type == "cispo":
        loss = -torch.clamp(ratio, max=high).detach() * advantages * logps
        clipped = (ratio > high) & (advantages > 0)
    elif args.loss_type in CLIPPED:
        bounded = torch.clamp(ratio, 1 - low, 1 + high)
        if args.delta is not None:  # two-sided clipping
            ratio = torch.clamp(ratio, max=args.delta)
        loss = -torch.min(ratio * advantages, bounded * advantages)
        clipped = ((ratio < 1 - low) & (advantages < 0)) | ((ratio > 1 + high) & (advantages > 0))
    elif args.loss_type == "sapo":
        temperature = torch.where(advantages > 0, args.sapo_temperature_pos, args.sapo_temperature_neg)
        loss = -torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature * advantages
    elif args.loss_type == "vespo":
        phi = GRPOTrainer.get_gamma_weights(
            advantages=advantages,
            log_ratio_per_token=log_ratio,
            mask=mask,
            importance_sampling_ratio=batch.get("importance_sampling_ratio"),
            k_pos=args.vespo_k_pos,
            lambda_pos=args.vespo_lambda_pos,
            k_neg=args.vespo_k_neg,
            lambda_neg=args.vespo_lambda_neg,
        )
        loss = -phi * advantages * logps
    else:
        raise ValueError(f"unknown loss_type {args.loss_type!r}")
    if args.off_policy_mask_threshold is not None:
        loss = loss * GRPOTrainer.get_off_policy_mask(
            advantages=advantages,
            per_token_logps=logps,
            sampling_per_token_logps=batch["sampling_per_token_logps"],
            mask=mask,
            off_policy_threshold=args.off_policy_mask_threshold,
        )
    if args.top_entropy_quantile < 1.0:
        loss = loss * trl.get_high_entropy_mask(entropies, mask, 1 - args.top_entropy_quantile)
    if args.vllm_importance_sampling_correction and args.loss_type != "vespo":
        loss = loss * batch["importance_sampling_ratio"]
    return loss, clipped
