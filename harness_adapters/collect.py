"""`rl-proxy collect`: run a config's episodes through a proxy (started here, in front of a
vLLM launched here or of any upstream, or one already running) without training."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from harness_adapters.config import CollectConfig
from harness_adapters.engines import engine_for
from harness_adapters.runner import EpisodeResult, EpisodeRunner, write_results
from harness_adapters.tasks import load_tasks
from proxy.app import create_app
from proxy.server import AppThread, backend_for

POLICY = "policy"  # the model name harnesses get when the served one is not known: the proxy maps it


@contextmanager
def proxy_for(config: CollectConfig) -> Iterator[tuple[str, str, str | None, str | None]]:
    """(proxy URL, model name for harnesses, store URL, upstream base URL); the last two are
    the config's own when the proxy is someone else's."""
    given = config.proxy
    if given.url:
        yield given.url.rstrip("/"), POLICY, given.db if "db" in given.model_fields_set else None, given.upstream
        return
    settings = given.settings(config.out_dir)
    with backend_for(settings) as (settings, _), AppThread(create_app(settings)) as proxy:
        yield proxy.url, settings.served_model_name or POLICY, settings.db, settings.upstream


def collect(config: CollectConfig, progress: bool = True) -> tuple[list[EpisodeResult], Path, str | None]:
    """Run every episode; (results, the results file, the store)."""
    tasks = load_tasks(config.path(config.tasks), None if config.split == "all" else config.split)
    config.check_tasks(tasks)
    adapter, rewards, environment = config.adapter(), config.reward_sources(), config.resolved_environment()
    out = config.out_dir
    total = len(tasks) * config.episodes_per_task
    columns = (
        TextColumn("episodes"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with (
        proxy_for(config) as (url, model, db, _),
        closing(environment),  # a run cut short (SIGTERM, Ctrl-C): no container of its stays behind
        engine_for(config.rollouts, environment) as engine,
        Progress(*columns, disable=not progress) as bar,
    ):
        runner = EpisodeRunner(
            url,
            adapter,
            rewards,
            model,
            out / "episodes",
            config.run,
            config.timeout,
            config.concurrency,
            config.proxy.admin_token,
            sampling=config.sampling,
            environment=environment,
            engine=engine,
            attempts=config.rollouts.attempts,
        )
        job = bar.add_task("episodes", total=total, rate="")
        finished: list[EpisodeResult] = []
        said = time.monotonic()

        def done(result: EpisodeResult) -> None:
            nonlocal said
            finished.append(result)
            wins = sum(r.success(config.success_at) for r in finished)
            bar.update(job, advance=1, rate=f"success {wins}/{len(finished)}")
            # Off a terminal (a log) the bar shows only at the end: a line every 10 s instead.
            if progress and not bar.console.is_terminal and (time.monotonic() - said > 10 or len(finished) == total):
                said = time.monotonic()
                elapsed = bar.tasks[job].elapsed or 0.0
                placed = f"; {engine.describe()}" if engine else ""  # per Ray node
                line = f"episodes {len(finished)}/{total}, success {wins}/{len(finished)} ({elapsed / 60:.1f} min)"
                bar.console.print(line + placed, highlight=False)

        results = asyncio.run(runner.run_all(tasks, config.episodes_per_task, done))
    path = out / "episodes.jsonl"
    write_results(results, path)
    return results, path, db
