"""The proxy's commands: `serve` (the recording proxy, in front of an upstream or of a vLLM it
launches) and `demo` (the main job on the embedded default). `python -m proxy.cli serve` runs
without the rest of the `rl-proxy` command."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console

from proxy.settings import LOOPBACK, Settings
from proxy.vllm import BackendError
from recorder.cli import DbOption

app = typer.Typer(help="Run the recording proxy.")
console = Console()


def _settings(**given: Any) -> Settings:
    try:
        return Settings(**{k: v for k, v in given.items() if v is not None})
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


def _about(name: str) -> str:
    """A serve option's help: the setting's own description, documented once in Settings."""
    return f"{Settings.model_fields[name].description} [RLP_{name.upper()}]"


@app.command()
def serve(
    upstream: Annotated[str | None, typer.Option(help=_about("upstream"))] = None,
    model: Annotated[str | None, typer.Option(help=_about("model"))] = None,
    db: DbOption = None,
    host: Annotated[str | None, typer.Option(help=_about("host"))] = None,
    port: Annotated[int | None, typer.Option(help=_about("port"))] = None,
    workers: Annotated[int | None, typer.Option(help=_about("workers"))] = None,
    admin_token: Annotated[str | None, typer.Option(help=_about("admin_token"))] = None,
    max_model_len: Annotated[int | None, typer.Option(help=_about("max_model_len"))] = None,
    reject_unknown_sessions: Annotated[bool, typer.Option(help="refuse keys not created through /admin")] = False,
    messages_mode: Annotated[bool, typer.Option(help=_about("messages_mode"))] = False,
) -> None:
    """Run the recording proxy, in front of an upstream or of a vLLM it launches and supervises."""
    if upstream and model:
        raise typer.BadParameter("give --upstream or --model, not both")
    settings = _settings(
        upstream=upstream,
        model=model,
        db=db,
        host=host,
        port=port,
        workers=workers,
        admin_token=admin_token,
        max_model_len=max_model_len,
        create_sessions=False if reject_unknown_sessions else None,
        messages_mode=messages_mode or None,
    )
    if settings.host not in LOOPBACK and not settings.admin_token:
        raise typer.BadParameter("binding off loopback needs --admin-token (or RLP_ADMIN_TOKEN)")
    from proxy.server import log_setup, run, stop_on_sigterm

    stop_on_sigterm()
    log_setup()
    try:
        raise typer.Exit(run(settings))
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM, once uvicorn has answered the calls in flight
        raise typer.Exit(0) from exc
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
    from proxy.server import log_setup, stop_on_sigterm

    stop_on_sigterm()
    log_setup()
    raise typer.Exit(run_demo(_settings(db=db, model=model)))


if __name__ == "__main__":
    app()
