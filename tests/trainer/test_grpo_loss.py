"""The trainer's GRPO loss on a fixed batch of recorded multi-turn sequences, against TRL's own
`GRPOTrainer` and against the formula written out by hand.

The batch mixes lengths (so prompts are left-padded and completions right-padded), has tool
tokens inside the completions (loss mask 0) and behaviour logprobs that differ from the
model's (so clipping and the importance-sampling correction both act). A tiny random Llama
with SmolLM2's tokenizer keeps it fast.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from recorder.episodes import advantages  # noqa: E402
from tests.support.sequences import LORA, cut_episode, groups, sequence  # noqa: E402
from trainer.grpo import Learner  # noqa: E402
from trainer.sample import Sample  # noqa: E402

CASES = [
    # loss_type, importance_sampling_level, vLLM importance-sampling mode (None: no correction)
    ("grpo", "token", None),
    ("dapo", "token", None),
    ("grpo", "sequence", None),
    ("dapo", "sequence", None),
    ("grpo", "token", "token_truncate"),
    ("dapo", "token", "token_mask"),
    ("grpo", "sequence", "sequence_mask"),
    ("dapo", "sequence", "sequence_truncate"),
]


def _batch() -> list[Sample]:
    rng = random.Random(7)
    sequences = [
        sequence(rng, [(12, 5), (6, 4)]),
        sequence(rng, [(20, 3)]),
        sequence(rng, [(9, 6), (4, 2), (3, 5)]),
        sequence(rng, [(15, 7)], truncated=True),
    ]
    return [Sample(s, a) for s, a in zip(sequences, [1.2, -0.7, 0.4, -0.9], strict=True)]


def _config(loss_type: str, level: str, mode: str | None) -> dict[str, Any]:
    grpo: dict[str, Any] = {
        "loss_type": loss_type,
        "importance_sampling_level": level,
        "epsilon": 0.2,
        "epsilon_high": 0.28,
        "vllm_importance_sampling_correction": mode is not None,
        "temperature": 0.9,
    }
    if mode:
        grpo.update(
            vllm_importance_sampling_mode=mode,
            vllm_importance_sampling_clip_min=0.8,
            vllm_importance_sampling_clip_max=1.25,
        )
    return grpo


def _reference(model: Any, samples: list[Sample], grpo: dict[str, Any]) -> Any:
    """The loss written out: one sequence at a time, no padding, no TRL."""
    eps_low, eps_high, mode = grpo["epsilon"], grpo["epsilon_high"], grpo.get("vllm_importance_sampling_mode")
    per_sequence, weights = [], []
    for sample in samples:
        seq, k = sample.sequence, sample.split
        ids = torch.tensor(seq.input_ids)
        logits = model(ids[None]).logits[0, :-1].float() / grpo["temperature"]
        logp = torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0][k - 1 :]
        mask = torch.tensor(seq.loss_mask[k:], dtype=torch.float)
        behaviour = torch.tensor(seq.logprobs[k:])
        old = logp.detach() if mode else behaviour
        log_ratio = logp - old
        if grpo["importance_sampling_level"] == "sequence":
            log_ratio = (log_ratio * mask).sum() / mask.sum()
        ratio = torch.exp(log_ratio)
        a = sample.advantage
        loss = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
        if mode:
            diff = (old - behaviour) * mask
            w = torch.exp(diff.sum() if mode.startswith("sequence") else diff)
            low, high = grpo["vllm_importance_sampling_clip_min"], grpo["vllm_importance_sampling_clip_max"]
            w = torch.clamp(w, low, high) if mode.endswith("truncate") else w * ((w >= low) & (w <= high))
            loss = loss * w
        loss = loss * torch.ones_like(mask)  # sequence level: the same value on every token
        per_sequence.append((loss * mask).sum())
        weights.append(mask.sum())
    if grpo["loss_type"] == "grpo":
        return torch.stack([s / w for s, w in zip(per_sequence, weights, strict=True)]).mean()
    return torch.stack(per_sequence).sum() / torch.stack(weights).sum()


def _as_trl_trains(learner: Learner, vllm: bool) -> None:
    """TRL's own trainer made ready to compute a loss as its training loop would, with one
    accumulation step, on samples from vLLM where `vllm` (it corrects those only): the reference
    the learner's loss is checked against. The learner itself sets none of these."""
    learner.trl.current_gradient_accumulation_steps = 1
    learner.trl.use_vllm = vllm


