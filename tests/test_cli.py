"""The command line: every command documents itself; sessions and export on a real store."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sqlite3
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

import recorder.cli
from benchmarks.support.samples import call
from recorder import SessionInfo, Store
from trainer.cli import app

runner = CliRunner()
COMMANDS = [
    [],
    ["serve"],
    ["demo"],
    ["model"],
    ["model", "prepare"],
    ["sessions"],
    ["sessions", "list"],
    ["sessions", "show"],
    ["export"],
    ["report"],
    ["doctor"],
    ["collect"],
    ["train"],
    ["ui"],
]


def test_the_console_script_gathers_every_packages_commands() -> None:
    """The installed `rl-proxy` script (beside this interpreter, not `python -m`)."""
    script = Path(sysconfig.get_path("scripts")) / "rl-proxy"
    done = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Usage: rl-proxy" in done.stdout
    assert [c for c in {c[0] for c in COMMANDS[1:]} if not re.search(rf"\b{c}\b", done.stdout)] == []


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "rl-proxy")
def test_every_command_has_help(command: list[str]) -> None:
    """In this process: a subprocess each took 2 s, for what the script's test above shows once."""
    done = runner.invoke(app, [*command, "--help"], prog_name="rl-proxy")
    assert done.exit_code == 0, done.output
    assert "Usage: rl-proxy" in done.output and len(done.output.splitlines()) > 5


@pytest.fixture
def db(tmp_path: Path) -> str:
    path = str(tmp_path / "cli.db")

    async def fill() -> None:
        async with Store(path) as store:
            await store.resolve_session(SessionInfo(id="ep-1", key="k1", run="exp"))
            await store.resolve_session(SessionInfo(id="ep-empty", key="k2", run="exp"))
            for seq in (1, 2):
                await store.record(call("ep-1", seq, [seq, 7, 2]))
            await store.add_reward("ep-1", 1.0, "verifier")

    asyncio.run(fill())
    return path


