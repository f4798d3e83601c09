"""`rl-proxy train CONFIG`: everything one command needs. Prepares the model, starts vLLM and the
proxy (or attaches to the config's), loads the policy into TRL, evaluates, trains with a live
display, swaps weights, checkpoints, evaluates again and plots. `--resume` continues from the
newest checkpoint in the run's directory: weights, optimizer, step, version and the groups
already used; groups that finished before the stop and were not trained on come first."""

from __future__ import annotations

import asyncio
import sys
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, closing, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from harness_adapters.collect import proxy_for
from harness_adapters.engines import engine_for
from harness_adapters.rollouts import Curriculum, Rollouts
from harness_adapters.runner import EpisodeRunner
from harness_adapters.tasks import Task, load_tasks
from proxy.model import resolve_model
from proxy.upstream import Upstreams
from recorder.schema import missing
from recorder.store import Store
from trainer.config import TrainConfig
from trainer.groups import LoopState, TrainError, reward_rule
from trainer.grpo import Learner
from trainer.loop import TrainLoop, TrainSummary, latest_checkpoint, plot, refresh_version
from trainer.nccl import NcclSync
from trainer.weight_sync import sampling_mode_problem, set_version


def _writers(config: TrainConfig) -> list[Callable[[dict[str, Any]], None]]:
    """TensorBoard and W&B, when the config asks for them."""
    writers: list[Callable[[dict[str, Any]], None]] = []
    if "tensorboard" in config.train.report_to:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise TrainError("report_to: tensorboard needs `pip install tensorboard`") from exc

        board = SummaryWriter(str(config.out_dir / "tensorboard"))

        def to_board(row: dict[str, Any]) -> None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step":
                    board.add_scalar(key, value, row["step"])
            board.flush()

        writers.append(to_board)
    if "wandb" in config.train.report_to:
        try:
            import wandb
        except ImportError as exc:
            raise TrainError("report_to: wandb needs `pip install wandb`") from exc
        wandb.init(project="rl-proxy", name=config.run, config=config.model_dump(mode="json"))
        writers.append(lambda row: wandb.log(row, step=row["step"]))
    return writers


