"""The proxy's commands: `serve` (the recording proxy, in front of an upstream or of a vLLM it
launches) and `demo` (the main job on the embedded default). `python -m proxy.cli serve` runs
without the rest of the `rl-proxy` command."""

from __future__ import annotations

import logging
import sys
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


def _log_setup() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)


if __name__ == "__main__":
    app()
