"""The harness adapters' command: `collect` runs a config's episodes through the proxy
without training and prints success per task."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from harness_adapters.collect import collect as run_collect
from harness_adapters.config import CollectConfig, ConfigError, load_config
from harness_adapters.runner import summary
from harness_adapters.tasks import TaskError
from proxy.server import stop_on_sigterm
from recorder import Store
from recorder.validation import grade_counts, grade_line

app = typer.Typer(help="Run harness episodes through the proxy.")
console = Console()


@app.command()
def collect(
    config: Annotated[Path, typer.Argument(help="the run's YAML config (see harness_adapters/config.py)")],
    upstream: Annotated[str | None, typer.Option(help="attach to this upstream instead of the config's")] = None,
) -> None:
    """Run a config's harness episodes through the proxy without training; print success per task."""
    stop_on_sigterm()
    try:
        loaded = load_config(config, CollectConfig)
        if upstream:
            loaded.proxy.upstream = upstream
        results, path, db = run_collect(loaded)
    except (ConfigError, TaskError) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from exc
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: vLLM, the proxy and the episodes are stopped
        console.print("stopped: the episodes that ended are in the store; the others were stopped unended")
        raise typer.Exit(130) from exc
    table = Table(
        "task",
        "episodes",
        "success",
        "mean reward",
        "failed",
        "timeout",
        "no calls",
        title=f"run {loaded.run}: success = reward >= {loaded.success_at:g}",
    )
    rows = summary(results, loaded.success_at)
    for row in rows:
        mean = "-" if row.mean_reward is None else f"{row.mean_reward:.2f}"
        table.add_row(
            row.task,
            str(row.episodes),
            str(row.success),
            mean,
            str(row.failed),
            str(row.timeout),
            str(row.no_calls),
        )
    wins = sum(row.success for row in rows)
    table.add_row("all", str(len(results)), f"{wins} ({wins / max(len(results), 1):.0%})", "", "", "", "")
    console.print(table)
    if db:
        console.print(grade_line(asyncio.run(_grades(db, [r.session_id for r in results]))), highlight=False)
    for r in results:
        if r.status == "no_calls":
            console.print(f"[yellow]{r.session_id}[/yellow] (task {r.task.id}): {r.error}", highlight=False)
    console.print(f"episodes: {path}" + (f"\nstore: {db}  (rl-proxy export --db {db} ...)" if db else ""))


async def _grades(db: str, sessions: list[str]) -> Counter[str]:
    async with Store(db, readonly=True) as store:
        return await grade_counts(store, sessions)


if __name__ == "__main__":
    app()
