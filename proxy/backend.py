"""Launching and supervising a local vLLM server as a child process.

The proxy talks to it over HTTP like any upstream; this module only owns its process: the
command line (tools enabled, context length), a health-checked start with a log file, a clear
error when it dies or does not come up in time, and a clean shutdown of its process group.
vLLM's development routes (pause, reload, RPC) are enabled for weight hot-swap, so the server
binds to 127.0.0.1 only and the proxy never forwards those routes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


class BackendError(RuntimeError):
    """The vLLM server did not start, or died."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


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
    ) -> None:
        self.model = model
        self.served_name = served_name
        self.port = port or free_port()
        self.log_file = log_file
        self.command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model,
            "--served-model-name", served_name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--max-model-len", str(max_model_len),
            "--enable-auto-tool-choice",
            "--tool-call-parser", tool_call_parser,
            # Logprobs of the distribution tokens were sampled from (after temperature, top-p):
            # the behaviour policy that GRPO's importance ratios need.
            "--logprobs-mode", "processed_logprobs",
            *(extra_args or []),
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

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
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
            "VLLM_SERVER_DEV_MODE": "1",
        }
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.wait_ready(timeout, progress)

    def wait_ready(self, timeout: float, progress: bool = False) -> None:
        start = time.monotonic()
        while True:
            self.check_alive()
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).is_success:
                    if progress:
                        print(f"\rvLLM ready after {time.monotonic() - start:.0f} s".ljust(60))
                    return
            except httpx.HTTPError:
                pass
            waited = time.monotonic() - start
            if waited > timeout:
                self.stop()
                raise BackendError(
                    f"vLLM did not start within {timeout:.0f} s (log: {self.log_file}):\n{_tail(self.log_file)}"
                )
            if progress:
                print(f"\rstarting vLLM ({self.served_name}): {waited:.0f} s", end="", flush=True)
            time.sleep(1.0)

    def check_alive(self) -> None:
        """BackendError with the end of the log if the server process has exited."""
        if self.process is not None and self.process.poll() is not None:
            code = self.process.returncode
            raise BackendError(f"vLLM exited with code {code} (log: {self.log_file}):\n{_tail(self.log_file)}")

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after `grace` seconds."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass
