"""Beyond one process (`make bench-scale`): on the arithmetic example's batch, the optimizer step
with full fine-tuning, with LoRA (r=16), and full on two processes (torchrun, gloo), data parallel
and sharded with FSDP2 (with and without activation checkpointing), all on the shared-prompt
step, each in a process of its own so that its peak memory is its own, with what rank 0 holds of
the parameters and optimizer state, and an FSDP2 resume's peak per rank; then, on a vLLM that
takes adapters, the swap of a new version with 8 streams in flight: a full reload (vLLM paused)
of a float32 and of a bf16 version, against an adapter load (nothing paused).

The batch is made as `rl-proxy train` makes one (bench_train_step.example_batch); vLLM is
stopped before the steps are timed. Each step variant runs `--steps` timed steps after one
untimed; the figures are medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import resource
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_episodes import EXAMPLE, bench_vllm
from benchmarks.bench_train_step import example_batch
from benchmarks.support.memory import peak_above
from benchmarks.support.streams import streams_in_flight
from harness_adapters.config import load_config
from trainer.config import LORA_DEFAULTS, TrainConfig
from trainer.run import torchrun_command


def step_variant(batch: Path, out: Path, steps: int, lora: bool, sharding: str, checkpointing: bool) -> None:
    """One variant, in this process (and its torchrun peers): timed steps, peak memory, weights;
    sharded, a checkpoint to resume from (`resume_variant`)."""
    import torch

    from proxy.model import resolve_model
    from trainer.grpo import Learner

    config = load_config(EXAMPLE / "train.yaml", TrainConfig)
    samples = pickle.loads(batch.read_bytes())
    learner = Learner(
        resolve_model("default")[0],
        out / "trl",
        {**config.train.grpo, "gradient_checkpointing": checkpointing},
        steps + 1,
        config.train.micro_batch,
        lora=LORA_DEFAULTS if lora else None,
        sharding=sharding,
        serve_dtype="float32",  # compared with one process's float32 weights
    )
    seconds: list[float] = []
    held: list[float] = []

    def lead() -> None:
        for _ in range(steps + 1):
            start = time.perf_counter()
            learner.step(samples)
            seconds.append(time.perf_counter() - start)
            print(f"    step {len(seconds)}/{steps + 1}: {seconds[-1]:.1f} s", flush=True)
        local = [t.to_local() if hasattr(t, "to_local") else t for t in learner.model.parameters()]
        local += [
            v.to_local() if hasattr(v, "to_local") else v
            for state in learner.trl.optimizer.state.values()
            for v in state.values()
            if torch.is_tensor(v)
        ]
        held.append(sum(t.numel() * t.element_size() for t in local) / 2**30)
        if learner.fsdp:  # the whole weights, gathered from both ranks as a swap gathers them; a checkpoint
            learner.save(out / "saved")

    learner.lead(lead)
    if learner.rank:
        return
    if sharding == "fsdp2":
        from safetensors.torch import load_file

        trained = load_file(out / "saved" / "model.safetensors")
    else:
        trained = {n: p.detach() for n, p in learner.trl.model.named_parameters() if p.requires_grad}
    torch.save(trained, out / "weights.pt")
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    trainable = sum(p.numel() for p in trained.values())
    (out / "result.json").write_text(
        json.dumps(
            {
                "step_s": statistics.median(seconds[1:]),
                "peak_gb": peak_gb,
                "trainable": trainable,
                "processes": learner.world,
                "held_gb": held[0],
            }
        )
    )


def resume_variant(saved: Path, out: Path) -> None:
    """An FSDP2 learner resumed from `saved` (in this process and its torchrun peer): what each
    rank's memory peaked at above where it was while it read its shards (VmHWM, reset first)."""
    from proxy.model import resolve_model
    from trainer.grpo import Learner

    config = load_config(EXAMPLE / "train.yaml", TrainConfig)
    base = resolve_model("default")[0]
    learner = Learner(str(saved), out / "trl", config.train.grpo, 2, reference=base, sharding="fsdp2")
    above = peak_above(lambda: learner.resume(saved))
    (out / f"resume-{learner.rank}.json").write_text(json.dumps({"above_gb": above / 2**30}))
    learner.lead(lambda: None)


