"""One optimizer step of the Learner on the GRPO groups of tests/support/sequences.py, in
every process of a torchrun launch (tests/trainer/test_distributed.py). Rank 0 takes the step
and saves the trained parameters and the step's metrics; the other ranks follow (the rank
named by RLP_TEST_CRASH_RANK raises instead).

    torchrun --nproc-per-node 2 -m tests.support.distributed_step MODEL OUT GRPO MICRO_BATCH LORA ROWS SHARDING

GRPO is GRPOConfig fields as JSON; LORA is LoraConfig fields as JSON, or null; ROWS how many of
the groups' 8 rows the step takes; SHARDING replicate or fsdp2 (then rank 0 saves the gathered
weights, and those are compared). Each rank writes the passes it planned and ran on the
shared-prompt path when sharded (plans-RANK.json: per forward, the buckets of each prompt).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def main() -> None:
    import torch

    import trainer.forward
    from tests.support.sequences import groups
    from trainer.grpo import Learner

    plans: list[dict[str, list[int]]] = []  # what each rank ran of the shared-prompt path, sharded
    in_step = trainer.forward.in_step

    def recorded(plan: Any) -> Any:
        padded = in_step(plan)
        plans.append({"own": [len(b) for _, b in plan], "run": [len(b) for _, b in padded]})
        return padded

    trainer.forward.in_step = recorded

    model, out, grpo, micro_batch = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
    lora, rows, sharding = json.loads(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
    learner = Learner(model, out / "trl", grpo, total_steps=1, micro_batch=micro_batch, lora=lora, sharding=sharding)
    if learner.rank and os.environ.get("RLP_TEST_CRASH_RANK") == str(learner.rank):
        raise RuntimeError(f"rank {learner.rank} crashes on purpose")

    def lead() -> None:
        metrics = learner.step(groups()[:rows])
        if sharding == "fsdp2":  # the whole weights, gathered from every rank (as a swap or checkpoint has them)
            learner.save(out / "saved")
            from safetensors.torch import load_file

            trained = load_file(out / "saved" / "model.safetensors")
        else:
            trained = {n: p.detach() for n, p in learner.trl.model.named_parameters() if p.requires_grad}
        torch.save(trained, out / f"trained-{learner.world}.pt")
        per_rank = sum(
            p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in learner.model.parameters()
        )
        (out / f"metrics-{learner.world}.json").write_text(json.dumps({**metrics, "parameters_on_rank": per_rank}))

    rank = learner.rank
    learner.lead(lead)
    (out / f"plans-{rank}.json").write_text(json.dumps(plans))


if __name__ == "__main__":
    main()
