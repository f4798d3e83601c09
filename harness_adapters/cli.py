"""The harness adapters' commands: `collect` runs a config's episodes through the proxy
without training and prints success per task; `tasks check` runs a Harbor dataset's oracles
against doing nothing; `tasks base-image` builds the base image from Debian's packages."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from harness_adapters.collect import collect as run_collect
from harness_adapters.config import CollectConfig, ConfigError, load_config
from harness_adapters.environments import BASE_IMAGE, ContainerEnvironment, ContainerError, base_image
from harness_adapters.environments.oracle import CheckResult, check_tasks
from harness_adapters.runner import summary
from harness_adapters.tasks import TaskError, is_harbor, read_harbor
from proxy.server import stop_on_sigterm
from recorder import Store
from recorder.validation import grade_counts, grade_line

app = typer.Typer(help="Run harness episodes through the proxy.")
tasks_app = typer.Typer(help="Harbor task folders: check them, and build the base image they start from.")
app.add_typer(tasks_app, name="tasks")
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
    except (ConfigError, TaskError, ContainerError) as exc:
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
        "infra",
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
            str(row.infra),
        )
    wins = sum(row.success for row in rows)
    table.add_row("all", str(len(results)), f"{wins} ({wins / max(len(results), 1):.0%})", "", "", "", "", "")
    console.print(table)
    if db:
        console.print(grade_line(asyncio.run(_grades(db, [r.session_id for r in results]))), highlight=False)
    for r in results:
        if r.status in ("no_calls", "ended"):
            console.print(f"[yellow]{r.session_id}[/yellow] (task {r.task.id}): {r.error}", highlight=False)
    console.print(f"episodes: {path}" + (f"\nstore: {db}  (rl-proxy export --db {db} ...)" if db else ""))


@tasks_app.command("check")
def tasks_check(
    folder: Annotated[Path, typer.Argument(help="a folder of Harbor tasks (or one task folder)")],
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per task on stdout")] = False,
    concurrency: Annotated[int, typer.Option(min=1, help="tasks checked at once")] = 2,
    logs: Annotated[Path, typer.Option(help="the oracle's and the tests' logs, per task")] = Path("runs/tasks-check"),
) -> None:
    """For each task: build its image, run its oracle (solution/solve.sh, then the tests: the reward
    must be 1) and nothing (the tests alone: the reward must be 0). A malformed task is a row that
    is not ok, with what is wrong. Exits 1 when a task is not ok."""
    stop_on_sigterm()
    try:
        if not is_harbor(folder):
            raise TaskError(f"{folder}: not a Harbor task folder (no task.toml in it or its folders)")
        tasks, malformed = read_harbor(folder)  # a malformed task is a row that is not ok
        results = asyncio.run(check_tasks(ContainerEnvironment(), tasks, logs, concurrency)) if tasks else []
        results += [CheckResult(name, error=f"malformed: {error}") for name, error in malformed.items()]
        results.sort(key=lambda r: r.task)
    except (TaskError, ContainerError) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from exc
    except KeyboardInterrupt as exc:  # the containers it started are removed on the way out
        raise typer.Exit(130) from exc
    if as_json:
        for result in results:
            print(json.dumps(result.as_json()))
    else:
        table = Table("task", "oracle", "nothing", "ok", "error", title=f"{folder}: {len(results)} tasks")
        for r in results:
            table.add_row(
                r.task, str(r.oracle_reward), str(r.noop_reward), "yes" if r.ok else "[red]no[/red]", r.error or ""
            )
        console.print(table)
    if not all(r.ok for r in results):
        raise typer.Exit(1)


@tasks_app.command("base-image")
def tasks_base_image(
    name: Annotated[str, typer.Option(help="the image's name")] = BASE_IMAGE,
    suite: Annotated[str, typer.Option(help="the Debian release")] = "bookworm",
    mirror: Annotated[str, typer.Option(help="the Debian mirror")] = "http://deb.debian.org/debian",
) -> None:
    """Build the tasks' base image (bash, python3, git) from Debian's packages with debootstrap,
    into the container engine at DOCKER_HOST, with no registry. Needs root."""
    try:
        base_image(name, suite, mirror)
    except ContainerError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from exc


async def _grades(db: str, sessions: list[str]) -> Counter[str]:
    async with Store(db, readonly=True) as store:
        return await grade_counts(store, sessions)


if __name__ == "__main__":
    app()