def run_variant(
    work: Path,
    name: str,
    steps: int,
    lora: bool = False,
    processes: int = 1,
    sharding: str = "replicate",
    checkpointing: bool = False,
) -> dict[str, Any]:
    out = work / name
    out.mkdir()
    args = [
        "--step",
        str(work / "batch.pkl"),
        str(out),
        str(steps),
        "--sharding",
        sharding,
        *(["--lora"] if lora else []),
        *(["--checkpointing"] if checkpointing else []),
    ]
    _launch(name, processes, args)
    return {"name": name, **json.loads((out / "result.json").read_text())}


def _launch(name: str, processes: int, args: list[str]) -> None:
    command = torchrun_command(processes, "benchmarks.bench_scale", *args)
    print(f"  {name} ...", flush=True)
    subprocess.run(command, check=True, env={**os.environ, **({"OMP_NUM_THREADS": "1"} if processes > 1 else {})})


FULL = ("full reload, float32", "full reload, bf16")


async def swap_pauses(
    upstream: str, model: str, work: Path, rounds: int
) -> tuple[dict[str, tuple[list[float], int]], dict[str, int]]:
    """Each round: 8 streams start, then a new version comes in: full weights saved in float32
    (the masters, as versions were saved before) or in bf16 (what vLLM serves the model in), or
    a LoRA adapter. Also the bytes of each version's directory."""
    import httpx
    from openai import AsyncOpenAI

    from proxy.model import resolve_model
    from proxy.upstream import adapter_name
    from trainer.grpo import Learner
    from trainer.weight_sync import hot_swap, load_adapter, set_version

    base = Path(resolve_model("default")[0])
    saved = {"adapter load": work / "adapter", FULL[0]: work / "float32", FULL[1]: work / "bf16"}
    Learner(str(base), work / "trl", {}, 1, lora=LORA_DEFAULTS).save(saved["adapter load"], with_optimizer=False)
    for kind, dtype in zip(FULL, ("float32", "auto"), strict=True):
        Learner(str(base), work / "trl", {}, 1, serve_dtype=dtype).save(saved[kind], with_optimizer=False)
    sizes = {kind: sum(f.stat().st_size for f in d.iterdir()) for kind, d in saved.items()}
    root = upstream.removesuffix("/v1")
    client = AsyncOpenAI(base_url=upstream, api_key="bench", max_retries=0, timeout=300)
    seconds: dict[str, list[float]] = {kind: [] for kind in saved}
    failed = dict.fromkeys(seconds, 0)
    version = 0

    await set_version(root, "0")
    for n in range(rounds):
        for kind in seconds:
            version += 1
            streams = await streams_in_flight(client, model, 8, 64)
            if kind in FULL:
                took = await hot_swap([root], saved[kind], str(version), base)
            else:
                took = await load_adapter([root], saved[kind], model, str(version), retire=str(version - 3))
            results = await asyncio.gather(*streams, return_exceptions=True)
            seconds[kind].append(took)
            failed[kind] += sum(not isinstance(r, str) or not r for r in results)
            print(f"  round {n + 1}/{rounds} {kind}: {took:.2f} s", flush=True)
    httpx.post(f"{root}/v1/unload_lora_adapter", json={"lora_name": adapter_name(model, str(version))})
    return {kind: (seconds[kind], failed[kind]) for kind in seconds}, sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", help="a running vLLM (…/v1) started with LoRA, instead of launching one")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (median reported)")
    parser.add_argument("--rounds", type=int, default=3, help="swaps of each kind (median reported)")
    parser.add_argument("--step", nargs=3, metavar=("BATCH", "OUT", "STEPS"), help=argparse.SUPPRESS)
    parser.add_argument("--lora", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sharding", default="replicate", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--resume", nargs=2, metavar=("SAVED", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        batch, out, steps = Path(args.step[0]), Path(args.step[1]), int(args.step[2])
        return step_variant(batch, out, steps, args.lora, args.sharding, args.checkpointing)
    if args.resume:
        return resume_variant(Path(args.resume[0]), Path(args.resume[1]))
    work = Path(tempfile.mkdtemp(prefix="rlp-bench-scale-"))
    config = load_config(EXAMPLE / "train.yaml", TrainConfig)
    with bench_vllm(args.upstream, work, config.proxy.max_model_len, lora_rank=16) as (upstream, model):
        samples = example_batch(upstream, model, config, work)
        pauses, sizes = asyncio.run(swap_pauses(upstream, model, work, args.rounds))
    (work / "batch.pkl").write_bytes(pickle.dumps(samples))
    rows = [
        run_variant(work, "full", args.steps),
        run_variant(work, "lora", args.steps, lora=True),
        run_variant(work, "full-2", args.steps, processes=2),
        run_variant(work, "fsdp2-2", args.steps, processes=2, sharding="fsdp2"),
        run_variant(work, "fsdp2-2 checkpointed", args.steps, processes=2, sharding="fsdp2", checkpointing=True),
    ]
    _launch("fsdp2-2 resumed", 2, ["--resume", str(work / "fsdp2-2" / "saved"), str(work / "fsdp2-2")])
    resumed = [json.loads((work / "fsdp2-2" / f"resume-{rank}.json").read_text())["above_gb"] for rank in (0, 1)]
    adam = 2 * rows[0]["trainable"] * 4 / 2**30  # the whole Adam state, float32
    import torch

    one = torch.load(work / "full" / "weights.pt")
    drift = {
        name: max(float((one[k] - other[k]).abs().max()) for k in one)
        for name in ("full-2", "fsdp2-2", "fsdp2-2 checkpointed")
        for other in [torch.load(work / name / "weights.pt")]
    }

    tokens = sum(len(s.sequence.input_ids) for s in samples)
    print(
        f"\nThe optimizer step on the arithmetic example's batch ({len(samples)} sequences, {tokens} tokens, "
        f"micro_batch {config.train.micro_batch}), 2 CPU cores, median of {args.steps}:\n"
    )
    print(
        "| learner | processes | trainable parameters | median step s | x data parallel | peak memory GB (rank 0) "
        "| parameters + optimizer state GB (rank 0) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    parallel = next(r["step_s"] for r in rows if r["name"] == "full-2")
    for row in rows:
        step_s, peak_gb, held = f"{row['step_s']:.2f}", f"{row['peak_gb']:.2f}", f"{row['held_gb']:.2f}"
        ratio = f"{row['step_s'] / parallel:.2f}"
        print(
            f"| {row['name']} | {row['processes']} | {row['trainable']:,} | {step_s} | {ratio} | {peak_gb} | {held} |"
        )
    print(
        f"\nFSDP2 resumed from its checkpoint: each rank's memory peaked {resumed[0]:.2f} / {resumed[1]:.2f} GB "
        f"above where it was while it read its shards; the whole Adam state is {adam:.2f} GB"
    )
    for name, largest in drift.items():
        print(f"\nweights after {args.steps + 1} steps, full vs {name}: largest difference {largest:.2e}")
    print(f"\nA new version while 8 streams are in flight, median of {args.rounds}:\n")
    print("| swap | version directory MB | median s until it serves | vLLM paused | failed streams |")
    print("|---|---:|---:|---|---:|")
    for kind, (took, failed) in pauses.items():
        paused = "no" if kind == "adapter load" else "yes"
        print(f"| {kind} | {sizes[kind] / 2**20:.0f} | {statistics.median(took):.2f} | {paused} | {failed} |")


if __name__ == "__main__":
    main()
