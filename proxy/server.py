"""Running the proxy: in the foreground with a supervised vLLM (`rl-proxy serve`), or in a
background thread (the demo and the tests)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import orjson
import uvicorn
from fastapi import FastAPI
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess
from uvicorn.supervisors.multiprocess import SIGNALS
from uvloop import new_event_loop

from proxy import heap, metrics
from proxy.app import create_app
from proxy.model import resolve_model
from proxy.settings import Settings
from proxy.upstream import Upstream, Upstreams
from proxy.vllm import BackendError, VllmServer
from proxy.workers import Marks
from recorder.schema import shown_url

log = logging.getLogger("rl_proxy.server")

# Idle client connections are kept this long (uvicorn's default is 5 s). Agents pause between
# calls (tools, their own work) and clients that keep connections 5 s themselves (httpx) would
# race the server's close and fail a request now and then.
KEEP_ALIVE = 75
WORKER = "RL_PROXY_WORKER"  # what `serve --workers N` gives each worker: its settings, the marks' file


def stop_on_sigterm() -> None:
    """Let a supervisor's SIGTERM (systemd, Kubernetes, a job scheduler) unwind the command as
    Ctrl-C does: Python's default ends the process at once, and what it started (vLLM in its own
    process group, the proxy, running harness episodes) stayed behind holding memory and ports.

    SIGTERM goes to SIGINT's handler, as if Ctrl-C: inside asyncio.run that one cancels the main
    task, which unwinds by cancellation with the tasks it awaits; asyncio.run then cancels the
    others and raises KeyboardInterrupt. Elsewhere it raises KeyboardInterrupt. Raised inside
    whatever code ran, KeyboardInterrupt had landed in code that takes every exception as its
    own: uvicorn's lifespan, in an episode's gateway, logged it and exited the run with 3, before
    asyncio.run had joined the threads still starting containers (one was left behind)."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # a job started with `&`: Ctrl-C is live again
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def interrupt(signum: int, frame: FrameType | None) -> None:
        ctrl_c = signal.getsignal(signal.SIGINT)
        if not callable(ctrl_c):  # SIGINT set to the OS's default since
            raise KeyboardInterrupt(f"signal {signum}")
        ctrl_c(signal.SIGINT, frame)

    signal.signal(signal.SIGTERM, interrupt)


@contextmanager
def backend_for(settings: Settings, progress: bool = True) -> Iterator[tuple[Settings, VllmServer | None]]:
    """The settings with an upstream: the given one, or a vLLM launched here for `settings.model`."""
    if settings.upstream is not None:
        yield settings, None
        return
    path, name = resolve_model(settings.model)
    served = settings.served_model_name or name
    settings.log_dir.mkdir(parents=True, exist_ok=True)
    vllm = VllmServer(
        path,
        served,
        log_file=settings.log_dir / "vllm.log",
        port=settings.vllm_port,
        max_model_len=settings.max_model_len,
        tool_call_parser=settings.tool_call_parser,
        extra_args=settings.vllm_args,
        lora_rank=settings.max_lora_rank,
    )
    if progress:
        print(f"vLLM log: {vllm.log_file}")
    vllm.start(settings.vllm_startup_timeout, progress=progress)
    try:
        yield settings.model_copy(update={"upstream": vllm.base_url, "served_model_name": served}), vllm
    finally:
        vllm.stop()


def run(settings: Settings) -> int:
    """Serve in the foreground until Ctrl-C; exit code 1 if a launched vLLM dies."""
    with backend_for(settings) as (settings, vllm):
        assert settings.upstream is not None
        urls = Upstreams.urls(settings.upstream)
        shown = ", ".join(Upstream(url, timeout=0, connect_timeout=0).base_url for url in urls)  # no credentials
        print(f"rl-proxy on http://{settings.host}:{settings.port}/v1 -> {shown}; db {shown_url(settings.db)}")
        if settings.workers > 1:
            return serve_workers(settings, vllm)
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(settings), settings.host, settings.port, access_log=False, timeout_keep_alive=KEEP_ALIVE
            )
        )
        died = watch(vllm, lambda: not server.should_exit, lambda: setattr(server, "should_exit", True))
        heap.settle()
        # uvloop, as uvicorn picks when it runs the loop itself (AppThread): asyncio's own loop
        # costs more a call (docs/benchmarks.md, "Where the milliseconds go").
        try:
            with asyncio.Runner(loop_factory=new_event_loop) as runner:
                runner.run(server.serve())
        finally:  # however it ended (a failed start exits): vLLM's stop below is no death
            server.should_exit = True
        return 1 if died else 0


