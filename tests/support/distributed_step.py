"""One optimizer step of the Learner on the GRPO groups of tests/support/sequences.py, in
every process of a torchrun launch (tests/trainer/test_distributed.py). Rank 0 takes the step
and saves the trained parameters and the step's metrics; the other ranks follow (the rank
named by RLP_TEST_CRASH_RANK raises instead).

    torchrun --nproc-per-node 2 -m tests.support.distributed_step MODEL OUT GRPO MICRO_BATCH LORA ROWS SHARDING

GRPO is GRPOConfig fields as JSON; LORA is LoraConfig fields as JSON, or null; ROWS how many of
the groups' 8 rows the step takes; SHARDING replicate or fsdp2 (then rank 0 saves the gathered
weights in float32, and those are compared). Each rank writes the passes it planned and ran on
the shared-prompt path when sharded (plans-RANK.json: per forward, the buckets of each prompt)
and what it holds after the step (shards-RANK.pt). With a last argument `resume`, the launch
resumes from the first one's checkpoint instead, and each rank writes what it holds then
(resumed-RANK.pt) and its peak memory while it resumed (resume-RANK.json).
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
    if sys.argv[8:] == ["resume"]:
        return resume(model, out, grpo, micro_batch, sharding)
    learner = Learner(
        model, out / "trl", grpo, 2, micro_batch=micro_batch, lora=lora, sharding=sharding, serve_dtype="float32"
    )
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
    torch.save(shards(learner), out / f"shards-{rank}.pt")


def resume(model: str, out: Path, grpo: dict[str, Any], micro_batch: int, sharding: str) -> None:
    """The second launch: a learner resumed from the first's checkpoint (`saved`), each rank's
    shards and its peak memory (VmHWM, reset just before) while it resumed."""
    import torch

    from benchmarks.support.memory import peak_above
    from trainer.grpo import Learner

    saved = out / "saved"
    learner = Learner(str(saved), out / "trl", grpo, 2, micro_batch=micro_batch, reference=model, sharding=sharding)
    with torch.no_grad():  # what it loaded is the served float32 weights: only the resume may bring them back
        for param in learner.model.parameters():
            param.zero_()
    above = peak_above(lambda: learner.resume(saved))
    rank = learner.rank
    torch.save(shards(learner), out / f"resumed-{rank}.pt")
    (out / f"resume-{rank}.json").write_text(json.dumps({"above": above}))
    learner.lead(lambda: None)


def shards(learner: Any) -> dict[str, Any]:
    """What this rank holds of the parameters and the optimizer state (its shards when sharded)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in learner.model.parameters()]
    state = [
        {k: v.to_local() if hasattr(v, "to_local") else v for k, v in learner.trl.optimizer.state[p].items()}
        for p in learner.model.parameters()
    ]
    return {"parameters": [t.detach().clone() for t in local], "optimizer": state}


if __name__ == "__main__":
    main()
