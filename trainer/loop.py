"""`rl-proxy train`: harness episodes through the proxy, GRPO on what it recorded, the new
weights hot-swapped into vLLM, over and over.

A rollout is a GRPO group: one task, `episodes_per_task` episodes, each its own session with
the group's id. In `async` mode rollouts never wait for the trainer: finished groups go into
a bounded queue (`queue_groups`); when it is full, finished rollouts hold their slot, so no
new rollout starts (back-pressure). The trainer takes groups as it needs them. In `sync` mode
each step's groups are generated, then trained on, then the weights are swapped.

A group taken for training is read back from the store and rebuilt into token-exact
sequences (recorder.trajectories). Episodes sampled more than `max_staleness` policy
versions ago are dropped and counted; a group left with fewer than two scored episodes, or
whose rewards are all equal (no signal), is skipped and counted. Every `sync_every` steps the
weights are saved to `out/versions/v<N>` (with the optimizer state and the loop's state: the
checkpoint `--resume` starts from) and swapped into vLLM as version N. Metrics go to
`out/metrics.jsonl` (and TensorBoard or W&B), the curves to `out/training.png`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import statistics
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from harness_adapters.runner import EpisodeRunner
from harness_adapters.tasks import Task
from proxy.vllm import SwapError, hot_swap
from recorder.records import SessionInfo
from recorder.store import Store
from recorder.trajectories import build_sequences
from trainer.config import TrainConfig
from trainer.grpo import Learner, Sample, advantages

FAILING_GROUPS = 3
T = TypeVar("T")


class TrainError(RuntimeError):
    """The run cannot go on; the message says why. The last checkpoint is intact."""


@dataclass
class LoopState:
    """What a checkpoint holds besides the weights and the optimizer."""

    step: int = 0
    version: int = 0
    consumed: list[str] = field(default_factory=list)  # groups trained on or discarded
    skipped_equal: int = 0  # groups whose rewards were all equal
    dropped_stale: int = 0  # episodes older than max_staleness
    unscored: int = 0  # episodes that failed, timed out or made no call
    samples: int = 0
    tokens: int = 0

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> LoopState:
        return cls(**json.loads(path.read_text()))


def latest_checkpoint(out: Path) -> Path | None:
    """The newest `versions/v<N>` with a loop state in it."""
    found = [d for d in (out / "versions").glob("v*") if (d / "state.json").exists() and d.name[1:].isdigit()]
    return max(found, key=lambda d: int(d.name[1:]), default=None)


def resident_gb() -> float | None:
    """This process's resident memory (Linux), for the metrics."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (OSError, ValueError, IndexError):
        return None


def version_number(version: str | None) -> int:
    return int(version) if version is not None and version.isdigit() else 0


@dataclass
class Batch:
    samples: list[Sample]
    rewards: list[float]
    staleness: list[int]