def _display(total: int) -> tuple[AbstractContextManager[Progress], Callable[[dict[str, Any]], None]]:
    """The step line: a live bar on a terminal (entered as a context), a line a step in a log
    (no live bar there: rich draws it once more as it stops, cut at 80 columns)."""
    columns = (
        TextColumn("step"),
        MofNCompleteColumn(),
        BarColumn(),
        TextColumn("{task.fields[line]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    console = Console()
    bar = Progress(*columns, console=console)
    job = bar.add_task("train", total=total, line="waiting for the first groups")

    def update(row: dict[str, Any]) -> None:
        if "heldout_success" in row:
            bar.console.print(
                f"held-out success at step {row['step']}: {row['heldout_success']:.0%} sampled, "
                f"{row['heldout_success_greedy']:.0%} greedy",
                soft_wrap=True,
            )
            return
        rollouts = "-" if row["rollout_reward"] is None else f"{row['rollout_reward']:.2f}"
        passed = f"; {row['no_success']} groups without a success passed over so far" if row.get("no_success") else ""
        line = (
            (f"supervised (warm start{passed}) " if row.get("phase") == "sft" else "")
            + f"v{row['version']} rollout reward {rollouts} (trained groups {row['reward']:.2f}) "
            f"staleness {row['staleness_mean']:.1f} logprob gap {row.get('logprob_gap', 0.0):.3f} "
            f"{row['sequence_tokens_per_s']:.0f} tok/s "
            f"skipped {row['skipped_equal']} stale {row['dropped_stale']} failed {row['failures_scored']} "
            f"infra {row['dropped_infra']} off-sampling {row['refused_sampling']} "
            f"capture {row.get('capture_fatal', 0)}"
        )
        bar.update(job, completed=row["step"], line=line)
        bar.console.print(
            f"step {row['step']}/{total} {line} (train {row['train_s']:.0f} s, waited {row['wait_s']:.0f} s)",
            highlight=False,
            soft_wrap=True,  # one line in a log, however wide: rich wraps at 80 columns off a terminal
        )

    return (bar if console.is_terminal else nullcontext(bar)), update


def torchrun_command(processes: int, module: str, *args: str) -> list[str]:
    """`python -m module args` on `processes` processes of this machine (one: no launcher)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    return [sys.executable, *(launcher if processes > 1 else []), "-m", module, *args]


def train(config: TrainConfig, resume: bool = False, progress: bool = True) -> TrainSummary | None:
    """Run the whole loop; a summary (held-out success before and after, counts, seconds)."""
    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore", message="TRL currently supports vLLM")  # 0.32 works for what is used
    hf_logging.disable_progress_bar()
    out = config.out_dir
    checkpoint = latest_checkpoint(out)
    if resume and checkpoint is None:
        raise TrainError(f"--resume: no checkpoint in {out / 'versions'}")
    if not resume and checkpoint is not None:
        raise TrainError(f"{out} already holds checkpoints: continue with --resume, or set another 'out'")
    state = LoopState.load(checkpoint / "state.json") if checkpoint else None
    if checkpoint is not None and (config.train.lora is None) == (checkpoint / "adapter_config.json").exists():
        raise TrainError(
            f"{checkpoint} holds {'a LoRA adapter' if config.train.lora is None else 'whole weights'}, "
            f"and the config {'has no' if config.train.lora is None else 'has a'} lora section: "
            "resume with the config the run started with"
        )
    tasks = load_tasks(config.path(config.tasks), None if config.split == "all" else config.split)
    evaluation = config.eval
    eval_tasks = (
        load_tasks(config.path(config.tasks), None if evaluation.split == "all" else evaluation.split)
        if evaluation
        else []
    )
    config.check_tasks(tasks + eval_tasks)
    start_from = config.train.warm_start_from and config.path(config.train.warm_start_from)
    warming = (state.step if state else 0) < config.train.warm_start
    if warming and start_from and missing(start_from):
        raise TrainError(
            f"warm_start_from: no store at {start_from}: record the episodes to start from first "
            "(`rl-proxy collect` with a config whose store it is; docs/training.md#how-a-step-is-made)"
        )
    base = Path(resolve_model(config.proxy.model)[0])
    if not (base / "config.json").exists():
        raise TrainError(
            f"proxy.model: training needs the model as a local directory, and {base} is not one "
            "(download it first: `hf download NAME --local-dir DIR`)"
        )
    out.mkdir(parents=True, exist_ok=True)
    learner = Learner(
        str(checkpoint or base),
        out / "trl",
        config.train.grpo,
        config.train.steps,
        config.train.micro_batch,
        reference=str(base),
        lora=config.train.lora,
        weights_dtype=config.train.weights_dtype,
        sharding=config.train.sharding,
        serve_dtype=config.train.serve_dtype,
    )
    if checkpoint is not None:
        learner.resume(checkpoint)
    # With several processes the others only step, on their shards of rank 0's batches.
    return learner.lead(lambda: _lead(config, learner, checkpoint, state, base, tasks, eval_tasks, progress))


def _lead(
    config: TrainConfig,
    learner: Learner,
    checkpoint: Path | None,
    state: LoopState | None,
    base: Path,
    tasks: list[Task],
    eval_tasks: list[Task],
    progress: bool,
) -> TrainSummary:
    """Rank 0's part: the proxy and vLLM, the rollouts, the loop, the swaps and every file."""
    out, evaluation = config.out_dir, config.eval
    adapter, rewards, environment = config.adapter(), config.reward_sources(), config.resolved_environment()
    with (
        proxy_for(config) as (url, model, db, upstream),
        closing(environment),
        engine_for(config.rollouts, environment) as engine,
    ):
        if db is None or upstream is None:
            raise TrainError("training needs the proxy's store and its vLLM upstream")
        replicas = Upstreams.urls(upstream)  # every one is swapped
        roots = [u.removesuffix("/v1") for u in replicas]
        names = set()  # the name the trained model is served under (LoRA adapters are named after it)
        for replica in replicas:
            problem = sampling_mode_problem(replica.removesuffix("/v1"))
            if problem is not None:
                raise TrainError(problem)
            served = httpx.get(f"{replica}/models", timeout=30).json()["data"]
            here = {m["id"] for m in served if Path(m.get("root") or "") == base and not m.get("parent")}
            names |= here
            if not here:
                raise TrainError(
                    f"vLLM at {replica} serves {[m.get('root') for m in served]}, not the model "
                    f"being trained ({base}): its weights could not be swapped in"
                )

        sync = None
        if config.train.weight_sync == "nccl":
            sync = NcclSync(roots, learner.trl.accelerator.unwrap_model(learner.model))

        async def main() -> TrainSummary:
            async with Store(db) as store:
                token = config.proxy.admin_token

                def runner_for(run: str, workdir: Path) -> EpisodeRunner:
                    return EpisodeRunner(
                        url, adapter, rewards, model, workdir, run, config.timeout, config.concurrency, token,
                        sampling=config.sampling, environment=environment, engine=engine,
                        attempts=config.rollouts.attempts,
                    )  # fmt: skip

                runner = runner_for(config.run, out / "episodes")
                eval_runner = runner_for(f"{config.run}-eval", out / "eval") if evaluation else None
                rule = reward_rule(config.train, learner.args.scale_rewards)
                limit = asyncio.Semaphore(config.concurrency)
                curriculum = None
                if config.train.curriculum:
                    curriculum = Curriculum(config.episodes_per_task, config.success_at)
                    curriculum.restore(state.curriculum if state is not None else {})
                rollouts = Rollouts(runner, tasks, config.episodes_per_task, limit, rule, curriculum)
                loop = TrainLoop(config, learner, rollouts, store, roots, base, min(names), state, sync)
                loop.writers = _writers(config)
                if engine is not None:  # after each row: the episodes running per Ray node, and queued
                    loop.writers.append(lambda _: loop.progress and loop.progress(f"episodes {engine.describe()}"))
                async with runner.admin() as admin:
                    if checkpoint is not None:  # vLLM serves the checkpoint's weights under its version
                        await loop.serve(checkpoint, str(loop.state.version), admin)
                    else:
                        for root in roots:
                            await set_version(root, "0")
                        await refresh_version(admin, "0")
                if not progress:
                    return await loop.run(eval_runner, eval_tasks)
                shown, update = _display(config.train.steps)
                loop.writers.append(update)
                with shown as bar:
                    loop.progress = lambda line: bar.console.print(line, highlight=False, soft_wrap=True)
                    return await loop.run(eval_runner, eval_tasks)

        summary = asyncio.run(main())
    drawn = plot(summary.metrics, out / "training.png") if summary.metrics.exists() else None
    return replace(summary, plot=drawn)
