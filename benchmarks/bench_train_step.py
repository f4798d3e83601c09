"""The optimizer step on the example's batch (`make bench-train-step`): TRL's plain padded batch
against the shared-prompt path (each group's prompt run once per micro-batch) and against the
path the learner chooses by what a pass costs on this device (trainer/forward.py), all in one
run, alternating, on the same learner.

The batch is made as `rl-proxy train` makes one: the arithmetic example's episodes through
rl-proxy on the real vLLM CPU server (launched in eager mode unless --upstream names one), read
back as GRPO groups of 8 until `groups_per_step` groups carry a signal. vLLM is stopped before
the steps are timed, so the two paths share the cores with nothing else.

`--synthetic` needs no vLLM (a GPU machine lent for minutes): the batch shapes of
benchmarks/support/synthetic.py on models of random weights from a config, on CUDA where there
is one, else the CPU; one table row per model and shape.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.grpo import Learner
from trainer.sample import Sample

if TYPE_CHECKING:
    from trainer.config import TrainConfig

EXAMPLE = Path(__file__).resolve().parents[1] / "harness_adapters" / "examples" / "arithmetic"


def example_batch(upstream: str, model: str, config: TrainConfig, work: Path) -> list[Sample]:
    """`groups_per_step` groups of the example with unequal rewards, as the trainer reads them."""
    from harness_adapters.rollouts import Rollouts
    from harness_adapters.runner import EpisodeRunner
    from harness_adapters.tasks import load_tasks
    from proxy.app import create_app
    from proxy.server import AppThread
    from proxy.settings import Settings
    from recorder.store import Store
    from trainer.groups import GroupReader, LoopState, reward_rule

    db = str(work / "batch.db")
    tasks = load_tasks(config.path(config.tasks), config.split)

    async def main(url: str) -> list[Sample]:
        runner = EpisodeRunner(
            url,
            config.adapter(),
            config.reward_sources(),
            model,
            work / "episodes",
            "bench-step",
            config.timeout,
            config.concurrency,
        )
        rollouts = Rollouts(runner, tasks, config.episodes_per_task, asyncio.Semaphore(config.concurrency))
        samples: list[Sample] = []
        async with Store(db) as store, runner.admin() as admin:
            reader = GroupReader(config, store, LoopState(), reward_rule(config.train, "group"), 1.0, {})
            for _ in range(8 * config.train.groups_per_step):
                if len(samples) >= config.train.groups_per_step * config.episodes_per_task:
                    break
                prepared = await reader.prepare((await rollouts.groups(admin, 1))[0])
                samples += prepared[0] if prepared else []
                print(f"  groups with a signal: {len(samples) // config.episodes_per_task}", flush=True)
        return samples

    with AppThread(create_app(Settings(upstream=upstream, db=db))) as proxy:
        return asyncio.run(main(proxy.url))


PATHS = {False: "plain", True: "shared prompt", None: "chosen"}  # Learner.shared_prefix


def compare(learner: Learner, samples: list[Sample], steps: int) -> dict[str, Any]:
    """The paths on the same samples: loss and gradient norm on the same weights first (what
    each computes), then `steps` timed optimizer steps of each, alternating (what each costs)."""
    from trainer.forward import pass_overhead

    def loss_and_grad_norm(shared: bool) -> tuple[float, float]:
        learner.shared_prefix = shared
        learner.model.zero_grad()
        loss = 0.0
        for part in learner.part_losses(samples):
            part.backward()
            loss += float(part.detach())
        norm = sum(float(p.grad.pow(2).sum()) for p in learner.model.parameters() if p.grad is not None) ** 0.5
        learner.model.zero_grad()
        return loss, norm

    found: dict[str, Any] = {"plain": loss_and_grad_norm(False), "shared": loss_and_grad_norm(True)}
    if learner.overhead is None:  # measured here, not inside the first timed step
        learner.overhead = pass_overhead(learner.model, learner.trl.accelerator, len(learner.tokenizer))
    found["overhead"] = learner.overhead
    seconds: dict[bool | None, list[float]] = {path: [] for path in PATHS}
    for n in range(steps):
        for path, name in PATHS.items():
            learner.shared_prefix = path
            _synchronize()
            start = time.perf_counter()
            learner.step(samples)
            _synchronize()
            seconds[path].append(time.perf_counter() - start)
            print(f"  step {n + 1}/{steps} {name}: {seconds[path][-1]:.2f} s", flush=True)
    found["plain_s"], found["shared_s"], found["chosen_s"] = (statistics.median(seconds[p]) for p in PATHS)
    return found


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def synthetic(args: argparse.Namespace, work: Path) -> None:
    """The `--synthetic` table: every model shape and batch shape asked for, both paths."""
    import yaml

    from benchmarks.support.synthetic import SHAPES, random_model, synthetic_batch

    train = yaml.safe_load((EXAMPLE / "train.yaml").read_text())["train"]
    grpo = {**train["grpo"], "gradient_checkpointing": args.checkpointing}
    rows = []
    for name in args.models:
        path = random_model(name, args.tokenizer or _default_model(), work / name)
        learner = Learner(path, work / f"trl-{name}", grpo, 3 * args.steps * len(args.shapes) + 4, train["micro_batch"])
        vocab = len(learner.tokenizer)
        for shape in args.shapes:
            samples = synthetic_batch(SHAPES[shape], vocab)
            tokens = sum(len(s.sequence.input_ids) for s in samples)
            print(f"{name}, {shape} shape: {len(samples)} sequences, {tokens} tokens", flush=True)
            rows.append((name, shape, tokens, compare(learner, samples, args.steps)))
        del learner
    device = _device()
    print(f"\nOne optimizer step, synthetic batches, random weights, {device}, median of {args.steps}:\n")
    print(
        "| model | batch | tokens | pass = tokens | TRL padded s | shared prompt s | chosen s | "
        "chosen speed-up | grad norm padded / shared |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, shape, tokens, r in rows:
        ratio = r["plain"][1] / r["shared"][1] if r["shared"][1] else float("nan")
        print(
            f"| {name}{' (checkpointed)' if args.checkpointing else ''} | {shape} | {tokens} | {r['overhead']:.0f} | "
            f"{r['plain_s']:.3f} | {r['shared_s']:.3f} | {r['chosen_s']:.3f} | {r['plain_s'] / r['chosen_s']:.2f}x | "
            f"{ratio:.4f} |"
        )


def _device() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


def _default_model() -> str:
    from proxy.model import resolve_model

    return resolve_model("default")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", help="a running vLLM (…/v1) instead of launching one")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each path (median reported)")
    parser.add_argument("--synthetic", action="store_true", help="synthetic batches, random weights, no vLLM")
    parser.add_argument("--shapes", nargs="+", default=["arithmetic", "agent"], help="--synthetic: batch shapes")
    parser.add_argument("--models", nargs="+", default=["smollm2-135m"], help="--synthetic: model shapes")
    parser.add_argument("--tokenizer", help="--synthetic: a folder with the tokenizer [default: the default model's]")
    parser.add_argument("--checkpointing", action="store_true", help="--synthetic: activation checkpointing")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rlp-bench-step-"))
    if args.synthetic:
        synthetic(args, work)
        return
    from benchmarks.bench_episodes import bench_vllm
    from harness_adapters.config import load_config
    from trainer.config import TrainConfig

    config = load_config(EXAMPLE / "train.yaml", TrainConfig)
    with bench_vllm(args.upstream, work, max_model_len=config.proxy.max_model_len) as (upstream, model):
        samples = example_batch(upstream, model, config, work)
    train = config.train
    learner = Learner(_default_model(), work / "trl", train.grpo, 3 * args.steps + 2, train.micro_batch)
    r = compare(learner, samples, args.steps)
    tokens = sum(len(s.sequence.input_ids) for s in samples)
    prompts = {tuple(s.sequence.input_ids[: s.split]) for s in samples}
    print(
        f"\nOne optimizer step on the arithmetic example's batch ({len(samples)} sequences, {tokens} tokens, "
        f"{len(prompts)} prompts, micro_batch {train.micro_batch}, loss {train.grpo['loss_type']}), "
        f"this machine's {_device()}, median of {args.steps}:\n"
    )
    print("| path | median step s | loss (same weights) | gradient norm |")
    print("|---|---:|---:|---:|")
    print(f"| plain (TRL's padded batch) | {r['plain_s']:.2f} | {r['plain'][0]:.6f} | {r['plain'][1]:.6f} |")
    print(
        f"| shared prompt, passes of like lengths | {r['shared_s']:.2f} | {r['shared'][0]:.6f} | {r['shared'][1]:.6f} |"
    )
    print(f"| chosen by cost (a pass = {r['overhead']:.0f} tokens) | {r['chosen_s']:.2f} | | |")
    shared, chosen = r["plain_s"] / r["shared_s"], r["plain_s"] / r["chosen_s"]
    print(f"\nstep speed-up vs plain: shared {shared:.2f}x, chosen {chosen:.2f}x")


if __name__ == "__main__":
    main()