@pytest.mark.parametrize(("loss_type", "level", "mode"), CASES)
def test_loss_equals_trl_and_the_formula(
    tiny_model: Path, tmp_path: Path, loss_type: str, level: str, mode: str | None
) -> None:
    grpo = _config(loss_type, level, mode)
    learner = Learner(str(tiny_model), tmp_path, grpo, total_steps=1, micro_batch=8)
    learner.model.train()
    samples = _batch()
    ours = learner.loss(learner.inputs(samples), learner.row_weights(samples))

    # TRL's own GRPOTrainer (the learner holds one, not a subclass), one sequence at a time (no
    # padding at all), combined as TRL aggregates: grpo averages the sequences, dapo divides
    # every token's loss by the whole batch's token count.
    from trl import GRPOTrainer

    assert type(learner.trl) is GRPOTrainer
    total_tokens = sum(s.sequence.sampled_tokens for s in samples)
    learner.shared_prefix = False  # TRL's own logprobs from here on
    _as_trl_trains(learner, vllm=mode is not None)
    singles = []
    for sample in samples:
        single = learner.inputs([sample], num_items=total_tokens)
        assert single["prompt_mask"].all() and single["completion_mask"].all()  # nothing padded
        singles.append(learner.trl.compute_loss(learner.model, single))
    trl_loss = torch.stack(singles).mean() if loss_type == "grpo" else torch.stack(singles).sum()
    torch.testing.assert_close(ours, trl_loss, rtol=1e-5, atol=1e-6)

    reference = _reference(learner.model, samples, grpo)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-6)
    assert ours.requires_grad and float(ours.detach()) != 0.0


