"""The learner's checks on a CUDA machine (run by hand there; the suite runs on CPUs):

    python -m tests.support.gpu_check TOKENIZER_DIR OUT

With a tiny random Llama built in OUT (TOKENIZER_DIR: the default model's directory, or any
with SmolLM2's tokenizer), saved once in float32 and once in bfloat16: a bf16 checkpoint is
stepped in float32 master weights under bf16 autocast, and an lr 1e-6 step changes most of them;
its loss matches the float32 checkpoint's computed without autocast; an episode cut into 3
sequences weighs what it weighs as 1. Prints the figures as JSON; exits 1 if a check fails.
FSDP2 on NCCL is `torchrun --nproc-per-node N -m tests.support.distributed_step ... fsdp2`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tests.support.sequences import cut_episode, groups
    from trainer.grpo import Learner
    from trainer.sample import Sample

    tokenizer_dir, out = sys.argv[1], Path(sys.argv[2])
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), num_key_value_heads=2, **shape))
    for name, dtype in (("tiny", torch.float32), ("tiny-bf16", torch.bfloat16)):
        model.to(dtype).save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
    grpo = {"loss_type": "grpo", "temperature": 0.9, "max_completion_length": 64, "learning_rate": 1e-6}
    grpo["vllm_importance_sampling_correction"] = False  # its default is per sequence, which a cut changes
    samples = groups()
    found: dict[str, object] = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}

    bf16 = Learner(str(out / "tiny-bf16"), out / "a", grpo, total_steps=2, micro_batch=4)
    weights = next(bf16.model.parameters())
    found |= {"weights_dtype": str(weights.dtype), "bf16_autocast": bf16.args.bf16}
    loss = float(sum(bf16.part_losses(samples)).detach())
    bf16.model.zero_grad(set_to_none=True)
    before = {n: t.detach().clone() for n, t in bf16.model.named_parameters()}
    bf16.step(samples)
    changed = [float((t.detach() != before[n]).float().mean()) for n, t in bf16.model.named_parameters()]
    found["weights_changed_by_a_1e-6_step"] = sum(changed) / len(changed)

    fp32 = Learner(str(out / "tiny"), out / "b", {**grpo, "bf16": False}, total_steps=1, micro_batch=4)
    found["loss_bf16_checkpoint_autocast_vs_fp32"] = [loss, float(sum(fp32.part_losses(samples)).detach())]
    whole, cuts, other = cut_episode()
    one = float(sum(fp32.part_losses([Sample(whole, 1.1), other])).detach())
    three = float(sum(fp32.part_losses([*(Sample(c, 1.1) for c in cuts), other])).detach())
    found["episode_as_1_vs_3_sequences"] = [one, three]
    print(json.dumps(found))
    a, b = found["loss_bf16_checkpoint_autocast_vs_fp32"]  # type: ignore[misc]
    ok = (
        weights.dtype == torch.float32
        and found["weights_changed_by_a_1e-6_step"] > 0.5  # type: ignore[operator]
        and abs(a - b) <= 1e-3 * abs(b)
        and abs(one - three) <= 1e-5 * abs(one)
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
