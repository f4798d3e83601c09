"""Optimizer steps of the Learner on the GRPO groups of tests/support/sequences.py, in every
process of one launch (tests/trainer/test_distributed.py): one case after another, each with a
Learner of its own, so that the launch (the interpreters, torch's import, the process group) is
paid once for all of them. In each case rank 0 takes the step and saves the trained parameters
and the step's metrics; the other ranks follow (the rank named by RLP_TEST_CRASH_RANK raises
instead).

    torchrun --nproc-per-node 2 -m tests.support.distributed_step MODEL CASES

CASES is a JSON file: a list of cases, each {"out": DIR, "grpo": GRPOConfig fields, "micro_batch":
N, "lora": LoraConfig fields or null, "rows": how many of the groups' 8 rows the step takes,
"sharding": "replicate" or "fsdp2"} (sharded, rank 0 saves the gathered weights in float32, and
those are compared). Each rank writes the passes it planned and ran on the shared-prompt path
when sharded (plans-RANK.json: per forward, the buckets of each prompt) and what it holds after
the step (shards-RANK.pt). A case with "resume": true resumes from an earlier case's checkpoint
in its DIR instead, and each rank writes what it holds then (resumed-RANK.pt) and its peak
memory while it resumed (resume-RANK.json).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def main() -> None:
    import torch.distributed as dist

    model, cases = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
    end = dist.destroy_process_group
    dist.destroy_process_group = lambda *_: None  # each case's Learner.lead would end it: the next one needs it
    try:
        for case in cases:
            out, grpo, micro_batch, sharding = Path(case["out"]), case["grpo"], case["micro_batch"], case["sharding"]
            if case.get("resume"):
                resume(model, out, grpo, micro_batch, sharding)
            else:
                step(model, out, grpo, micro_batch, case["lora"], case["rows"], sharding)
    finally:
        dist.destroy_process_group = end
    if dist.is_initialized():
        dist.destroy_process_group()


def step(model: str, out: Path, grpo: dict[str, Any], micro_batch: int, lora: Any, rows: int, sharding: str) -> None:
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
    out.mkdir(parents=True, exist_ok=True)
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
    trainer.forward.in_step = in_step
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
