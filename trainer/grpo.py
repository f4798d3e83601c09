"""GRPO on recorded trajectories, with TRL's own per-token loss.

Why TRL's `GRPOTrainer` is used as a part and not run with `.train()`: its training loop
generates inside `_prepare_inputs` and walks an epoch-based dataloader, while here samples
arrive from the store while rollouts go on, are filtered by staleness when a step starts, and
weights are swapped into vLLM between steps. (TRL's own asynchronous trainer needs CUDA and
FlashAttention.) So the loop is ours, and inside a step TRL gives the model wrapper (reference
model for `beta`, accelerate, PEFT for LoRA), the optimizer and scheduler, the per-token
logprobs at the sampling temperature and the per-token loss of every `loss_type`, with its
metrics; how the tokens are weighed is trainer/weights.py's.

What goes into the loss: a recorded sequence splits where its first sampled token is; the
rest is TRL's completion, with the trajectory's loss mask as its `tool_mask`. The behaviour
logprobs the proxy recorded are the sampling logprobs: without vLLM importance-sampling
correction also the old-policy ones; with it (per token by default here), the old-policy
logprobs are the trainer's own before the step, and their ratio to the behaviour ones is
capped or masked as TRL does for its vLLM samples (AReaL's decoupled objective). A step is one
pass over its samples and one optimizer step, so without dropout the old-policy logprobs are
the loss forward's own, detached (as TRL takes them then): the no-grad forward that would
compute them again is skipped (`old_is_current`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from recorder.records import LearnerView
from trainer import checkpoint
from trainer.forward import (
    CPU_OVERHEAD,
    pass_overhead,
    prompt_cache_fits,
    release_memory,
    share_plan,
    shared_prefix_logps,
    sharing_pays,
)
from trainer.sample import Sample
from trainer.sharding import average_gradients, checkpoint_layers, full_norm, shard
from trainer.weights import CLIPPED, UNBUILT, importance_ratio, kl_term, learner_settings, per_token_loss, token_weights

T = TypeVar("T")
log = logging.getLogger("rl_proxy.trainer")


VIEWS_PER_STEP = 4  # sequences a step keeps the learner's logprobs of (LearnerView)


def dropout_free(model: Any) -> bool:
    """Whether a training-mode forward of `model` is its eval-mode one: no dropout module with a
    rate (a LoRA adapter's lora_dropout, for one), and no dropout rate in its config (Hugging Face
    attention applies `attention_dropout` itself, in training mode)."""
    import torch

    config = getattr(model, "config", None)
    found = vars(config).items() if config is not None else ()
    rates = [v for k, v in found if "drop" in k and isinstance(v, int | float) and not isinstance(v, bool)]
    modules = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    return not any(rates) and not any(modules)


class Learner:
    """The policy being trained: TRL's GRPOTrainer, fed batches of recorded samples."""

    def __init__(
        self,
        model_path: str,
        out_dir: Path,
        grpo: dict[str, Any],
        total_steps: int,
        micro_batch: int = 8,
        reference: str | None = None,
        lora: dict[str, Any] | None = None,
        weights_dtype: str = "float32",
        sharding: str = "replicate",
        serve_dtype: str = "auto",
        overhead: float | None = None,
    ) -> None:
        """The policy from `model_path`; with `beta`, the KL reference is `reference` (the base
        model, when `model_path` is a checkpoint resumed from) or else the policy as loaded.
        With `lora` (LoraConfig fields) only adapters on the base model `reference` are trained,
        and `model_path`, if not the base, is a saved adapter to go on from; the KL reference
        is then the base model (the adapter disabled). `weights_dtype` is what the weights are
        kept and stepped in, whatever the checkpoint's: float32 master weights (a bf16 checkpoint
        stepped in bf16 lost 98% of an lr 1e-6 update to rounding), with bf16 autocast where the
        GPU has it, as TRL does; or bfloat16 to halve their memory. With several processes,
        `sharding` is "replicate" (data parallel) or "fsdp2" (trainer/sharding.py). Versions are
        saved for vLLM in `serve_dtype` (`serving_dtype`). `overhead` is what a forward and
        backward pass costs beyond its tokens, in tokens (trainer/forward.py): None measures it on
        this device at the first step (until then, CPU_OVERHEAD)."""
        import torch
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
        from trl import GRPOConfig, GRPOTrainer

        cpu = not torch.cuda.is_available()
        bf16 = not cpu and torch.cuda.is_bf16_supported()  # autocast over fp32 weights, TRL's default there
        settings = learner_settings(bf16, grpo)
        args = GRPOConfig(
            output_dir=str(out_dir),
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            use_cpu=cpu,
            per_device_train_batch_size=2,
            num_generations=2,
            **settings,
        )
        unbuilt = [f"{name} ({what})" for name, what in UNBUILT.items() if getattr(args, name, None)]
        if unbuilt:
            raise ValueError(
                f"grpo: {', '.join(unbuilt)} is not built into rl-proxy's loss (trainer/weights.py writes it out "
                "term by term, and TRL's compute_loss is not called): leave it unset"
            )
        set_seed(args.seed)
        self.args = args
        self.micro_batch = micro_batch
        self.lora = lora
        adapter = Path(model_path) if lora and (Path(model_path) / "adapter_config.json").exists() else None
        weights = reference if adapter is not None and reference else model_path
        self.tokenizer = AutoTokenizer.from_pretrained(weights)
        self.serve_dtype = checkpoint.serving_dtype(serve_dtype, weights)
        model = AutoModelForCausalLM.from_pretrained(weights, dtype=getattr(torch, weights_dtype))
        if args.gradient_checkpointing:
            checkpoint_layers(model)  # a second forward pass per layer for memory
        peft_config = None
        if lora:
            from peft import LoraConfig

            peft_config = LoraConfig(**{"task_type": "CAUSAL_LM", **lora})
        self.trl = GRPOTrainer(
            model=model,
            args=args,
            processing_class=self.tokenizer,
            reward_funcs=[lambda completions, **_: [0.0] * len(completions)],  # rewards come from the store
            train_dataset=Dataset.from_list([{"prompt": ""}] * 2),
            peft_config=peft_config,
        )
        if adapter is not None:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            set_peft_model_state_dict(self.trl.model, load_file(adapter / "adapter_model.safetensors"))
        if self.trl.ref_model is not None and reference is not None and reference != model_path:
            base = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32 if cpu else "auto")
            self.trl.ref_model.load_state_dict(base.state_dict())
        if self.trl.aux_loss_enabled:
            raise ValueError("a mixture-of-experts router's auxiliary loss is not built into rl-proxy's loss")
        accelerator = self.trl.accelerator
        # Several processes (accelerate launch, torchrun): every rank loads the same weights (and
        # seeds its adapters alike); the gradients are averaged once a step (replicate), or the
        # model is sharded before its optimizer is made (fsdp2).
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.fsdp = sharding == "fsdp2" and self.world > 1
        self.sharding = "fsdp2" if self.fsdp else "replicate"
        if self.fsdp:
            if lora:
                raise ValueError("sharding: fsdp2 with LoRA adapters is not built; use replicate")
            shard(self.trl.model)
            if self.trl.ref_model is not None:
                shard(self.trl.ref_model)
        self.trl.create_optimizer_and_scheduler(num_training_steps=total_steps)
        self.model = self.trl.model
        self.device = accelerator.device
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # A step's sums over its trained tokens, for its metrics (`step`).
        self._sums = dict.fromkeys(("gap", "tokens", "capped", "judged", "entropy", "clipped", "kl"), 0.0)
        self._seen: Any = None  # the policy's logprobs of the last micro-batch, for the views
        self.views: list[LearnerView] = []  # what the last step saw of a few of its sequences
        # How a forward runs: True, the group's common prompt once per micro-batch, its KV shared
        # by the group's rows (`shared_prefix_logps`); False, TRL's own padded batch (the
        # benchmark's "plain"); None, whichever costs less on this device (`sharing_pays`).
        self.shared_prefix: bool | None = None
        self.overhead = overhead
        # One pass and one optimizer step per step: the weights the loss forward runs with are
        # the old policy's, and without dropout so are its logprobs.
        self.old_is_current = dropout_free(self.model)

    def row_weights(self, part: list[Sample], step: list[Sample] | None = None) -> Any:
        """Each row's token weight (`token_weights`) in a step of `step` (default: `part`)."""
        import torch

        counted = [s for s in step or part if not self._masked(s)]  # a masked truncated sequence trains nothing
        found = token_weights(counted, self.args.loss_type, self.args.max_completion_length)
        return torch.tensor([found.get(id(s), 0.0) for s in part], dtype=torch.float32)

    def inputs(
        self, samples: list[Sample], num_items: int | None = None, terms: bool = True, old: bool = True
    ) -> dict[str, Any]:
        """TRL's batch for these samples: prompts left-padded, completions right-padded, the
        loss mask as `tool_mask`, the behaviour logprobs as `sampling_per_token_logps`; with
        `terms`, the old-policy and reference logprobs the loss needs (`_policy_terms`). Without
        `old`, the old-policy ones are left to `loss`, from its own forward."""
        import torch

        prompts = [s.sequence.input_ids[: s.split] for s in samples]
        rests = [slice(s.split, len(s.sequence.input_ids)) for s in samples]
        width_p = max(len(p) for p in prompts)
        width_c = max(r.stop - r.start for r in rests)

        def completions(values: str, fill: Any) -> Any:
            rows = [getattr(s.sequence, values)[r] for s, r in zip(samples, rests, strict=True)]
            return torch.tensor([row + [fill] * (width_c - len(row)) for row in rows], device=self.device)

        lengths = torch.tensor([r.stop - r.start for r in rests], device=self.device)
        completion_mask = (torch.arange(width_c, device=self.device)[None, :] < lengths[:, None]).long()
        if self.args.mask_truncated_completions:
            truncated = torch.tensor([s.sequence.truncated for s in samples], device=self.device)
            completion_mask = completion_mask * (~truncated).unsqueeze(1).long()
        batch = {
            "prompt_ids": torch.tensor([[self.pad_id] * (width_p - len(p)) + p for p in prompts], device=self.device),
            "prompt_mask": torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts], device=self.device),
            "completion_ids": completions("input_ids", self.pad_id),
            "completion_mask": completion_mask,
            "tool_mask": completions("loss_mask", 1)
            * torch.tensor([[not s.filler] for s in samples], device=self.device),
            "sampling_per_token_logps": completions("logprobs", 0.0),
            "advantages": torch.tensor([s.advantage for s in samples], device=self.device),
        }
        mask = batch["completion_mask"] * batch["tool_mask"]
        batch["num_items_in_batch"] = torch.tensor(float(num_items if num_items is not None else mask.sum()))
        if not terms:
            return batch
        # The old-policy and reference logprobs are the policy's own probabilities: without
        # dropout (a LoRA adapter's lora_dropout was on here, so they moved from call to call).
        training = self.model.training
        self.model.eval()
        try:
            return self._policy_terms(batch, mask, old)
        finally:
            self.model.train(training)

    def _policy_terms(self, batch: dict[str, Any], mask: Any, old: bool) -> dict[str, Any]:
        """Old-policy and reference logprobs and the importance-sampling ratio, as TRL's
        `_generate_and_score_completions` makes them for samples from vLLM."""
        import torch

        trl, args = self.trl, self.args
        given = self._model_inputs(batch)
        if not args.vllm_importance_sampling_correction:
            batch["old_per_token_logps"] = batch["sampling_per_token_logps"]
        elif old:
            with torch.no_grad():
                logps, _ = self.logps(self.model, *given)
            self._importance(batch, logps, mask)
        if args.beta != 0.0:  # the reference: TRL's frozen copy of the starting model, or the base under LoRA
            with torch.no_grad(), contextlib.ExitStack() as scope:
                reference = trl.ref_model
                if self.lora:
                    from trl.trainer.utils import use_adapter

                    reference = self.model
                    scope.enter_context(use_adapter(trl.accelerator.unwrap_model(self.model), adapter_name=None))
                ref, _ = self.logps(reference, *given)
            batch["ref_per_token_logps"] = ref
        return batch

    def _importance(self, batch: dict[str, Any], old: Any, mask: Any) -> None:
        """The old-policy logprobs, and their importance-sampling ratio to the behaviour ones."""
        import torch

        batch["old_per_token_logps"] = old
        diff, ratio = importance_ratio(old, batch["sampling_per_token_logps"], mask, self.args)
        batch["importance_sampling_ratio"] = ratio
        # What the correction changed: tokens, or whole sequences in the sequence modes.
        judged = (mask if diff.size(1) > 1 else mask.sum(-1, keepdim=True)) > 0
        self._sums["capped"] += float(((ratio != torch.exp(diff)) & judged).sum())
        self._sums["judged"] += float(judged.sum())

    def loss(self, batch: dict[str, Any], weights: Any) -> Any:
        """The sum over a micro-batch's trained tokens of `weights` (a row's token weight:
        trainer/weights.py) x the per-token loss of the run's loss_type, its KL term included,
        written out in trainer/weights.py (TRL's trainer only read). On the way, how far the
        trainer's logprobs of the sampled tokens are from the recorded behaviour ones, their
        entropy, the clipped tokens and the KL: summed into `_sums` for the step's metrics."""
        logps, entropies = self.logps(self.model, *self._model_inputs(batch), compute_entropy=True)
        self._seen = logps.detach()
        mask = batch["completion_mask"] * batch["tool_mask"]
        if "old_per_token_logps" not in batch:  # the old policy is this one (`old_is_current`)
            self._importance(batch, self._seen, mask)
        weights = weights.to(self.device)[:, None]
        per_token, clipped = per_token_loss(self.trl, logps, entropies, batch, mask)
        loss = (per_token * mask * weights).sum()
        if self.args.beta:
            kl = kl_term(logps, batch, mask, self.args)
            loss = loss + self.args.beta * (kl * mask * weights).sum()
            self._sums["kl"] += float((kl.detach() * mask).sum())
        if clipped is not None:
            self._sums["clipped"] += float((clipped.expand_as(mask) * mask).sum())
        self._sums["entropy"] += float((entropies.detach() * mask).sum())
        gap = ((self._seen - batch["sampling_per_token_logps"]).abs() * mask).nan_to_num(0.0)
        self._sums["gap"] += float(gap.sum())
        self._sums["tokens"] += float(mask.sum())
        return loss

    @staticmethod
    def _model_inputs(batch: dict[str, Any]) -> tuple[Any, Any, int]:
        """(input ids, attention mask, completion columns) of a TRL batch."""
        import torch

        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        return ids, attention, batch["completion_ids"].size(1)

    def logps(
        self, model: Any, input_ids: Any, attention_mask: Any, keep: int, compute_entropy: bool = False
    ) -> tuple[Any, Any]:
        """(per-token logprobs, entropies or None) of the last `keep` columns: with the prompt
        that several rows share run once (`shared_prefix_logps`), else TRL's own padded batch
        (`_get_per_token_logps_and_entropies`, in micro-batches of `micro_batch` rows): as
        `shared_prefix` says, or else whichever costs less on this device."""
        from trl import GRPOTrainer

        accelerator = self.trl.accelerator
        if self.shared_prefix is not False and prompt_cache_fits(model, accelerator):  # cheap: the config
            overhead = CPU_OVERHEAD if self.overhead is None else self.overhead  # measured at the first step
            # Sharded, every rank takes the shared path: their passes must pair up (`in_step`).
            chosen = self.shared_prefix or self.fsdp
            plan = share_plan(input_ids, attention_mask, keep, self.micro_batch, overhead)
            if chosen or sharing_pays(input_ids, plan, self.micro_batch, overhead):
                return shared_prefix_logps(model, input_ids, attention_mask, keep, accelerator, plan, compute_entropy)
        logps, entropies, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            self.trl, model, input_ids, attention_mask, keep, self.micro_batch, compute_entropy
        )
        return logps, entropies

    def part_losses(self, samples: list[Sample]) -> Iterator[Any]:
        """The loss of each micro-batch of this rank's shard of a step: the sum of its trained
        tokens' weighted losses (`token_weights`, over the whole step), times the number of ranks
        (the gradients are averaged over them), so that the parts of every rank add up to the
        step's loss."""
        advantages = {id(s.sequence): s.advantage for s in samples}  # for the views
        parts, _, _ = self._parts(samples)
        for part in parts:
            batch = self.inputs(part, old=not self.old_is_current)
            loss = self.loss(batch, self.row_weights(part, samples)) * self.world
            self._view(part, batch, advantages)
            yield loss

    def sft_losses(self, samples: list[Sample]) -> Iterator[Any]:
        """The warm start's loss (rejection-sampling fine-tuning): the negative log-likelihood of
        the recorded sampled tokens (the loss mask, as in GRPO) at the sampling temperature, a mean
        over the batch's tokens. Not GRPO with advantage 1: that stops pulling once ratios clip."""
        parts, _, num_items = self._parts(samples)
        advantages = {id(s.sequence): s.advantage for s in samples}  # for the views
        for part in parts:
            batch = self.inputs(part, num_items, terms=False)
            logps, _ = self.logps(self.model, *self._model_inputs(batch))
            self._seen = logps.detach()
            mask = batch["completion_mask"] * batch["tool_mask"]
            self._sums["gap"] += float(((self._seen - batch["sampling_per_token_logps"]).abs() * mask).sum())
            self._sums["tokens"] += float(mask.sum())
            self._view(part, batch, advantages)
            yield -(logps * mask).sum() * self.world / max(num_items, 1)  # gradients are averaged over ranks

    def _parts(self, samples: list[Sample]) -> tuple[list[list[Sample]], int, int]:
        """This rank's micro-batches, how many there are over all ranks, and the step's trained
        tokens over all ranks (`num_items`): rows of one prompt together and of like lengths (a part
        is mostly one group, run from its shared prompt), parts of even sizes, as many on every
        rank, topped up with fillers to the same number of rows (TRL gathers a value per row)."""
        ordered = sorted(samples, key=lambda s: (s.sequence.input_ids[: s.split], len(s.sequence.input_ids)))
        count = -(-len(ordered) // self.micro_batch)
        count = -(-count // self.world) * self.world
        cuts = [i * len(ordered) // count for i in range(count + 1)]
        everyone = [ordered[a:b] for a, b in itertools.pairwise(cuts)]
        top = max(map(len, everyone)) if self.world > 1 else 0  # fillers: the part's prompt, weighing 0
        mine = [part + [Sample((part or ordered)[0].sequence, 0.0, True)] * (top - len(part)) for part in everyone]
        num_items = sum(s.sequence.sampled_tokens for s in samples if not self._masked(s))
        return mine[self.rank :: self.world], count, num_items

    def _view(self, part: list[Sample], batch: dict[str, Any], advantages: dict[int, float]) -> None:
        """Keep the learner's logprobs of the trained tokens of the step's first VIEWS_PER_STEP
        sequences (rank 0's), for the viewer to set beside the behaviour ones."""
        if self.rank != 0 or len(self.views) >= VIEWS_PER_STEP:
            return
        mask = (batch["completion_mask"] * batch["tool_mask"]).bool()
        for sample, logps, keep in zip(part, self._seen, mask, strict=False):
            if not sample.filler and len(self.views) < VIEWS_PER_STEP:
                trained = logps[keep].float().tolist()
                seq = sample.sequence
                self.views.append(LearnerView(seq.session_id, seq.spans[0].seq, advantages[id(seq)], trained))

    def step(self, samples: list[Sample], supervised: bool = False) -> dict[str, float]:
        """One optimizer step on these samples (in micro-batches), GRPO or `supervised` (`sft_losses`);
        TRL's metrics for it. Several processes: rank 0 calls this, the samples go to every rank."""
        if self.world > 1:
            self._broadcast(("step", (samples, supervised)))
        return self._step(samples, supervised)

    def lead(self, work: Callable[[], T]) -> T | None:
        """With several processes: rank 0 does `work` (which calls `step`) and then lets the
        other ranks go; they step on its batches, each on its shard, until then. If `work`
        fails, rank 0 exits with its error and the launcher (torchrun) stops the others: they
        may be inside a step's collectives, where a last broadcast would not reach them."""
        if self.rank:
            while (command := self._broadcast(None)) is not None:
                kind, given = command
                if kind == "step":
                    self._step(*given)
                else:  # "save": the sharded weights are gathered from every rank
                    self._save(*given)
            result = None
        else:
            result = work()
        if self.world > 1:
            import torch.distributed as dist

            if not self.rank:
                self._broadcast(None)
            # Torn down here, not by the interpreter's exit: there a rank that had finished its
            # work aborted ("terminate called without an active exception", exit -6), twice in
            # about 40 launches of the distributed tests.
            dist.destroy_process_group()
        return result

    def _broadcast(self, command: tuple[str, Any] | None) -> tuple[str, Any] | None:
        """Rank 0's next command to the others: a step on samples, a save, or None (done)."""
        import torch.distributed as dist

        box = [command]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _step(self, samples: list[Sample], supervised: bool = False) -> dict[str, float]:
        import torch

        trl = self.trl
        self.model.train()
        if self.overhead is None:  # before any forward: the gradients it makes are dropped
            self.overhead = pass_overhead(self.model, trl.accelerator, len(self.tokenizer))
            log.info("a forward and backward pass costs as much as %.0f tokens on %s", self.overhead, self.device)
        total = 0.0
        self._sums = dict.fromkeys(self._sums, 0.0)
        self.views = []
        for loss in (self.sft_losses if supervised else self.part_losses)(samples):
            trl.accelerator.backward(loss)
            total += float(loss.detach())
        if self.world > 1:  # the gradients, the loss and the off-policy sums over every rank's shard
            if not self.fsdp:  # FSDP2 reduce-scattered them in the backward passes
                average_gradients(list(self.model.parameters()), self.world)
            sums = torch.tensor([total / self.world, *self._sums.values()], device=self.device)
            summed = trl.accelerator.reduce(sums, "sum")
            total, *sums = summed.tolist()
            self._sums = dict(zip(self._sums, sums, strict=True))
        if self.fsdp:  # over DTensor gradients: torch's own, which reduces the norm across the shards
            grad_norm = full_norm(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm))
        else:
            grad_norm = float(trl.accelerator.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm))
        trl.optimizer.step()
        trl.lr_scheduler.step()
        trl.optimizer.zero_grad()
        sums, tokens = self._sums, max(self._sums["tokens"], 1.0)
        metrics = {"entropy": sums["entropy"] / tokens} if not supervised else {}
        if not supervised and self.args.loss_type in ("cispo", *CLIPPED):  # the tokens whose ratio was clipped
            metrics["clip_ratio/region_mean"] = sums["clipped"] / tokens
        if not supervised and self.args.beta:
            metrics["kl"] = sums["kl"] / tokens
        release_memory()
        return {
            **metrics,
            "loss": total,
            "grad_norm": grad_norm,
            "learning_rate": trl.lr_scheduler.get_last_lr()[0],
            # Off-policy mismatch: the mean |trainer - behaviour| logprob of the trained tokens
            # (precision, sampling settings, staleness) and what the IS correction capped or masked.
            "logprob_gap": self._sums["gap"] / max(self._sums["tokens"], 1.0),
            **({"is_capped": self._sums["capped"] / self._sums["judged"]} if self._sums["judged"] else {}),
        }

    def _masked(self, sample: Sample) -> bool:
        return bool(self.args.mask_truncated_completions and sample.sequence.truncated)

    def save(self, directory: Path, with_optimizer: bool = True) -> None:
        """The weights vLLM serves (safetensors in `serve_dtype`, or the LoRA adapters) and the
        tokenizer: a directory vLLM can load or reload; `with_optimizer`, a checkpoint too: the
        float32 masters and the optimizer state in `learner/`, and the scheduler's. Sharded
        (fsdp2), every rank takes part: rank 0 calls this, and tells the others (`lead`)."""
        if self.fsdp:
            self._broadcast(("save", (directory, with_optimizer)))
        self._save(directory, with_optimizer)

    def _save(self, directory: Path, with_optimizer: bool) -> None:
        checkpoint.save_version(self, directory, with_optimizer)
        release_memory()

    def resume(self, directory: Path) -> None:
        """Go on from a checkpoint that `save` wrote: the masters, the optimizer and scheduler."""
        checkpoint.resume(self, directory)