class TrainLoop:
    def __init__(
        self,
        config: TrainConfig,
        learner: Learner,
        runner: EpisodeRunner,
        store: Store,
        vllm_roots: list[str],
        base_weights: Path,
        state: LoopState | None = None,
    ) -> None:
        self.config, self.cfg = config, config.train
        self.learner, self.runner, self.store = learner, runner, store
        self.roots = vllm_roots
        self.out = config.out_dir
        self.state = state or LoopState()
        # The weights vLLM serves: loaded back if a swap fails.
        self.weights = base_weights if state is None else self.out / "versions" / f"v{self.state.version}"
        self.queue: asyncio.Queue[str] = asyncio.Queue(maxsize=self.cfg.queue_groups)
        self.pending: list[str] = []  # groups finished before a restart, taken first
        self.limit = asyncio.Semaphore(config.concurrency)
        self.tasks: list[Task] = []
        self.order: list[Task] = []
        self.rollout_rewards: list[float] = []
        self.metrics_file = self.out / "metrics.jsonl"
        self.started = time.monotonic()
        self.writers: list[Any] = []  # each gets every metrics row: TensorBoard, W&B, the display
        self.failing = 0  # groups in a row without one scored episode
        # Torch work on one thread of its own: the event loop (rollouts) goes on meanwhile, and
        # one thread keeps the allocator's memory in one place.
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="learner")

    async def in_learner(self, work: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.worker, work, *args)

    # Rollouts

    async def rollout(self, admin: Any, task: Task) -> str:
        """One GRPO group of episodes; its group id."""
        group = f"{self.config.run}/{task.id}/{uuid.uuid4().hex[:8]}"

        async def one(n: int) -> None:
            async with self.limit:
                result = await self.runner.episode(admin, task, n, group)
            if result.reward is not None:
                self.rollout_rewards.append(result.reward)

        await asyncio.gather(*(one(n) for n in range(self.config.episodes_per_task)))
        return group

    def next_task(self) -> Task:
        if not self.order:  # every task once, in a new random order, then again
            self.order = random.sample(self.tasks, len(self.tasks))
        return self.order.pop()

    async def produce(self, admin: Any) -> None:
        """Async mode: keep rollouts going; a finished group waits for room in the queue."""
        in_flight = asyncio.Semaphore(-(-self.config.concurrency // self.config.episodes_per_task) + 1)
        running: set[asyncio.Task[None]] = set()

        async def one(task: Task) -> None:
            try:
                await self.queue.put(await self.rollout(admin, task))
            finally:
                in_flight.release()

        try:
            while True:
                await in_flight.acquire()
                job = asyncio.create_task(one(self.next_task()))
                running.add(job)
                job.add_done_callback(running.discard)
        finally:
            for job in list(running):
                job.cancel()

    async def leftovers(self) -> list[str]:
        """Groups finished before a restart and not yet trained on (resume)."""
        sessions = await self.store.list_sessions(run=self.config.run)
        groups: dict[str, list[SessionInfo]] = defaultdict(list)
        for s in sessions:
            if s.group_id:
                groups[s.group_id].append(s)
        consumed = set(self.state.consumed)
        n = self.config.episodes_per_task
        finished = [g for g, members in groups.items() if len(members) == n and all(s.ended_at for s in members)]
        return [g for g in finished if g not in consumed]

    # Batches

    async def prepare(self, group: str) -> tuple[list[Sample], list[float], list[int]] | None:
        """A group's samples with their advantages, or None (counted) if it cannot be used."""
        self.state.consumed.append(group)
        sessions = await self.store.list_sessions(group_id=group)
        current = self.state.version
        kept: list[tuple[SessionInfo, list[Any], int]] = []
        for s in sessions:
            if s.status != "ok" or s.reward is None:
                self.state.unscored += 1
                continue
            calls = [c async for c in self.store.iter_calls(s.id)]
            report = build_sequences(calls, s)  # per-call rewards are not used by GRPO here
            sequences = [q for q in report.sequences if q.sampled_tokens]
            if not sequences:
                self.state.unscored += 1
                continue
            version = min(version_number(span.version) for q in sequences for span in q.spans)
            if current - version > self.cfg.max_staleness:
                self.state.dropped_stale += 1
                continue
            kept.append((s, sequences, current - version))
        self.check_failing(sessions)
        rewards = [float(s.reward) for s, _, _ in kept if s.reward is not None]
        if len(kept) < 2 or max(rewards) == min(rewards):
            self.state.skipped_equal += len(kept) >= 2
            return None
        by_group = self.learner.args.scale_rewards in ("group", True)
        values = advantages(rewards, "group" if by_group else "none", self.cfg.baseline)
        samples = [Sample(q, a) for (_, sequences, _), a in zip(kept, values, strict=True) for q in sequences]
        return samples, rewards, [lag for _, _, lag in kept]

    def check_failing(self, sessions: list[SessionInfo]) -> None:
        """Stop, naming the cause, when groups keep coming back without one scored episode
        (vLLM gone, a harness that cannot start): training could never go on."""
        if any(s.status == "ok" and s.reward is not None for s in sessions):
            self.failing = 0
            return
        self.failing += 1
        if self.failing >= FAILING_GROUPS:
            errors = [s.metadata.get("outcome", {}).get("error") or s.status for s in sessions]
            raise TrainError(f"{self.failing} groups in a row without one scored episode; the last: {errors[-1:]}")

    async def batch(self, admin: Any) -> Batch:
        """`groups_per_step` usable groups: taken from the queue (async) or generated now (sync)."""
        samples: list[Sample] = []
        rewards: list[float] = []
        staleness: list[int] = []
        groups = 0
        while groups < self.cfg.groups_per_step:
            if self.pending:
                taken = [self.pending.pop(0)]
            elif self.cfg.mode == "async":
                taken = [await self.queue.get()]
            else:
                need = self.cfg.groups_per_step - groups
                taken = list(await asyncio.gather(*(self.rollout(admin, self.next_task()) for _ in range(need))))
            for group in taken:
                prepared = await self.prepare(group)
                if prepared is not None:
                    samples += prepared[0]
                    rewards += prepared[1]
                    staleness += prepared[2]
                    groups += 1
        if self.learner.args.scale_rewards == "batch":
            std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
            samples = [Sample(s.sequence, s.advantage / (std + 1e-4)) for s in samples]
        return Batch(samples, rewards, staleness)

    # Weights

    async def swap(self, admin: Any) -> float:
        """Save the weights as the next version and swap them into every vLLM; the pause."""
        version = self.state.version + 1
        directory = self.out / "versions" / f"v{version}"
        await self.in_learner(self.learner.save, directory)

        async def announce() -> None:
            await admin.post("/admin/policy_version/refresh")

        try:
            paused = await hot_swap(self.roots, directory, str(version), self.weights, announce)
        except SwapError:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        self.state.version, self.weights = version, directory
        self.state.save(directory / "state.json")
        kept = sorted((d for d in (self.out / "versions").glob("v*") if d.name[1:].isdigit()),
                      key=lambda d: int(d.name[1:]))[: -self.cfg.keep_versions]  # fmt: skip
        for old in kept:
            shutil.rmtree(old, ignore_errors=True)
        return paused

    # Evaluation

    async def evaluate(self, eval_runner: EpisodeRunner | None, tasks: list[Task]) -> float | None:
        """Success rate on the evaluation tasks under the weights now serving."""
        if eval_runner is None or self.config.eval is None:
            return None
        async with eval_runner.admin() as admin:

            async def one(task: Task, n: int) -> bool:
                async with self.limit:
                    result = await eval_runner.episode(admin, task, n, f"{eval_runner.run}/{task.id}")
                return result.success(self.config.success_at)

            wins = await asyncio.gather(*(one(t, n) for t in tasks for n in range(self.config.eval.episodes_per_task)))
        success = sum(wins) / max(len(wins), 1)
        self.write({"step": self.state.step, "version": self.state.version, "heldout_success": success})
        return success

    # The loop

    def write(self, row: dict[str, Any]) -> None:
        row = {"time": round(time.monotonic() - self.started, 2), **row}
        with open(self.metrics_file, "a") as out:
            out.write(json.dumps(row) + "\n")
        for writer in self.writers:
            writer(row)

    async def run(self, tasks: list[Task], eval_runner: EpisodeRunner | None, eval_tasks: list[Task]) -> dict[str, Any]:
        self.tasks = tasks
        self.out.mkdir(parents=True, exist_ok=True)
        before = await self.evaluate(eval_runner, eval_tasks) if self.state.step == 0 else None
        async with self.runner.admin() as admin:
            self.pending = await self.leftovers()
            producer = asyncio.create_task(self.produce(admin)) if self.cfg.mode == "async" else None
            try:
                while self.state.step < self.cfg.steps:
                    await self.step(admin, eval_runner, eval_tasks)
            finally:
                if producer is not None:  # with the rollouts it started (their sessions stay unended)
                    producer.cancel()
                    await asyncio.gather(producer, return_exceptions=True)
        after = await self.evaluate(eval_runner, eval_tasks)
        return {"before": before, "after": after, "seconds": time.monotonic() - self.started, **asdict(self.state)}

    async def step(self, admin: Any, eval_runner: EpisodeRunner | None, eval_tasks: list[Task]) -> None:
        start = time.monotonic()
        batch = await self.batch(admin)
        waited = time.monotonic() - start
        metrics = await self.in_learner(self.learner.step, batch.samples)
        trained = time.monotonic() - start - waited
        tokens = sum(s.sequence.sampled_tokens for s in batch.samples)
        processed = sum(len(s.sequence.input_ids) for s in batch.samples)
        self.state.step += 1
        self.state.samples += len(batch.samples)
        self.state.tokens += tokens
        paused = None
        if self.state.step % self.cfg.sync_every == 0 or self.state.step == self.cfg.steps:
            paused = await self.swap(admin)
        row = {
            "step": self.state.step, "version": self.state.version, "reward": statistics.fmean(batch.rewards),
            "rollout_reward": statistics.fmean(self.rollout_rewards[-64:]) if self.rollout_rewards else None,
            "samples": len(batch.samples), "tokens": tokens, "tokens_per_s": tokens / max(trained, 1e-9),
            "sequence_tokens_per_s": processed / max(trained, 1e-9),
            "staleness_mean": statistics.fmean(batch.staleness), "staleness_max": max(batch.staleness),
            "skipped_equal": self.state.skipped_equal, "dropped_stale": self.state.dropped_stale,
            "unscored": self.state.unscored, "wait_s": waited, "train_s": trained, "swap_pause_s": paused,
            "queue": self.queue.qsize(), "memory_gb": resident_gb(),
            **{k.replace("/", "_"): v for k, v in metrics.items()},
        }  # fmt: skip
        self.write(row)
        every = self.config.eval.every if self.config.eval else 0
        if every and self.state.step % every == 0 and self.state.step < self.cfg.steps:
            await self.evaluate(eval_runner, eval_tasks)


def plot(metrics_file: Path, out: Path) -> Path | None:
    """Reward and held-out success against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "reward" in r]
    evals = [r for r in rows if "heldout_success" in r]
    if not steps and not evals:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in steps], [r["reward"] for r in steps], label="trained groups' reward", alpha=0.5)
    rollouts = [r for r in steps if r.get("rollout_reward") is not None]
    ax.plot([r["step"] for r in rollouts], [r["rollout_reward"] for r in rollouts], label="rollout reward (last 64)")
    ax.plot([r["step"] for r in evals], [r["heldout_success"] for r in evals], "o-", label="held-out success")
    ax.set_xlabel("step")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