def test_the_loss_never_calls_trls_compute_loss_nor_sets_its_attributes(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The learner wrote its loss around TRL's compute_loss by setting TRL's attributes to neutral
    values (loss type, beta, accumulation steps, use_vllm); a TRL that read one more would have
    changed the loss silently. Now it calls neither compute_loss nor _compute_loss, and a step
    with the KL term, the vLLM correction and a clipped type leaves every attribute of TRL's
    trainer and of its config as they were (their loss is checked against TRL's above)."""
    from trl import GRPOTrainer

    def refused(*_: Any, **__: Any) -> None:
        raise AssertionError("the learner called TRL's compute_loss")

    monkeypatch.setattr(GRPOTrainer, "compute_loss", refused)
    monkeypatch.setattr(GRPOTrainer, "_compute_loss", refused)
    grpo = {**_config("dapo", "token", "token_truncate"), "beta": 0.1}
    learner = Learner(str(tiny_model), tmp_path, grpo, total_steps=2, micro_batch=2)

    def attributes() -> dict[str, Any]:
        plain = (bool, int, float, str, type(None))
        found = {f"trl.{k}": v for k, v in vars(learner.trl).items() if isinstance(v, plain)}
        return found | {f"args.{k}": v for k, v in vars(learner.trl.args).items() if isinstance(v, plain)}

    before = attributes()
    assert {"trl.loss_type", "trl.beta", "trl.use_vllm", "args.steps_per_generation"} <= set(before)
    metrics = learner.step(_batch())
    assert attributes() == before
    assert metrics["kl"] >= 0 and 0 <= metrics["clip_ratio/region_mean"] <= 1 and metrics["entropy"] > 0


def test_truncated_completions_masked(tiny_model: Path, tmp_path: Path) -> None:
    learner = Learner(str(tiny_model), tmp_path, {"mask_truncated_completions": True}, total_steps=1)
    batch = learner.inputs(_batch())
    assert batch["completion_mask"][3].sum() == 0 and batch["completion_mask"][:3].sum() > 0
    assert batch["num_items_in_batch"] == sum(s.sequence.sampled_tokens for s in _batch()[:3])


def test_step_changes_the_weights(tiny_model: Path, tmp_path: Path) -> None:
    learner = Learner(str(tiny_model), tmp_path, {"learning_rate": 1e-2}, total_steps=2, micro_batch=2)
    before = [p.detach().clone() for p in learner.model.parameters()]
    metrics = learner.step(_batch())
    changed = sum(not torch.equal(a, b) for a, b in zip(before, learner.model.parameters(), strict=True))
    assert changed > 0 and metrics["grad_norm"] > 0
    assert {"loss", "entropy", "clip_ratio/region_mean"} <= set(metrics)


def test_group_advantages() -> None:
    assert advantages([1.0, 0.0, 0.0, 1.0], scale="none") == [0.5, -0.5, -0.5, 0.5]
    scaled = advantages([1.0, 0.0, 0.0, 1.0], scale="group")
    assert scaled[0] == pytest.approx(0.5 / (0.57735 + 1e-4), rel=1e-4)
    # leave-one-out: each reward against the mean of the others
    assert advantages([1.0, 0.0, 0.0], scale="none", baseline="leave_one_out") == pytest.approx([1.0, -0.5, -0.5])


def test_kl_term_against_the_reference_model(tiny_model: Path, tmp_path: Path) -> None:
    learner = Learner(str(tiny_model), tmp_path, {"beta": 0.5, "learning_rate": 1e-2}, total_steps=3, micro_batch=2)
    assert learner.trl.ref_model is not None
    assert learner.step(_batch())["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy still is the reference
    assert learner.step(_batch())["kl"] > 1e-4  # one step later it is not


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
def test_uneven_micro_batches_add_up_to_the_whole_batch(tiny_model: Path, tmp_path: Path, loss_type: str) -> None:
    """Every loss_type: a step's batch of 4 in micro-batches of 3 and 1 gives the loss (and the
    gradients) of TRL's compute_loss on the whole batch at once."""
    level = "sequence" if loss_type == "luspo" else "token"  # what TRL allows for each
    grpo = {**_config(loss_type, level, None), "max_completion_length": 64}
    learner = Learner(str(tiny_model), tmp_path, grpo, total_steps=1, micro_batch=3)
    learner.model.train()
    samples = _batch()

    def loss_and_grads(loss: Any) -> tuple[Any, list[Any]]:
        trained = [p for p in learner.model.parameters() if p.requires_grad]  # LoRA: the adapters only
        grads = torch.autograd.grad(loss, trained, allow_unused=True)
        return loss.detach(), [g for g in grads if g is not None]

    parts, part_grads = loss_and_grads(sum(learner.part_losses(samples)))
    whole, whole_grads = loss_and_grads(learner.loss(learner.inputs(samples), learner.row_weights(samples)))
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-7)
    for a, b in zip(part_grads, whole_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_gradient_checkpointing_and_bf16_take_effect(tiny_model: Path, tmp_path: Path) -> None:
    """Both are GRPOConfig keys the config accepts: each changes what a step does. Checkpointing
    is torch's per decoder layer, on the shared-prompt step (transformers' own dropped the cache
    it runs on) and on TRL's padded batch: each layer runs again in the backward pass (its
    attention is called twice per pass), with the same loss and gradients."""
    from trainer.forward import prompt_cache_fits
    from trainer.sharding import decoder_layers

    samples = groups()
    found = {}
    for checkpointed in (False, True):
        grpo = {"gradient_checkpointing": checkpointed, "vllm_importance_sampling_correction": False}  # no no-grad pass
        learner = Learner(str(tiny_model), tmp_path / str(checkpointed), grpo, total_steps=1, micro_batch=3)
        assert prompt_cache_fits(learner.model, learner.trl.accelerator)
        calls: list[int] = []
        decoder_layers(learner.model)[0].self_attn.register_forward_hook(lambda *_, c=calls: c.append(1))
        trained = [p for p in learner.model.parameters() if p.requires_grad]
        for shared in (True, False):
            learner.shared_prefix = shared
            calls.clear()
            loss = sum(learner.part_losses(samples))
            found[checkpointed, shared] = (loss.detach(), torch.autograd.grad(loss, trained), len(calls))
    for shared in (True, False):
        (loss, grads, passes), (loss_c, grads_c, passes_c) = found[False, shared], found[True, shared]
        torch.testing.assert_close(loss_c, loss)
        for a, b in zip(grads_c, grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert passes_c == 2 * passes > 0
    half = Learner(str(tiny_model), tmp_path / "bf16", {"bf16": True}, total_steps=1)
    assert half.trl.accelerator.mixed_precision == "bf16"
    assert half.step(_batch())["grad_norm"] > 0


def test_a_resumed_policy_keeps_the_base_model_as_its_kl_reference(tiny_model: Path, tmp_path: Path) -> None:
    """With beta, a run resumed from a checkpoint takes its KL against the base model, not the
    checkpoint (TRL copies whatever policy it is given)."""
    trained = Learner(str(tiny_model), tmp_path / "trl", {"learning_rate": 1e-2}, total_steps=2, micro_batch=2)
    trained.step(_batch())
    trained.save(tmp_path / "v1", with_optimizer=False)
    resumed = Learner(str(tmp_path / "v1"), tmp_path / "trl2", {"beta": 0.5}, total_steps=1, reference=str(tiny_model))
    base = Learner(str(tiny_model), tmp_path / "trl3", {}, total_steps=1).model
    assert resumed.trl.ref_model is not None
    for ref, original in zip(resumed.trl.ref_model.parameters(), base.parameters(), strict=True):
        torch.testing.assert_close(ref, original)
    assert resumed.step(_batch())["kl"] > 1e-4  # the policy has moved from the reference already


@pytest.mark.parametrize("mode", [None, "token_truncate", "sequence_mask"])
def test_a_step_logs_the_off_policy_gap_and_what_the_correction_capped(
    tiny_model: Path, tmp_path: Path, mode: str | None
) -> None:
    """logprob_gap: the mean |trainer - behaviour| logprob over the trained tokens, as written out
    here; is_capped (with the correction): the share of tokens, or sequences, it changed."""
    grpo = _config("dapo", "token", mode)
    learner = Learner(str(tiny_model), tmp_path, grpo, total_steps=1, micro_batch=3)
    samples = _batch()
    gaps, weights, ratios = [], [], []
    with torch.no_grad():
        for sample in samples:
            seq, k = sample.sequence, sample.split
            ids = torch.tensor(seq.input_ids)
            logits = learner.model(ids[None]).logits[0, :-1].float() / grpo["temperature"]
            logp = torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0][k - 1 :]
            mask = torch.tensor(seq.loss_mask[k:], dtype=torch.float)
            diff = (logp - torch.tensor(seq.logprobs[k:])) * mask
            gaps.append(diff.abs().sum())
            weights.append(mask.sum())
            ratios.append(torch.exp(diff.sum())[None] if mode == "sequence_mask" else torch.exp(diff)[mask > 0])
    metrics = learner.step(samples)
    assert metrics["logprob_gap"] == pytest.approx(float(sum(gaps) / sum(weights)), rel=1e-4)
    if mode is None:
        assert "is_capped" not in metrics
    else:
        every = torch.cat(ratios)
        capped = ((every < 0.8) | (every > 1.25)).float().mean()
        assert metrics["is_capped"] == pytest.approx(float(capped), abs=1e-6)
        assert 0 < metrics["is_capped"] < 1  # some capped, some not: the batch is made so


@pytest.mark.parametrize(
    ("loss_type", "mode", "beta", "micro_batch", "lora"),
    [
        ("grpo", None, 0.0, 4, None),
        ("dapo", None, 0.0, 2, None),
        ("bnpo", "token_truncate", 0.0, 4, None),
        ("dr_grpo", "sequence_mask", 0.1, 3, None),
        ("dapo", "token_truncate", 0.1, 3, LORA),
    ],
)
def test_a_shared_prompt_run_once_gives_the_loss_and_gradients_of_the_plain_batch(
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    loss_type: str,
    mode: str | None,
    beta: float,
    micro_batch: int,
    lora: dict[str, Any] | None,
) -> None:
    """The step's fast path (each group's prompt run once, its rows from its keys and values, in
    passes of at most `micro_batch` rows) against TRL's own padded batch: the same loss,
    gradients and off-policy gap; with LoRA too (adapters in the prompt's pass, and disabled
    for the KL reference)."""
    import trainer.grpo

    grpo = {**_config(loss_type, "token", mode), "beta": beta, "mask_truncated_completions": True}
    learner = Learner(str(tiny_model), tmp_path, grpo, total_steps=1, micro_batch=micro_batch, lora=lora)
    learner.model.train()
    if lora:  # adapters that change the model (PEFT starts them at zero), so the reference differs
        for name, param in learner.model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.2)
    samples = groups()
    passes = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        passes.append(args[2].size(0))
        return shared(*args, **kwargs)

    shared = trainer.grpo.shared_prefix_logps
    monkeypatch.setattr(trainer.grpo, "shared_prefix_logps", counted)

    def run(shared: bool) -> tuple[Any, list[Any], float]:
        learner.shared_prefix = shared
        learner._sums = dict.fromkeys(learner._sums, 0.0)
        loss = sum(learner.part_losses(samples))
        trained = [p for p in learner.model.parameters() if p.requires_grad]  # LoRA: the adapters only
        grads = torch.autograd.grad(loss, trained, allow_unused=True)
        return loss.detach(), [g for g in grads if g is not None], learner._sums["gap"]

    fast, fast_grads, fast_gap = run(True)
    assert sum(passes) >= len(samples)  # the fast path ran, for every row
    plain, plain_grads, plain_gap = run(False)
    assert float(plain) != 0.0 and len(fast_grads) == len(plain_grads) > 0
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-6)
    for a, b in zip(fast_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert fast_gap == pytest.approx(plain_gap, rel=1e-5)


def test_a_lora_learner_saves_adapters_only_and_goes_on_from_them(tiny_model: Path, tmp_path: Path) -> None:
    learner = Learner(str(tiny_model), tmp_path / "a", {}, total_steps=1, lora=LORA)
    learner.model.train()
    learner.step(groups())
    learner.save(tmp_path / "v1")
    assert (tmp_path / "v1" / "adapter_model.safetensors").exists()
    assert not (tmp_path / "v1" / "model.safetensors").exists()
    resumed = Learner(str(tmp_path / "v1"), tmp_path / "b", {}, total_steps=1, reference=str(tiny_model), lora=LORA)
    resumed.resume(tmp_path / "v1")
    trained = {n: p for n, p in learner.model.named_parameters() if p.requires_grad}
    again = {n: p for n, p in resumed.model.named_parameters() if p.requires_grad}
    assert trained.keys() == again.keys() and any("lora_B" in n and p.abs().sum() > 0 for n, p in again.items())
    for name, param in trained.items():
        torch.testing.assert_close(again[name], param, rtol=0, atol=0)


def test_a_version_is_served_in_bf16_and_a_checkpoint_resumes_from_the_float32_masters(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A float32 model is served by vLLM in bf16 (dtype auto): each version is written so, half
    the bytes, and a checkpoint keeps the masters and the optimizer state beside it, which a
    resumed learner takes exactly (the served weights alone are the masters rounded)."""
    import json

    from safetensors.torch import load_file

    grpo = {"learning_rate": 1e-3}
    learner = Learner(str(tiny_model), tmp_path / "a", grpo, total_steps=3)
    learner.step(groups())
    learner.save(tmp_path / "v1")
    served = load_file(tmp_path / "v1" / "model.safetensors")
    assert {t.dtype for t in served.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "v1" / "config.json").read_text())["dtype"] == "bfloat16"
    masters = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    rounded = Learner(str(tmp_path / "v1"), tmp_path / "r", grpo, total_steps=3, reference=str(tiny_model))
    assert any(not torch.equal(p, masters[n]) for n, p in rounded.model.named_parameters())
    resumed = Learner(str(tmp_path / "v1"), tmp_path / "b", grpo, total_steps=3, reference=str(tiny_model))
    resumed.resume(tmp_path / "v1")
    assert resumed.serve_dtype == torch.bfloat16
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param, masters[name], rtol=0, atol=0)
    learner.step(groups())  # the optimizer and scheduler went on too: one more step, the same weights
    resumed.step(groups())
    for (name, a), b in zip(learner.model.named_parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-8, msg=name)
    whole = Learner(str(tiny_model), tmp_path / "c", grpo, total_steps=1, serve_dtype="float32")
    whole.save(tmp_path / "v2", with_optimizer=False)
    assert {t.dtype for t in load_file(tmp_path / "v2" / "model.safetensors").values()} == {torch.float32}
    assert not (tmp_path / "v2" / "learner").exists()


def test_old_policy_logprobs_are_taken_without_dropout_and_dropout_settings_are_accepted(
    tiny_model: Path, tmp_path: Path
) -> None:
    """An adapter's lora_dropout was on while the old-policy logprobs were computed, so they
    changed from one computation to the next; and TRL's disable_dropout and cast_lm_head_to_fp32
    could not be set."""
    lora = {**LORA, "lora_dropout": 0.5}
    learner = Learner(str(tiny_model), tmp_path / "a", {}, total_steps=1, lora=lora)
    with torch.no_grad():  # a trained adapter (lora_B starts at zero, and dropout before it shows nothing)
        for name, param in learner.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    learner.model.train()
    first, second = (learner.inputs(groups())["old_per_token_logps"] for _ in range(2))
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert learner.model.training  # left as it was
    from trainer.config import TrainSection

    settings = {"disable_dropout": True, "cast_lm_head_to_fp32": True}
    assert TrainSection(grpo=settings).grpo == settings
    plain = Learner(str(tiny_model), tmp_path / "b", {**settings, "beta": 0.0}, total_steps=1)
    dropouts = [m.p for m in plain.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert all(p == 0 for p in dropouts) and plain.model.lm_head.weight.dtype == torch.float32


def test_a_bf16_checkpoint_is_stepped_in_float32_master_weights(tiny_model: Path, tmp_path: Path) -> None:
    """Nearly every model a user brings is a bf16 checkpoint. Loaded as it was saved (dtype
    "auto", the GPU path), one AdamW step at lr 1e-6 left almost every weight as it was: the
    update is under bf16's rounding step (here 1.4% of the weights moved in bf16, 95% in float32).
    The learner keeps float32 master weights by default, on every device."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    half = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model).to(torch.bfloat16).save_pretrained(half)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(half)

    def changed(weights_dtype: str) -> float:
        learner = Learner(
            str(half), tmp_path / weights_dtype, {"learning_rate": 1e-6}, total_steps=1, weights_dtype=weights_dtype
        )
        before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
        learner.model.train()
        learner.step(groups())
        moved = [(p.detach() != before[n]).float().mean() for n, p in learner.model.named_parameters()]
        return float(torch.stack(moved).mean())

    master, half_only = changed("float32"), changed("bfloat16")
    assert master > 0.9
    assert half_only < 0.5  # what a bf16 learner does: kept as a choice, for memory


def test_completions_run_in_passes_of_like_lengths() -> None:
    from trainer.forward import length_buckets

    # One long completion among short ones runs alone instead of padding the other seven to it.
    lengths = [40, 175, 65, 40, 40, 40, 40, 36]
    passes = length_buckets(lengths, most=8)
    assert sorted(i for p in passes for i in p) == list(range(8))
    assert [1] in passes and sum(len(p) * max(lengths[i] for i in p) for p in passes) < 8 * 175 / 2
    assert all(len(p) <= 3 for p in length_buckets(lengths, most=3))
    assert length_buckets([7, 7, 7, 7], most=8) == [[0, 1, 2, 3]]  # equal lengths: one pass


def test_the_shared_prompt_path_stands_aside_where_it_would_be_wrong(tiny_model: Path, tmp_path: Path) -> None:
    """Layers checkpointed by transformers drop the cache, a sliding window keeps only its last
    keys: TRL's own path runs for those."""
    from transformers import AutoModelForCausalLM, MistralConfig

    from trainer.forward import prompt_cache_fits

    plain = Learner(str(tiny_model), tmp_path / "plain", {}, total_steps=1)
    assert prompt_cache_fits(plain.model, plain.trl.accelerator)
    plain.model.gradient_checkpointing_enable()
    assert not prompt_cache_fits(plain.model, plain.trl.accelerator)
    windowed = AutoModelForCausalLM.from_config(
        MistralConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            sliding_window=8,
        )
    )
    assert not prompt_cache_fits(windowed, plain.trl.accelerator)


@pytest.mark.parametrize(
    ("loss_type", "beta"),
    [("grpo", 0.0), ("grpo", 0.5), ("sapo", 0.0), ("bnpo", 0.0), ("dr_grpo", 0.0), ("dapo", 0.5), ("cispo", 0.0)],
)
def test_an_episode_cut_into_three_sequences_weighs_what_it_weighs_as_one(
    tiny_model: Path, tmp_path: Path, loss_type: str, beta: float
) -> None:
    """An episode whose calls became 3 sequences (a subagent, a compaction, a fork) counts once,
    as the same calls merged into 1 sequence do, beside an episode of 1 sequence: each of its
    sampled tokens sees the same context either way, so the step's loss and gradients are the
    same, its KL term's too. Defect 5 of issue 39: under grpo and sapo each row's advantage was
    divided by 3 and TRL averaged each row, so in cuts of 12/2/2 tokens a 2-token row's tokens
    weighed 6x the 12-token row's, and the KL term was not divided at all. (luspo and vespo weigh
    a sequence as a whole, so a cut changes what they compute, not only its weight.)"""
    grpo = {**_config(loss_type, "token", None), "max_completion_length": 64, "beta": beta, "learning_rate": 1e-2}
    learner = Learner(str(tiny_model), tmp_path, grpo, total_steps=2, micro_batch=2)
    whole, cuts, other = cut_episode()
    if beta:  # a step first: the policy is the reference until then, and its KL term 0
        learner.step([Sample(whole, 1.1), other])
    learner.model.train()

    def loss_and_grads(samples: list[Sample]) -> tuple[Any, list[Any]]:
        loss = sum(learner.part_losses(samples))
        grads = torch.autograd.grad(loss, [p for p in learner.model.parameters() if p.requires_grad])
        return loss.detach(), list(grads)

    one, one_grads = loss_and_grads([Sample(whole, 1.1), other])
    three, three_grads = loss_and_grads([*(Sample(c, 1.1) for c in cuts), other])
    torch.testing.assert_close(three, one, rtol=1e-4, atol=1e-6)
    for a, b in zip(three_grads, one_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)


def test_a_step_keeps_the_learner_logprobs_of_its_first_sequences_trained_tokens(
    tiny_model: Path, tmp_path: Path
) -> None:
    """What the viewer overlays (LearnerView): for the step's first sequences, the learner's
    logprob of each trained token (before the step's update, tool tokens left out), beside the
    advantage it pushed the sequence with (the episode's, not its 1/K share)."""
    samples = _batch()
    learner = Learner(str(tiny_model), tmp_path, {"temperature": 0.9}, total_steps=1, micro_batch=3)
    expected = {}
    with torch.no_grad():
        for sample in samples:
            seq = sample.sequence
            ids = torch.tensor(seq.input_ids)
            logits = learner.model(ids[None]).logits[0, :-1].float() / 0.9
            logp = torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]
            trained = [float(logp[i - 1]) for i, m in enumerate(seq.loss_mask) if m]
            expected[seq.session_id] = (sample.advantage, trained)
    learner.step(samples)
    assert len(learner.views) == 4
    for view in learner.views:
        advantage, trained = expected[view.session_id]
        assert view.first_seq == 0 and view.advantage == advantage
        assert view.logprobs == pytest.approx(trained, abs=1e-4)


def test_a_supervised_step_is_the_mean_log_likelihood_loss_of_the_sampled_tokens(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The warm start's step (rejection-sampling fine-tuning): its loss is the negative
    log-likelihood of the trained tokens (tool tokens left out) at the sampling temperature, a
    mean over the batch's tokens however it is cut into micro-batches; stepping raises them."""
    samples = [Sample(s.sequence, 1.0) for s in _batch()]
    grpo = {"temperature": 0.9, "learning_rate": 1e-3}
    learner = Learner(str(tiny_model), tmp_path, grpo, total_steps=2, micro_batch=3)

    def nll() -> float:
        total, count = 0.0, 0
        with torch.no_grad():
            for sample in samples:
                ids = torch.tensor(sample.sequence.input_ids)
                logits = learner.model(ids[None]).logits[0, :-1].float() / 0.9
                logp = torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]
                trained = [float(logp[i - 1]) for i, m in enumerate(sample.sequence.loss_mask) if m]
                total, count = total - sum(trained), count + len(trained)
        return total / count

    before = nll()
    metrics = learner.step(samples, supervised=True)
    assert metrics["loss"] == pytest.approx(before, rel=1e-4)
    assert nll() < before - 0.05
    assert len(learner.views) == 4  # the viewer shows what a supervised step saw too


def test_token_weights_are_the_formula_for_every_loss_type() -> None:
    """An episode cut 100/10/10 beside one of 20 tokens: E = 2 episodes, N = 140 tokens."""
    from trainer.weights import token_weights

    rng = random.Random(3)
    cut = [Sample(sequence(rng, [(2, n)], session="cut"), 1.0) for n in (100, 10, 10)]
    other = Sample(sequence(rng, [(2, 20)], session="other"), -1.0)
    filler = Sample(other.sequence, 0.0, filler=True)
    samples = [*cut, other, filler]
    expected = {
        "grpo": ([1 / 240] * 3, 1 / 40),
        "sapo": ([1 / 240] * 3, 1 / 40),
        "bnpo": ([1 / 140] * 3, 1 / 140),
        "dapo": ([1 / 140] * 3, 1 / 140),
        "cispo": ([1 / 140] * 3, 1 / 140),
        "vespo": ([1 / 140] * 3, 1 / 140),
        "dr_grpo": ([1 / 256] * 3, 1 / 256),
        "luspo": ([1 / 2] * 3, 1 / 2),
    }
    for loss_type, (cut_weights, other_weight) in expected.items():
        found = token_weights(samples, loss_type, 128)
        assert [found[id(s)] for s in cut] == pytest.approx(cut_weights), loss_type
        assert found[id(other)] == pytest.approx(other_weight) and id(filler) not in found, loss_type
    # each episode's tokens add up to its share: 1/E under the episode means
    grpo = token_weights(samples, "grpo", None)
    assert sum(grpo[id(s)] * s.sequence.sampled_tokens for s in cut) == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("loss_type", "beta"),
    [
        ("grpo", 0.0),
        ("grpo", 0.5),
        ("sapo", 0.0),
        ("bnpo", 0.0),
        ("dr_grpo", 0.0),
        ("dapo", 0.0),
        ("cispo", 0.0),
        ("luspo", 0.0),
        ("vespo", 0.0),
    ],
)
def test_a_steps_loss_is_the_weighted_sum_of_each_rows_own_trl_loss(
    tiny_model: Path, tmp_path: Path, loss_type: str, beta: float
) -> None:
    """Every loss type: the step's loss in micro-batches is, by hand, the sum over rows of the
    row's token weight x the sum of its per-token losses, each row's per-token loss sum taken
    from TRL's own compute_loss on that row alone (which divides it by the row's token count,
    by max_completion_length under dr_grpo, by nothing under luspo). Rows of unequal episodes
    and cuts: what TRL's normalizers were cancelled for before, stated and checked here."""
    from trainer.weights import token_weights

    level = "sequence" if loss_type == "luspo" else "token"
    grpo = {**_config(loss_type, level, None), "max_completion_length": 64, "beta": beta, "learning_rate": 1e-2}
    learner = Learner(str(tiny_model), tmp_path, grpo, total_steps=2, micro_batch=2)
    _, cuts, other = cut_episode()
    samples = [*(Sample(c, 1.1) for c in cuts), other, *_batch()[:2]]
    if beta:
        learner.step(samples)  # the policy moves away from the reference: a KL term to weigh
    learner.model.train()
    ours = sum(learner.part_losses(samples))
    weights = token_weights(samples, loss_type, 64)
    learner.shared_prefix = False
    _as_trl_trains(learner, vllm=False)
    by_hand = 0.0
    for sample in samples:
        single = learner.trl.compute_loss(learner.model, learner.inputs([sample]))
        divided_by = {"dr_grpo": 64, "luspo": 1}.get(loss_type, sample.sequence.sampled_tokens)
        by_hand = by_hand + weights[id(sample)] * single * divided_by
    torch.testing.assert_close(ours, by_hand, rtol=1e-4, atol=1e-7)


