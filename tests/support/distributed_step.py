"""One optimizer step of the Learner on the GRPO groups of tests/support/sequences.py, in
every process of a torchrun launch (tests/trainer/test_distributed.py). Rank 0 takes the step
and saves the trained parameters and the step's metrics; the other ranks follow (the rank
named by RLP_TEST_CRASH_RANK raises instead).

    torchrun --nproc-per-node 2 -m tests.support.distributed_step MODEL OUT '{"loss_type": ...}' MICRO_BATCH LORA ROWS

LORA is LoraConfig fields as JSON, or null; ROWS how many of the groups' 8 rows the step takes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> None:
    import torch

    from tests.support.sequences import groups
    from trainer.grpo import Learner

    model, out, grpo, micro_batch = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
    lora, rows = json.loads(sys.argv[5]), int(sys.argv[6])
    learner = Learner(model, out / "trl", grpo, total_steps=1, micro_batch=micro_batch, lora=lora)
    if learner.rank and os.environ.get("RLP_TEST_CRASH_RANK") == str(learner.rank):
        raise RuntimeError(f"rank {learner.rank} crashes on purpose")

    def lead() -> None:
        metrics = learner.step(groups()[:rows])
        trained = {n: p.detach() for n, p in learner.trl.model.named_parameters() if p.requires_grad}
        torch.save(trained, out / f"trained-{learner.world}.pt")
        (out / f"metrics-{learner.world}.json").write_text(json.dumps(metrics))

    learner.lead(lead)


if __name__ == "__main__":
    main()
