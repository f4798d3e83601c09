"""The recorder's commands: `sessions list|show`, `report` and `export`. They read the store
only, and work on a database copied off the machine the proxy ran on."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from recorder import SessionInfo, Store
from recorder.graph import build, delivery, edge_counts
from recorder.paths import default_db, default_model_dir
from recorder.report import session_lines, summarise
from recorder.validation import check

app = typer.Typer(help="Inspect and export recorded sessions.")
sessions_app = typer.Typer(help="Inspect recorded sessions.")
app.add_typer(sessions_app, name="sessions")
console = Console()

DbOption = Annotated[str | None, typer.Option("--db", help="SQLAlchemy URL or SQLite file [default: per-user store]")]


def _with_store(db: str | None, work: Any) -> Any:
    async def main() -> Any:
        async with Store(db or default_db()) as store:
            return await work(store)

    return asyncio.run(main())


def _session_table(sessions: list[SessionInfo]) -> Table:
    table = Table("id", "run", "task", "group", "status", "calls", "reward", "created")
    for s in sessions:
        table.add_row(
            s.id,
            s.run or "",
            s.task_id or "",
            s.group_id or "",
            s.status,
            str(s.calls),
            "" if s.reward is None else f"{s.reward:g}",
            s.created_at.isoformat(timespec="seconds") if s.created_at else "",
        )
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
    if info.outcome:
        console.print(f"outcome: {info.outcome.model_dump(exclude_defaults=True)}", highlight=False)
    if info.sampling:
        console.print(f"sampling forced: {info.sampling.model_dump(exclude_none=True)}", highlight=False)
    if info.metadata:
        console.print(f"metadata: {info.metadata}")
    table = Table("seq", "api", "stream", "status", "prompt tok", "completion tok", "finish", "ms", "version")
    for c in calls:
        first = c.completions[0] if c.completions else None
        table.add_row(
            str(c.seq),
            c.api,
            "yes" if c.stream else "",
            "ok" if c.ok else f"failed {c.http_status}",
            str(len(c.prompt_token_ids)),
            str(sum(len(x.token_ids) for x in c.completions)),
            (first.finish_reason or "") if first else "",
            f"{c.latency_ms:.0f}",
            c.policy_version or "",
        )
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
    report = replace(build(calls, info).trained, calls=len(calls))  # the sequences the trainer takes
    decode = _decoder(tokenizer) if report.breaks else None
    console.print("\n".join(session_lines(report, decode)), markup=False, highlight=False)


@app.command()
def report(db: DbOption = None, run: Annotated[str | None, typer.Option(help="only this run")] = None) -> None:
    """Summarise a run: sessions, calls, training sequences, merge breaks by reason, rewards."""

    async def work(store: Store) -> Any:
        sessions = await store.list_sessions(run=run)
        reports, edges, grades = [], Counter[str](), Counter[str]()
        reached = sampled = chain = 0
        for s in sessions:
            calls = [c async for c in store.iter_calls(s.id)]
            checked = check(calls, s)
            reports.append(replace(checked.graph.trained, calls=len(calls)))
            edges.update(edge_counts(checked.placements))
            got, meant, longest = delivery(calls, checked.graph)
            reached, sampled, chain = reached + got, sampled + meant, chain + longest
            grades[checked.grade.level] += 1
        return summarise(reports, {s.id: s.reward for s in sessions}, edges, (reached, sampled, chain), grades)

    console.print("\n".join(_with_store(db, work).lines()), markup=False, highlight=False, soft_wrap=True)


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
    force: Annotated[bool, typer.Option(help="replace an existing export")] = False,
) -> None:
    """Export recorded data: raw calls, RL training sequences or SFT conversations."""
    from recorder.export import FORMATS, KINDS, Filter, is_dataset_dir
    from recorder.export import export as run_export

    if kind not in KINDS:
        raise typer.BadParameter(f"--kind must be one of {', '.join(KINDS)}, not {kind!r}")
    if fmt not in FORMATS:
        raise typer.BadParameter(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if out.exists() and not force:
        raise typer.BadParameter(f"{out} exists; add --force to overwrite")
    if out.is_dir() and not is_dataset_dir(out):
        raise typer.BadParameter(f"{out} is a directory that no export wrote; --force replaces only exports")
    where = Filter(run=run, task_id=task, since=since, until=until, min_reward=min_reward, api=api)

    async def work(store: Store) -> int:
        columns = (TextColumn("export sessions"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
            task_id = progress.add_task("sessions", total=None)
            return await run_export(
                store,
                out,
                kind=kind,
                fmt=fmt,
                where=where,
                merge=merge,
                on_session=lambda total: progress.update(task_id, total=total, advance=1),
            )

    count = _with_store(db, work)
    console.print(f"wrote {count} {kind} rows to {out}")


if __name__ == "__main__":
    app()
