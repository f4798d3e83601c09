"""The optimizer step on the example's batch (`make bench-train-step`): TRL's plain padded batch
against the shared-prompt path (each group's prompt run once per micro-batch), both in one run,
alternating, on the same learner.

The batch is made as `rl-proxy train` makes one: the arithmetic example's episodes through
rl-proxy on the real vLLM CPU server (launched in eager mode unless --upstream names one), read
back as GRPO groups of 8 until `groups_per_step` groups carry a signal. vLLM is stopped before
the steps are timed, so the two paths share the cores with nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.bench_episodes import EXAMPLE, bench_vllm
from harness_adapters.config import load_config
from harness_adapters.rollouts import Rollouts
from harness_adapters.runner import EpisodeRunner
from harness_adapters.tasks import load_tasks
from proxy.app import create_app
from proxy.model import resolve_model
from proxy.server import AppThread
from proxy.settings import Settings
from recorder.store import Store
from trainer.config import TrainConfig
from trainer.groups import GroupReader, LoopState, reward_rule
from trainer.grpo import Learner, Sample


def example_batch(upstream: str, model: str, config: TrainConfig, work: Path) -> list[Sample]:
    """`groups_per_step` groups of the example with unequal rewards, as the trainer reads them."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", help="a running vLLM (…/v1) instead of launching one")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each path (median reported)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rlp-bench-step-"))
    config = load_config(EXAMPLE / "train.yaml", TrainConfig)
    with bench_vllm(args.upstream, work, max_model_len=config.proxy.max_model_len) as (upstream, model):
        samples = example_batch(upstream, model, config, work)
    train = config.train
    learner = Learner(resolve_model("default")[0], work / "trl", train.grpo, 2 * args.steps + 2, train.micro_batch)

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

    # Both paths on the same weights first: what each computes, then what each costs.
    (plain_loss, plain_norm), (shared_loss, shared_norm) = loss_and_grad_norm(False), loss_and_grad_norm(True)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for n in range(args.steps):
        for shared in (False, True):
            learner.shared_prefix = shared
            start = time.perf_counter()
            learner.step(samples)
            seconds[shared].append(time.perf_counter() - start)
            print(
                f"  step {n + 1}/{args.steps} {'shared prompt' if shared else 'plain'}: {seconds[shared][-1]:.1f} s",
                flush=True,
            )

    tokens = sum(len(s.sequence.input_ids) for s in samples)
    prompts = {tuple(s.sequence.input_ids[: s.split]) for s in samples}
    plain_s, shared_s = statistics.median(seconds[False]), statistics.median(seconds[True])
    print(
        f"\nOne optimizer step on the arithmetic example's batch ({len(samples)} sequences, {tokens} tokens, "
        f"{len(prompts)} prompts, micro_batch {train.micro_batch}, loss {train.grpo['loss_type']}), "
        f"this machine's CPU, median of {args.steps}:\n"
    )
    print("| path | median step s | loss (same weights) | gradient norm |")
    print("|---|---:|---:|---:|")
    print(f"| plain (TRL's padded batch) | {plain_s:.2f} | {plain_loss:.6f} | {plain_norm:.6f} |")
    print(f"| shared prompt, passes of like lengths | {shared_s:.2f} | {shared_loss:.6f} | {shared_norm:.6f} |")
    print(f"\nstep speed-up vs plain: {plain_s / shared_s:.2f}x")


if __name__ == "__main__":
    main()
