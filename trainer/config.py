"""The YAML config of `rl-proxy train`: a collect config (tasks, harness, rewards, proxy) with
a `train` section and an optional `eval` section. Unknown keys are refused by name. Example:
harness_adapters/examples/arithmetic/train.yaml.

    train:
      steps: 30
      groups_per_step: 4        # GRPO groups (one task, episodes_per_task episodes) per step
      mode: auto                # async: rollouts go on while training; sync: generate, train, repeat;
                                # auto: async with a GPU, sync on CPU (faster there)
      max_staleness: 1          # optimizer steps a sample's policy may lag behind; older ones are dropped
      queue_groups: 4           # finished groups waiting for the trainer; more blocks rollouts
      sync_every: 1             # optimizer steps between weight swaps into vLLM
      curriculum: false         # sample tasks by their recent pass rate (groups likely to hold a signal)
      warm_start: 0             # the first steps supervised on the policy's own successes (RFT)
      warm_start_from: null     # ... or on the successes a store holds (a collect run's)
      max_groups_without_signal: 32   # groups in a row with nothing to train before the run stops
      grpo:                     # TRL GRPOConfig fields, with TRL's meaning and defaults
        loss_type: dapo
        learning_rate: 2.0e-5
      lora:                     # train LoRA adapters only (PEFT LoraConfig fields); each version
        r: 16                   # is loaded into vLLM as an adapter, without pausing it
      weight_sync: disk         # or nccl: GPU to GPU into vLLM (trainer/nccl.py)
    eval:
      split: heldout
      episodes_per_task: 4
      every: 10                 # also before the first step and after the last
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from harness_adapters.config import CollectConfig, Strict
from proxy.vllm import WEIGHT_TRANSFER_ARGS

# The GRPOConfig fields that mean something here; the rest are about TRL's own generation and
# data, or the Trainer's loop, which this trainer does not run (a test checks each is a field).
GRPO_KEYS = {
    "loss_type",
    "importance_sampling_level",
    "epsilon",
    "epsilon_high",
    "delta",
    "beta",
    "scale_rewards",
    "mask_truncated_completions",
    "temperature",
    "top_entropy_quantile",
    "off_policy_mask_threshold",
    "use_bias_correction_kl",
    "max_completion_length",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "max_grad_norm",
    "optim",
    "gradient_checkpointing",
    "bf16",
    "fp16",
    "seed",
    "ddp_timeout",
    "disable_dropout",
    "cast_lm_head_to_fp32",
}


def grpo_fields() -> set[str]:
    """Every field of TRL's GRPOConfig (TrainingArguments' included)."""
    import dataclasses

    from trl import GRPOConfig

    return {f.name for f in dataclasses.fields(GRPOConfig)}


LORA_DEFAULTS = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}


class TrainSection(Strict):
    steps: int = Field(20, ge=1)
    groups_per_step: int = Field(4, ge=1)
    mode: Literal["auto", "async", "sync"] = "auto"
    max_staleness: int = Field(1, ge=0)
    queue_groups: int = Field(4, ge=1, description="finished groups the trainer has not taken; more wait")
    sync_every: int = Field(1, ge=1)
    baseline: Literal["mean", "leave_one_out"] = "mean"
    failure_reward: float = Field(0.0, description="the reward of an episode whose harness crashed or timed out")
    curriculum: bool = Field(
        False,
        description="sample tasks by their chance of a group with both a success and a failure (recent pass rate)",
    )
    warm_start: int = Field(
        0,
        ge=0,
        description="the first steps are supervised, on the successful episodes of the run's own groups "
        "(rejection-sampling fine-tuning): the recorded sampled tokens' log-likelihood; then GRPO (all of "
        "them: expert iteration alone)",
    )
    warm_start_from: str | None = Field(
        None,
        description="a store (SQLite path or SQLAlchemy URL: a collect run's, your own) whose successful "
        "episodes the warm start trains on instead of the run's own groups",
    )
    max_groups_without_signal: int = Field(
        32,
        ge=1,
        description="groups in a row with nothing to train (every episode scored the same; in a warm start, "
        "no success) before the run stops and says so: tasks the policy never or always solves",
    )
    min_calls: int = Field(
        1, ge=1, description="fewer calls than this in an episode is a FATAL capture (a harness expected to loop)"
    )
    allow_truncated_sampling: bool = Field(
        False, description="train on calls sampled with top_p, top_k, min_p or penalties (their ratios are off)"
    )
    micro_batch: int = Field(8, ge=1, description="sequences per forward/backward pass")
    keep_versions: int = Field(2, ge=1, description="weight directories kept (the newest, and the newest checkpoint)")
    checkpoint_every: int = Field(
        10, ge=1, description="steps between checkpoints to resume from (optimizer and loop state with the weights)"
    )
    report_to: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list)
    grpo: dict[str, Any] = Field(default_factory=dict, description="TRL GRPOConfig fields")
    lora: dict[str, Any] | None = Field(None, description="PEFT LoraConfig fields: train adapters only")
    weights_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="the learner's weights, whatever the checkpoint's: float32 master weights (bf16 autocast on a GPU "
        "that has it), or bfloat16 (half their memory; small updates are lost to rounding)",
    )
    serve_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="what each version is saved in for vLLM: auto is what vLLM's --dtype auto serves the model in (its "
        "16-bit dtype; bfloat16 for a float32 checkpoint); float32 for a vLLM run with --dtype float32. The learner's "
        "float32 masters stay in its checkpoints",
    )
    sharding: Literal["replicate", "fsdp2"] = Field(
        "replicate",
        description="with several learner processes: replicate (data parallel, every rank the whole model) or fsdp2 "
        "(parameters, gradients and optimizer state sharded across ranks: models that do not fit one device)",
    )
    weight_sync: Literal["disk", "nccl"] = Field(
        "disk", description="disk: safetensors that vLLM reloads; nccl: broadcast GPU to GPU (trainer/nccl.py)"
    )

    @model_validator(mode="after")
    def known(self) -> TrainSection:
        unknown = set(self.grpo) - GRPO_KEYS
        if unknown:
            foreign = sorted(unknown - grpo_fields())
            unused = sorted(unknown - set(foreign))
            raise ValueError(
                "grpo: "
                + "; ".join(
                    ([f"{unused} are GRPOConfig fields not used here (samples come from the store)"] if unused else [])
                    + ([f"{foreign} are not GRPOConfig fields"] if foreign else [])
                )
                + f"; used here: {sorted(GRPO_KEYS)}"
            )
        if self.lora is not None:
            import dataclasses

            from peft import LoraConfig

            fields = {f.name for f in dataclasses.fields(LoraConfig)}
            if set(self.lora) - fields:
                raise ValueError(f"lora: {sorted(set(self.lora) - fields)} are not PEFT LoraConfig fields")
            self.lora = {**LORA_DEFAULTS, **self.lora}
            if not isinstance(self.lora["r"], int) or not 1 <= self.lora["r"] <= 512:
                raise ValueError("lora: r must be a whole number from 1 to 512 (the ranks vLLM serves)")
            try:
                LoraConfig(**{"task_type": "CAUSAL_LM", **self.lora})
            except (TypeError, ValueError) as exc:
                raise ValueError(f"lora: {exc}") from exc
        if self.warm_start_from is not None and not self.warm_start:
            raise ValueError("warm_start_from: set warm_start to the number of supervised steps to run on it")
        if self.warm_start > self.steps:
            raise ValueError(f"warm_start: {self.warm_start} supervised steps, and the run has {self.steps} in all")
        if self.sharding == "fsdp2" and (self.lora is not None or self.weight_sync == "nccl"):
            raise ValueError("sharding: fsdp2 is built for full fine-tuning with the swap from disk (no lora, no nccl)")
        if self.weight_sync == "nccl" and self.lora is not None:
            raise ValueError("weight_sync: nccl sends whole weights; LoRA adapters go to vLLM from disk (leave it out)")
        if self.grpo.get("fp16"):
            # accelerate scales fp16 losses, but this loop steps the optimizer itself: the scaler
            # would never unscale (gradients ~65536x, every step clipped) nor skip an overflow.
            raise ValueError(
                "grpo: fp16 is refused: its loss scaling is not wired to this trainer's optimizer step, so "
                "gradients would stay scaled; use bf16: true on a GPU that has it (Ampere and newer), or fp32"
            )
        return self


class EvalSection(Strict):
    split: Literal["train", "heldout", "all"] = "heldout"
    episodes_per_task: int = Field(4, ge=1)
    every: int = Field(0, ge=0, description="steps between evaluations; 0: only before and after")


class TrainConfig(CollectConfig):
    split: Literal["train", "heldout", "all"] = "train"
    episodes_per_task: int = Field(4, ge=2)
    train: TrainSection = Field(default_factory=TrainSection)
    eval: EvalSection | None = None

    @model_validator(mode="after")
    def reachable(self) -> TrainConfig:
        p = self.proxy
        if p.url and not ("db" in p.model_fields_set and p.upstream):
            raise ValueError(
                "proxy: with 'url' (a running proxy), training also needs its 'db' and its vLLM 'upstream'"
            )
        rank = (self.train.lora or {}).get("r", 0)
        if rank > p.max_lora_rank:
            if "max_lora_rank" in p.model_fields_set:
                raise ValueError(f"proxy: max_lora_rank {p.max_lora_rank} is below the adapters' rank ({rank})")
            p.max_lora_rank = rank  # the vLLM launched for the run takes the adapters
        if self.train.weight_sync == "nccl" and not p.upstream and WEIGHT_TRANSFER_ARGS[0] not in p.vllm_args:
            p.vllm_args = [*p.vllm_args, *WEIGHT_TRANSFER_ARGS]  # the vLLM launched for the run opens its NCCL side
        forced = self.sampling.temperature if self.sampling else None
        scored = self.train.grpo.get("temperature", 1.0)
        if forced is not None and forced != scored:  # every episode would be refused for its sampling
            raise ValueError(f"sampling: temperature {forced}; the trainer scores at {scored} (train.grpo.temperature)")
        return self