def serve_workers(settings: Settings, vllm: VllmServer | None) -> int:
    """`--workers N`: uvicorn's supervisor spawns N processes that take calls from one socket,
    each a proxy (`worker_app`) with its own event loop, caches and store connections, all on
    one store, as several proxies behind a balancer are (docs/deploying.md). Restarts a worker
    that dies. What they share: the marks they tell each other by (proxy/workers.py) and the
    metrics' files, in a directory that lives as long as they do. Exits as one process would: 1
    if the vLLM it launched died, 3 if a worker could not start (its store, say)."""
    handlers = {sig: signal.getsignal(sig) for sig in SIGNALS}  # the supervisor takes them
    with tempfile.TemporaryDirectory(prefix="rl-proxy-workers-") as shared, _environ(metrics.SHARED, WORKER):
        marks = Path(shared) / "marks"
        Marks(marks)  # made before any worker maps it
        os.environ[metrics.SHARED] = shared
        given = {"settings": settings.model_dump(mode="json"), "marks": str(marks)}
        os.environ[WORKER] = orjson.dumps(given).decode()
        config = uvicorn.Config(
            f"{__name__}:worker_app",
            settings.host,
            settings.port,
            factory=True,
            workers=settings.workers,
            access_log=False,
            timeout_keep_alive=KEEP_ALIVE,
        )
        try:
            supervisor = Multiprocess(config, sockets=[config.bind_socket()])
            died = watch(vllm, lambda: not supervisor.should_exit.is_set(), supervisor.should_exit.set)
            supervisor.run()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        if any(worker.exitcode == STARTUP_FAILURE for worker in supervisor.processes):
            return STARTUP_FAILURE
        return 1 if died else 0


@contextmanager
def _environ(*names: str) -> Iterator[None]:
    """These environment variables as they were, afterwards."""
    before = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def worker_app() -> FastAPI:
    """A worker's app: uvicorn calls this in each process it spawns, from what `serve_workers`
    left in the environment. One that cannot be made exits as a failed start, which stops the
    supervisor (uvicorn takes only a TypeError so, and restarts a worker that raised anything
    else, for ever)."""
    try:
        given = orjson.loads(os.environ[WORKER])
        log_setup()
        app = create_app(Settings(**given["settings"]), marks=Marks(Path(given["marks"])))
    except Exception:
        log.exception("a worker's app could not be made")
        sys.exit(STARTUP_FAILURE)
    heap.settle()
    return app


def watch(vllm: VllmServer | None, serving: Callable[[], bool], stop: Callable[[], None]) -> list[BackendError]:
    """Stop serving once the vLLM launched for it dies, checked every second in a thread; the
    list returned holds why, once it has."""
    died: list[BackendError] = []

    def check(vllm: VllmServer) -> None:
        while serving():
            try:
                vllm.check_alive()
            except BackendError as exc:
                log.error("%s", exc)
                died.append(exc)
                stop()
                return
            time.sleep(1.0)

    if vllm is not None:
        threading.Thread(target=check, args=(vllm,), name="vllm-watch", daemon=True).start()
    return died


def log_setup() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)


class AppThread:
    """An ASGI app (the proxy, or a stub upstream) served by uvicorn in a thread on a free loopback port."""

    def __init__(self, app: FastAPI, port: int = 0) -> None:
        # Bound here, not by uvicorn in its thread: the port is ours from the start, so nothing can
        # take it between choosing it and serving on it.
        self.socket = socket.socket()
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", port))
        self.port = int(self.socket.getsockname()[1])
        self.server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=KEEP_ALIVE)
        )
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name="uvicorn-thread", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> AppThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the proxy did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.socket.close()
