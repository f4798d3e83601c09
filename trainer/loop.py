"""`rl-proxy train`'s loop: take finished GRPO groups, step, swap the new weights into vLLM,
checkpoint, over and over.

Groups come from the harness adapters' `Rollouts` (episodes through the proxy) and are read
back from the store by `GroupReader` (trainer/groups.py). In `async` mode rollouts never wait
for the trainer: finished groups go into a bounded queue (`queue_groups`); when it is full,
finished rollouts hold their slot, so no new rollout starts (back-pressure). In `sync` mode
each step's groups are generated, then trained on, then the weights are swapped. Every
`sync_every` steps the weights are saved to `out/versions/v<N>` and swapped into vLLM as version
N; every `checkpoint_every` steps (and at the last) that version is also the checkpoint
`--resume` starts from (the optimizer state and the loop's state go with it). Metrics go to
`out/metrics.jsonl` (and TensorBoard or W&B), the curves to `out/training.png`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import random
import resource
import shutil
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from harness_adapters.rollouts import Rollouts, success_rate
from harness_adapters.runner import EpisodeRunner
from harness_adapters.tasks import Task, load_tasks
from proxy.admin_client import AdminClient, AdminError
from recorder.episodes import Sampling
from recorder.errors import StoreError
from recorder.store import Store
from recorder.trajectories import TrainingSequence
from trainer.config import TrainConfig
from trainer.groups import GroupReader, LoopState, TrainError, successes
from trainer.grpo import Learner
from trainer.nccl import NcclSync
from trainer.sample import Sample
from trainer.weight_sync import SwapError, hot_swap, load_adapter

log = logging.getLogger(__name__)

T = TypeVar("T")


def latest_checkpoint(out: Path) -> Path | None:
    """The newest `versions/v<N>` with a loop state in it."""
    found = [d for d in (out / "versions").glob("v*") if (d / "state.json").exists() and d.name[1:].isdigit()]
    return max(found, key=lambda d: int(d.name[1:]), default=None)


async def refresh_version(admin: AdminClient, version: str) -> None:
    """Have the proxy read the new policy `version` from vLLM (while vLLM is paused): calls
    stamped with the old one would be trained as older than they are, so a failure stops the
    run, and so does a proxy that still reads another version (say, it could not read vLLM's
    models to learn a new LoRA adapter)."""
    try:
        read = await admin.refresh_version()
    except AdminError as exc:
        raise SwapError(f"the proxy did not take the new policy version: {exc}") from exc
    if any(v != version for v in read.values()):
        raise SwapError(f"the proxy did not take policy version {version}: it reads {read}")


def peak_gb() -> float:
    """The most resident memory this process has held so far (Linux counts in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def resident_gb() -> float | None:
    """This process's resident memory (Linux), for the metrics."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class TrainSummary:
    """What `rl-proxy train` reports when it ends: held-out success before and after (None
    without an `eval` section), the loop's state and where the metrics and plot are."""

    before: float | None
    after: float | None
    before_greedy: float | None
    after_greedy: float | None
    seed: int
    seconds: float
    mode: str
    state: LoopState
    metrics: Path
    plot: Path | None = None


@dataclass
class Batch:
    samples: list[Sample]
    rewards: list[float]
    staleness: list[int]


class TrainLoop:
    """Take groups -> step -> swap -> checkpoint, `steps` times; evaluations before, after and
    every `eval.every` steps."""

    def __init__(
        self,
        config: TrainConfig,
        learner: Learner,
        rollouts: Rollouts,
        store: Store,
        vllm_roots: list[str],
        base_weights: Path,
        served_model: str,
        state: LoopState | None = None,
        sync: NcclSync | None = None,
    ) -> None:
        self.config, self.cfg = config, config.train
        self.learner, self.rollouts = learner, rollouts
        self.roots, self.served_model, self.sync = vllm_roots, served_model, sync
        self.out = config.out_dir
        self.state = state or LoopState()
        generation = base_weights / "generation_config.json"  # vLLM's defaults where a request sets none
        defaults = json.loads(generation.read_text()) if generation.exists() else {}
        self.groups = GroupReader(config, store, self.state, rollouts.rule, learner.args.temperature, defaults)
        # The weights vLLM serves: loaded back if a swap fails.
        self.base = base_weights
        self.weights = base_weights if state is None else self.out / "versions" / f"v{self.state.version}"
        self.queue: asyncio.Queue[str] = asyncio.Queue(maxsize=self.cfg.queue_groups)
        self.pending: list[str] = []  # groups finished before a restart, taken first
        self.recorded: list[list[TrainingSequence]] | None = None  # warm_start_from's successful episodes
        self.checkpointed = self.state.step  # the step of the newest checkpoint to resume from
        # auto: async where the learner has a GPU; on CPU the learner and the rollouts share the
        # cores, and generating then training measured faster (docs/training.md).
        self.mode = self.cfg.mode if self.cfg.mode != "auto" else "async" if learner.device.type == "cuda" else "sync"
        self.metrics_file = self.out / "metrics.jsonl"
        self.started = time.monotonic()
        self.writers: list[Any] = []  # each gets every metrics row: TensorBoard, W&B, the display
        self.progress: Callable[[str], None] | None = None  # lines on long work between rows
        # Torch work on one thread of its own: the event loop (rollouts) goes on meanwhile, and
        # one thread keeps the allocator's memory in one place.
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="learner")

    async def in_learner(self, work: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.worker, work, *args)

    async def batch(self, admin: AdminClient, supervised: bool = False) -> Batch:
        """`groups_per_step` usable groups: taken from the queue (async) or generated now (sync).
        For a `supervised` step (the warm start), groups with a success, or as many episodes
        from `warm_start_from`'s successes, in a shuffled round (none of a task held out)."""
        if supervised and self.cfg.warm_start_from:
            if self.recorded is None:  # the task file's tasks outside the training split are never trained on
                trained = {t.id for t in self.rollouts.tasks}
                heldout = {t.id for t in load_tasks(self.config.path(self.config.tasks))} - trained
                async with Store(self.config.path(self.cfg.warm_start_from), readonly=True) as store:
                    rule, at = self.rollouts.rule, self.config.success_at
                    vocab = self.learner.model.config.vocab_size  # its embedding's rows (a tokenizer may have fewer)
                    self.recorded = await successes(store, rule, at, self.cfg.min_calls, heldout, vocab)
                if not self.recorded:
                    raise TrainError(f"warm_start_from: {self.cfg.warm_start_from} holds no successful episode")
                random.Random(self.learner.args.seed).shuffle(self.recorded)
            size = self.cfg.groups_per_step * self.config.episodes_per_task
            start = self.state.step * size
            episodes = [self.recorded[i % len(self.recorded)] for i in range(start, start + size)]
            return Batch([Sample(q, 1.0) for episode in episodes for q in episode], [1.0] * size, [0] * size)
        samples: list[Sample] = []
        rewards: list[float] = []
        staleness: list[int] = []
        groups = 0
        while groups < self.cfg.groups_per_step:
            if self.pending:
                taken = [self.pending.pop(0)]
            elif self.mode == "async":
                taken = [await self.queue.get()]
            else:
                taken = await self.rollouts.groups(admin, self.cfg.groups_per_step - groups)
            for group in taken:
                prepared = await self.groups.prepare(group, supervised)
                if prepared is not None:
                    samples += prepared[0]
                    rewards += prepared[1]
                    staleness += prepared[2]
                    groups += 1
                if self.progress is not None:  # a group of agent episodes takes minutes: a line each
                    used = "trained" if prepared is not None else "nothing to train"
                    self.progress(
                        f"step {self.state.step + 1}: group {group} rewards {self.groups.last_rewards}: {used} "
                        f"({groups}/{self.cfg.groups_per_step} for the step)"
                    )
        if self.learner.args.scale_rewards == "batch" and not supervised:
            std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
            samples = [Sample(s.sequence, s.advantage / (std + 1e-4)) for s in samples]
        return Batch(samples, rewards, staleness)

    # Weights

    async def swap(self, admin: AdminClient) -> float:
        """Save the weights as the next version and swap them into every vLLM; the pause. Every
        `checkpoint_every` steps (and at the last) the version is also a checkpoint to resume
        from: the optimizer state and the loop's state go with it."""
        version = self.state.version + 1
        directory = self.out / "versions" / f"v{version}"
        resumable = (
            self.state.step - self.checkpointed >= self.cfg.checkpoint_every or self.state.step >= self.cfg.steps
        )
        saved = self.sync is None or resumable  # over NCCL, only checkpoints go to disk
        if saved:
            await self.in_learner(self.learner.save, directory, resumable)
        try:
            paused = await self.serve(directory, str(version), admin)
        except SwapError:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        self.state.version = version
        if saved:
            self.weights = directory
        self.state.version_steps[str(version)] = self.state.step
        if resumable:
            if self.rollouts.curriculum is not None:
                self.state.curriculum = self.rollouts.curriculum.saved()
            self.state.save(directory / "state.json")
            self.checkpointed = self.state.step
        kept = {latest_checkpoint(self.out), self.weights}
        if self.learner.lora:  # the adapter before stays loaded in vLLM (calls routed before the swap)
            kept.add(self.out / "versions" / f"v{version - 1}")
        older = sorted(
            (d for d in (self.out / "versions").glob("v*") if d.name[1:].isdigit()), key=lambda d: int(d.name[1:])
        )[: -self.cfg.keep_versions]
        for old in older:
            if old not in kept:
                shutil.rmtree(old, ignore_errors=True)
        return paused

    async def serve(self, directory: Path, version: str, admin: AdminClient) -> float:
        """Have every vLLM serve the weights (or LoRA adapter) in `directory` as `version`; the
        seconds until it does (with full weights, vLLM is paused meanwhile)."""
        announce = functools.partial(refresh_version, admin)
        if self.learner.lora:
            retire = str(int(version) - 2) if int(version) >= 2 else None
            adapter = functools.partial(announce, version)
            return await load_adapter(self.roots, directory, self.served_model, version, adapter, retire)
        previous = self.weights if self.weights != directory else self.base  # loaded back if this fails
        send = self.sync.send if self.sync is not None else None
        return await hot_swap(self.roots, directory, version, previous, announce, send)

    # Evaluation

    async def evaluate(self, eval_runner: EpisodeRunner | None, tasks: list[Task]) -> tuple[float | None, float | None]:
        """Success rate on the evaluation tasks under the weights now serving: as the harness
        samples, `episodes_per_task` times, and greedy (the proxy sets temperature 0, with the
        config's other sampling settings), once."""
        if eval_runner is None or self.config.eval is None:
            return None, None
        greedy = replace(
            eval_runner,
            run=f"{eval_runner.run}-greedy",
            workdir=eval_runner.workdir / "greedy",
            sampling=(eval_runner.sampling or Sampling()).model_copy(update={"temperature": 0.0}),
        )
        limit, at = self.rollouts.limit, self.config.success_at
        counts = {"sampled": len(tasks) * self.config.eval.episodes_per_task, "greedy": len(tasks)}
        wins: dict[str, list[bool]] = {"sampled": [], "greedy": []}
        shown = time.monotonic()

        def done(kind: str) -> Callable[[bool], None]:  # a line every 10 s: evaluations take minutes
            def finished(success: bool) -> None:
                nonlocal shown
                wins[kind].append(success)
                if self.progress is not None and (time.monotonic() - shown > 10 or len(wins[kind]) == counts[kind]):
                    shown = time.monotonic()
                    n, won = len(wins[kind]), sum(wins[kind])
                    self.progress(
                        f"held-out evaluation at step {self.state.step}, {kind}: "
                        f"{n}/{counts[kind]} episodes, {won} succeeded"
                    )

            return finished

        sampled = await success_rate(eval_runner, tasks, self.config.eval.episodes_per_task, limit, at, done("sampled"))
        greedy_success = await success_rate(greedy, tasks, 1, limit, at, done("greedy"))
        self.write(
            {
                "step": self.state.step,
                "version": self.state.version,
                "heldout_success": sampled,
                "heldout_success_greedy": greedy_success,
                "seed": self.learner.args.seed,
            }
        )
        return sampled, greedy_success

    # The loop

    def write(self, row: dict[str, Any]) -> None:
        row = {"time": round(time.monotonic() - self.started, 2), **row}
        with open(self.metrics_file, "a") as out:
            out.write(json.dumps(row) + "\n")
        for writer in self.writers:
            writer(row)

    async def run(self, eval_runner: EpisodeRunner | None, eval_tasks: list[Task]) -> TrainSummary:
        self.out.mkdir(parents=True, exist_ok=True)
        before = await self.evaluate(eval_runner, eval_tasks) if self.state.step == 0 else (None, None)
        await self.groups.save_run()
        async with self.rollouts.runner.admin() as admin:
            self.pending = await self.groups.leftovers()
            producer = None
            if self.mode == "async":
                producer = asyncio.create_task(self.rollouts.fill(admin, self.queue, self.config.concurrency))
            try:
                while self.state.step < self.cfg.steps:
                    await self.step(admin, eval_runner, eval_tasks)
            finally:
                if producer is not None:  # with the rollouts it started (their sessions stay unended)
                    producer.cancel()
                    await asyncio.gather(producer, return_exceptions=True)
        after = await self.evaluate(eval_runner, eval_tasks)
        seconds = time.monotonic() - self.started
        return TrainSummary(
            before[0],
            after[0],
            before[1],
            after[1],
            self.learner.args.seed,
            seconds,
            self.mode,
            self.state,
            self.metrics_file,
        )

    async def step(self, admin: AdminClient, eval_runner: EpisodeRunner | None, eval_tasks: list[Task]) -> None:
        start = time.monotonic()
        supervised = self.state.step < self.cfg.warm_start
        batch = await self.batch(admin, supervised)
        waited = time.monotonic() - start
        metrics = await self.in_learner(self.learner.step, batch.samples, supervised)
        try:  # for the viewer only: a failure to store them must not end the run
            await self.groups.store.save_learner_views(self.config.run, self.state.step + 1, self.learner.views)
        except StoreError as exc:
            log.warning("step %d: what the learner saw was not stored: %s", self.state.step + 1, exc)
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
            "step": self.state.step,
            "version": self.state.version,
            "phase": "sft" if supervised else "grpo",
            "reward": statistics.fmean(batch.rewards),
            "rollout_reward": statistics.fmean(self.rollouts.rewards[-64:]) if self.rollouts.rewards else None,
            "samples": len(batch.samples),
            "tokens": tokens,
            "tokens_per_s": tokens / max(trained, 1e-9),
            "sequence_tokens_per_s": processed / max(trained, 1e-9),
            "staleness_mean": statistics.fmean(batch.staleness),
            "staleness_max": max(batch.staleness),
            "skipped_equal": self.state.skipped_equal,
            "no_success": self.state.no_success,
            "dropped_stale": self.state.dropped_stale,
            "unscored": self.state.unscored,
            "foreign": self.state.foreign,
            "failures_scored": self.state.failures_scored,
            "dropped_infra": self.state.dropped_infra,
            "refused_sampling": self.state.refused_sampling,
            "capture_fatal": self.state.capture_fatal,
            "signal_groups": self.rollouts.signal_groups,  # made by this process, of groups_made
            "groups_made": self.rollouts.groups_made,
            "signal_groups_per_min": self.rollouts.signal_per_minute(),
            "wait_s": waited,
            "train_s": trained,
            "swap_pause_s": paused,
            "queue": self.queue.qsize(),
            "memory_gb": resident_gb(),
            "peak_memory_gb": peak_gb(),
            **{k.replace("/", "_"): v for k, v in metrics.items()},
        }
        self.write(row)
        every = self.config.eval.every if self.config.eval else 0
        if every and self.state.step % every == 0 and self.state.step < self.cfg.steps:
            await self.evaluate(eval_runner, eval_tasks)


