"""The running parts that tests share: a handle on the vLLM upstream, proxies and their stores
read back as the CLI would, fresh PostgreSQL databases, servers in processes of their own, and
a chat call straight to vLLM to compare the proxy's records with."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
from sqlalchemy.engine import make_url

from proxy.settings import Settings
from recorder import CallRecord, SessionInfo, Store


@dataclass(frozen=True)
class Upstream:
    url: str
    model: str
    max_model_len: int
    log: Path | None = None  # None: a server started elsewhere (RLP_TEST_UPSTREAM)


def vllm_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU-seconds so far of the engine core and the model worker of the vLLM whose API server is
    process `pid` (their names start VLLM::EngineCore and VLLM::Worker)."""
    import psutil  # vLLM's dependency

    spent = {"EngineCore": 0.0, "Worker": 0.0}
    for child in psutil.Process(pid).children(recursive=True):
        for kind in spent:
            if child.name().startswith(f"VLLM::{kind}"[:15]):  # the kernel keeps 15 characters of a name
                times = child.cpu_times()
                spent[kind] += times.user + times.system
    return spent


def new_database(server: str) -> str:
    """A new, empty database on the server: each test starts from nothing, as with SQLite."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return make_url(server).set(database=name).render_as_string(hide_password=False)


@dataclass
class RunningProxy:
    url: str
    db: str
    settings: Settings

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def calls(self, session_id: str | None = None) -> list[CallRecord]:
        return read_calls(self.db, session_id)

    def sessions(self) -> list[SessionInfo]:
        return read_store(self.db, lambda s: s.list_sessions())


async def _collect(it: Any) -> list[Any]:
    return [x async for x in it]


def read_calls(db: str, session_id: str | None = None) -> list[CallRecord]:
    """The calls in a store (one session's, if given), read as `read_store` does."""
    return read_store(db, lambda s: _collect(s.iter_calls(session_id)))  # type: ignore[no-any-return]


def read_store(db: str, work: Any) -> Any:
    """Read the database the way the trainer or CLI would: a fresh Store of its own."""

    async def main() -> Any:
        async with Store(db) as store:
            return await work(store)

    return asyncio.run(main())


@contextmanager
def process(
    args: list[str], health: str, log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A server in its own process, once its health URL answers; stopped afterwards."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{args[:3]} exited; see {log}")
            try:
                if httpx.get(health, timeout=1).status_code < 500:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{args[:3]} did not start; see {log}")
            time.sleep(0.25)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def direct_chat(vllm: Upstream, **body: Any) -> dict[str, Any]:
    """A chat call straight to vLLM (not through the proxy), with token ids and logprobs."""
    body = {"model": vllm.model, "return_token_ids": True, "logprobs": True, **body}
    resp = httpx.post(f"{vllm.url}/chat/completions", json=body, timeout=120)
    resp.raise_for_status()
    return resp.json()  # type: ignore[no-any-return]