def test_sessions_list_and_show(db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    listed = runner.invoke(app, ["sessions", "list", "--db", db])
    assert listed.exit_code == 0 and "ep-1" in listed.output
    assert "1 session(s) have no calls" in listed.output and "ep-empty" in listed.output
    # A wide terminal: the console took its width from COLUMNS when imported (pytest-xdist sets 80).
    monkeypatch.setattr(recorder.cli.console, "width", 200)
    shown = runner.invoke(app, ["sessions", "show", "ep-1", "--db", db])
    assert shown.exit_code == 0
    assert "chat.completions" in shown.output and "stop" in shown.output
    # call 2's prompt [1, 2, 3, 2] does not extend call 1's [1, 2, 3, 1] + [1, 7, 2]
    assert "2 calls -> 2 sequence(s)" in shown.output
    assert "call 2 starts a new chain: prefix diverges at token 3" in shown.output
    missing = runner.invoke(app, ["sessions", "show", "nope", "--db", db])
    assert missing.exit_code == 1 and "no session" in missing.output


def test_export_jsonl_and_refuses_to_overwrite(db: str, tmp_path: Path) -> None:
    out = tmp_path / "calls.jsonl"
    first = runner.invoke(app, ["export", "--db", db, "--format", "jsonl", "--out", str(out)])
    assert first.exit_code == 0 and "wrote 2 calls rows" in first.output
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [(r["session_id"], r["seq"], r["completion_token_ids"]) for r in rows] == [
        ("ep-1", 1, [1, 7, 2]),
        ("ep-1", 2, [2, 7, 2]),
    ]
    again = runner.invoke(app, ["export", "--db", db, "--out", str(out)])
    assert again.exit_code != 0 and "--force" in again.output
    assert runner.invoke(app, ["export", "--db", db, "--out", str(out), "--force"]).exit_code == 0
    assert runner.invoke(app, ["export", "--db", db, "--out", str(out), "--format", "xml", "--force"]).exit_code != 0


def test_export_force_replaces_only_an_export(db: str, tmp_path: Path) -> None:
    """--force replaces an export it wrote (a file, a saved dataset), never another directory."""
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    for fmt in ("jsonl", "hf"):
        refused = runner.invoke(app, ["export", "--db", db, "--out", str(precious), "--format", fmt, "--force"])
        assert refused.exit_code != 0 and "no export wrote" in refused.output
    assert (precious / "notes.txt").read_text() == "mine"
    dataset = tmp_path / "ds"
    for _ in range(2):
        done = runner.invoke(app, ["export", "--db", db, "--out", str(dataset), "--format", "hf", "--force"])
        assert done.exit_code == 0, done.output
    assert (dataset / "state.json").exists()


def test_serve_refuses_open_admin_off_loopback() -> None:
    given = ["--upstream", "http://127.0.0.1:1/v1", "--host", "0.0.0.0", "--messages-mode"]
    result = runner.invoke(app, ["serve", *given])
    assert result.exit_code != 0 and "admin-token" in result.output and "No such option" not in result.output


def test_ui_refuses_a_missing_store_and_an_open_viewer_off_loopback(db: str, tmp_path: Path) -> None:
    missing = runner.invoke(app, ["ui", "--db", str(tmp_path / "nothing.db")])
    assert missing.exit_code == 2 and "no store at" in missing.output
    assert not (tmp_path / "nothing.db").exists()
    open_off_loopback = runner.invoke(app, ["ui", "--db", db, "--host", "0.0.0.0"])
    assert open_off_loopback.exit_code == 2 and "--admin-token" in open_off_loopback.output
    with sqlite3.connect(db) as conn:  # a store of the previous schema: read-only, it is not migrated
        conn.execute("update schema_version set version = 6")
    older = runner.invoke(app, ["ui", "--db", db])
    assert older.exit_code == 2 and "schema version 6" in older.output
    with sqlite3.connect(db) as conn:
        assert conn.execute("select version from schema_version").fetchall() == [(6,)]


def test_report_summarises_a_run(db: str) -> None:
    result = runner.invoke(app, ["report", "--db", db, "--run", "exp"])
    assert result.exit_code == 0, result.output
    assert "sessions 2 (1 without calls), calls 2, sequences 2" in result.output
    assert "breaks: prefix diverges: 1" in result.output
    assert "mean reward: 1.000" in result.output and "ep-empty" in result.output
    assert "calls by edge: continue 0, fork 0, retry 0, subagent 0, compaction 0, new 2, aux 0" in result.output
    assert "delivered_fraction 1.0000" in result.output
    assert "capture grades: FATAL 1, WARN 0, INFO 1, OK 0" in result.output  # no call; a sequence started anew


def test_export_rl_parquet(db: str, tmp_path: Path) -> None:
    out = tmp_path / "rl.parquet"
    result = runner.invoke(app, ["export", "--db", db, "--kind", "rl", "--format", "parquet", "--out", str(out)])
    assert result.exit_code == 0 and "wrote 2 rl rows" in result.output
    assert runner.invoke(app, ["export", "--db", db, "--kind", "nope", "--out", str(tmp_path / "x")]).exit_code != 0


def test_doctor_on_the_default_model() -> None:
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    assert "drops tool calls" in result.output and "token-in" in result.output
    assert runner.invoke(app, ["doctor", "--model", "/no/such/model"]).exit_code == 1


def test_train_on_several_processes_hands_resume_to_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """`train --processes 2 --resume` starts torchrun with `--resume` for every rank: the one place
    the flag crosses a process (the resumed run itself: tests/trainer/test_train_vllm.py, and an
    FSDP2 learner resumed on two processes: tests/trainer/test_distributed.py)."""
    import trainer.cli

    launched: list[list[str]] = []
    monkeypatch.setattr(subprocess, "call", lambda command: launched.append(command) or 0)
    monkeypatch.setattr(trainer.cli, "stop_on_sigterm", lambda: None)  # this worker's SIGTERM stays its own
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = Path(__file__).parents[1] / "harness_adapters" / "examples" / "arithmetic" / "train.yaml"
    result = runner.invoke(app, ["train", str(config), "--processes", "2", "--resume"])
    assert result.exit_code == 0, result.output
    [command] = launched
    assert command[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    assert command[-4:] == ["trainer.cli", "train", str(config), "--resume"]


SWALLOWER = """
import asyncio, os, signal, sys
from proxy.server import stop_on_sigterm

async def lifespan():  # as uvicorn's lifespan: every exception of the app's is its own to log
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(10**6))  # the signal lands here, between two bytecodes
        await asyncio.sleep(5)
    except BaseException as exc:
        print("taken:", type(exc).__name__, flush=True)

async def main():
    started = asyncio.create_task(lifespan())  # the gateway's server: a task of its own
    await asyncio.sleep(1)
    print("went on", flush=True)

if sys.argv[1] == "ignored":  # as in a job started with `&` in a script
    signal.signal(signal.SIGINT, signal.SIG_IGN)
stop_on_sigterm()
try:
    asyncio.run(main())
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_sigterm_cancels_the_run_and_is_not_lost_in_code_that_takes_every_exception(sigint: str) -> None:
    """Seen in `train`'s SIGTERM test (issue 46): SIGTERM was a KeyboardInterrupt raised inside
    whatever ran; it landed in uvicorn's lifespan (an episode's gateway), which took it as the
    app's failure and exited the run with 3, before asyncio.run had joined the threads starting
    containers. Now SIGTERM is Ctrl-C: asyncio.run cancels its main task, then raises
    KeyboardInterrupt; also in a job started with SIGINT ignored (`cmd &` in a script)."""
    job = subprocess.run([sys.executable, "-c", SWALLOWER, sigint], capture_output=True, text=True, timeout=60)
    assert (job.returncode, job.stdout) == (130, "taken: CancelledError\n"), job.stderr


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_stops_the_vllm_and_the_episodes_a_command_started(tmp_path: Path) -> None:
    """A supervisor (systemd, Kubernetes, a job scheduler) stops a job with SIGTERM. `collect`,
    `train`, `serve` and `demo` all take it as Ctrl-C (proxy.server.stop_on_sigterm); here
    `collect`, with its own vLLM and two harness episodes running. Before, the command died at
    once and left its vLLM running as an orphan, with its memory and its port."""
    import psutil

    (tmp_path / "tasks.jsonl").write_text('{"id": "a", "prompt": "p"}\n{"id": "b", "prompt": "q"}\n')
    hang = [sys.executable, "-c", "import time; time.sleep(600)"]  # an episode that runs until stopped
    config = {
        "run": "sigterm",
        "tasks": "tasks.jsonl",
        "timeout": 600,
        "out": str(tmp_path / "out"),
        "harness": {"type": "command", "argv": hang},
        "proxy": {"max_model_len": 2048, "vllm_args": ["--enforce-eager"], "log_dir": str(tmp_path / "logs")},
    }
    (tmp_path / "collect.yaml").write_text(orjson.dumps(config).decode())  # JSON is YAML
    command = [sys.executable, "-m", "trainer.cli", "collect", str(tmp_path / "collect.yaml")]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started: list[psutil.Process] = []

    def command_line(process: psutil.Process) -> str:
        with contextlib.suppress(psutil.Error):  # gone since listed, or a zombie (vLLM's start makes short-lived ones)
            return " ".join(process.cmdline())
        return ""

    deadline = time.monotonic() + 480
    while sum("time.sleep(600)" in command_line(p) for p in started) < 2:  # vLLM up, episodes on
        assert job.poll() is None and time.monotonic() < deadline, job.stdout.read() if job.stdout else ""
        time.sleep(1)
        with contextlib.suppress(psutil.NoSuchProcess):
            started = psutil.Process(job.pid).children(recursive=True)
    assert any("vllm" in command_line(p) for p in started)
    job.send_signal(signal.SIGTERM)
    output, _ = job.communicate(timeout=120)
    assert job.returncode == 130, output[-2000:]
    assert "stopped" in output
    # vLLM's multiprocessing resource tracker ends by itself once the processes it served are
    # gone: on a busy machine, seconds after them (it was still there when looked at at once).
    deadline = time.monotonic() + 30
    while (left := [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.5)
    assert left == [], [command_line(p)[:120] for p in left]