def test_the_old_policy_forward_is_skipped_without_dropout_and_changes_neither_loss_nor_gradients(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Issue 48: a step is one pass over its samples and one optimizer step, so without dropout
    the old-policy logprobs are the loss forward's own, detached: the no-grad forward that
    computed them again is skipped, one forward per micro-batch. The loss, the gradients and the
    importance-sampling metrics are those of the step that runs it. A LoRA adapter's dropout, or a
    dropout rate in the model's config, keeps it."""
    grpo = {"loss_type": "grpo", "beta": 0.1, "vllm_importance_sampling_mode": "token_truncate"}
    found = {}
    for skip in (True, False):
        learner = Learner(str(tiny_model), tmp_path / str(skip), grpo, total_steps=1, micro_batch=3)
        assert learner.old_is_current  # the tiny Llama has no dropout
        learner.old_is_current = skip
        forwards, logps = [], learner.logps

        def counted(*args: Any, logps: Any = logps, forwards: list[int] = forwards, **kwargs: Any) -> Any:
            forwards.append(1)
            return logps(*args, **kwargs)

        learner.logps = counted  # type: ignore[method-assign]
        total = sum(learner.part_losses(groups()))
        total.backward()  # type: ignore[union-attr]
        grads = {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}
        found[skip] = (float(total.detach()), grads, dict(learner._sums), len(forwards))
    parts = len(learner._parts(groups())[0])
    (loss, grads, sums, forwards), (loss_, grads_, sums_, forwards_) = found[True], found[False]
    assert forwards + parts == forwards_ and parts > 1  # one forward fewer per micro-batch
    assert loss == pytest.approx(loss_, rel=1e-6) and sums == pytest.approx(sums_, rel=1e-6)
    assert sums["judged"] > 0 and grads.keys() == grads_.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_[name], rtol=1e-5, atol=1e-8, msg=name)
    dropped = Learner(str(tiny_model), tmp_path / "lora", grpo, total_steps=1, lora={**LORA, "lora_dropout": 0.1})
    assert not dropped.old_is_current
    shutil.copytree(tiny_model, tmp_path / "dropout")
    config = json.loads((tmp_path / "dropout" / "config.json").read_text())
    (tmp_path / "dropout" / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    assert not Learner(str(tmp_path / "dropout"), tmp_path / "d", grpo, total_steps=1).old_is_current


def _batch_of(prompts: list[int], rows: int, completion: int) -> tuple[Any, Any, int]:
    """A TRL batch's input ids and mask: `rows` rows for each prompt length, completions of
    `completion` tokens but one a row shorter each (right-padded)."""
    ids, masks = [], []
    width = max(prompts)
    for group, length in enumerate(prompts):
        for row in range(rows):
            kept = completion - row
            ids.append([0] * (width - length) + [group + 1] * length + [7] * completion)
            masks.append([0] * (width - length) + [1] * (length + kept) + [0] * (completion - kept))
    return torch.tensor(ids), torch.tensor(masks), completion


def test_the_pass_plan_follows_what_a_pass_costs_on_the_device(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 48: a pass's fixed cost, in tokens, is tens on two CPU cores and thousands on an
    H200, where the shared prompt made short-prompt batches 4x slower than TRL's padded batch.
    The plan counts both paths' tokens and passes at the device's cost: at a GPU's, a batch of
    short prompts (the arithmetic example's shape) goes padded and one of long agent prompts
    shared; at a CPU's both share. The cost is measured on the device when not given."""
    import trainer.grpo
    from trainer.forward import CPU_OVERHEAD, measured_overhead, share_plan, sharing_pays

    def pays(batch: tuple[Any, Any, int], overhead: float) -> bool:
        return sharing_pays(batch[0], share_plan(*batch, 8, overhead), 8, overhead)

    arithmetic, agent = _batch_of([136, 130], 8, 40), _batch_of([4000] * 4, 8, 120)
    assert pays(arithmetic, 16) and pays(agent, 16)
    for gpu in (2000, 5936, 14576):  # an H200's, 2026-11: a 1.5B model's, SmolLM2-135M's
        assert not pays(arithmetic, gpu) and pays(agent, gpu)
    taken: list[float | None] = []
    forward = trainer.grpo.shared_prefix_logps
    for overhead in (16.0, 1e5, None):
        out = tmp_path / str(overhead)
        learner = Learner(str(tiny_model), out, {}, total_steps=1, micro_batch=4, overhead=overhead)

        def shared(*args: Any, overhead: float | None = overhead, **kwargs: Any) -> Any:
            taken.append(overhead)
            return forward(*args, **kwargs)

        monkeypatch.setattr(trainer.grpo, "shared_prefix_logps", shared)
        learner.step(groups())
        if overhead is None:  # a CPU's is not measured: CPU_OVERHEAD
            assert learner.overhead == CPU_OVERHEAD
    assert 16.0 in taken and 1e5 not in taken
    # How a GPU's is measured, run here on the CPU: it leaves no gradient behind (its value is
    # clamped to 1-100,000 tokens, so only a GPU's run says whether it is right: docs/benchmarks.md).
    measured_overhead(learner.model, learner.trl.accelerator, len(learner.tokenizer), 64, 2)
    assert all(p.grad is None for p in learner.model.parameters())