def read_metrics(metrics_file: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A run's metrics.jsonl: its step rows and its evaluation rows (a live run's half-written
    last line is left out)."""
    rows = []
    for line in metrics_file.read_text().splitlines():
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    rows = [r for r in rows if isinstance(r, dict) and "step" in r]
    return [r for r in rows if "reward" in r], [r for r in rows if "heldout_success" in r]


def plot(metrics_file: Path, out: Path) -> Path | None:
    """Reward and held-out success against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, evals = read_metrics(metrics_file)
    if not steps and not evals:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in steps], [r["reward"] for r in steps], label="trained groups' reward", alpha=0.5)
    rollouts = [r for r in steps if r.get("rollout_reward") is not None]
    ax.plot([r["step"] for r in rollouts], [r["rollout_reward"] for r in rollouts], label="rollout reward (last 64)")
    ax.plot([r["step"] for r in evals], [r["heldout_success"] for r in evals], "o-", label="held-out success, sampled")
    greedy = [r for r in evals if r.get("heldout_success_greedy") is not None]
    ax.plot([r["step"] for r in greedy], [r["heldout_success_greedy"] for r in greedy], "s--", label="held-out, greedy")
    ax.set_xlabel("step")
    shown = [r["reward"] for r in steps] + [r["rollout_reward"] for r in rollouts]
    ax.set_ylim(min([-0.05, *(v - 0.05 for v in shown)]), max([1.05, *(v + 0.05 for v in shown)]))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
