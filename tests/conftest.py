"""Shared fixtures: the real vLLM CPU server and a throwaway PostgreSQL server (each once per
test run), proxies on free ports, and a fresh database of either kind per test.

Set RLP_TEST_UPSTREAM=http://127.0.0.1:PORT/v1 to reuse a vLLM that is already running, and
RLP_TEST_POSTGRES=postgresql://... to reuse a PostgreSQL server (see benchmarks/support/postgres.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import pytest

from benchmarks.support.engine import engine_at, with_base_image
from benchmarks.support.nginx import nginx_bin
from benchmarks.support.postgres import postgres_bin, temp_postgres
from benchmarks.support.ray_cluster import local_cluster
from benchmarks.support.stack import RunningProxy, Upstream, new_database
from benchmarks.support.stub_upstream import stub_app
from proxy.app import create_app
from proxy.server import AppThread
from proxy.settings import Settings
from proxy.vllm import VllmServer
from tests.support.collected import collected_use


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that used the shared vLLM shows the end of vLLM's log with its failure."""
    report = yield
    vllm = getattr(item, "funcargs", {}).get("vllm")
    if report.failed and vllm is not None and vllm.log is not None:
        tail = vllm.log.read_text(errors="replace").splitlines()[-40:]
        report.sections.append(("end of the shared vLLM's log", "\n".join(tail)))
    return report


# What exists once per test process and takes one test at a time: the shared vLLM (greedy output
# depends on what else is in its batch; trainer tests swap weights into it), the container engine
# (its base image is built once) and the Ray clusters.
SHARED = {"vllm", "engine_service", "ray_cluster"}
NICE = 5

# vLLM's CPU build pins its model's threads to the CPUs it does not reserve (auto binding: all but
# the last). Each vLLM pins to the same ones, so the shared vLLM takes them, and every other vLLM
# a test starts (`rl-proxy serve`'s, the CLI's, the LoRA tests', a second replica) is pinned to
# the last CPU, beside the shared one rather than on its CPUs: on 2 cores two vLLMs had shared one
# core while the other ran the rest. A binding set by whoever runs the tests is left to every vLLM.
SHARED_VLLM_BIND = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(max(os.sched_getaffinity(0))))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`make test` runs two pytest-xdist workers (`-n 2 --dist loadgroup`): every test that uses
    one of SHARED goes to the same worker, in file order as without workers, and the rest (stub
    upstreams, tiny models, vLLMs of their own) to the other, on the CPU the shared vLLM leaves.
    The shared worker's tests that need neither the shared vLLM nor a Ray cluster (the container
    tests on stub upstreams, about 90 s) go first, while the shared vLLM starts (`_vllm_ahead`)."""
    for item in items:
        if SHARED & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("shared"))
    items.sort(key=lambda item: not _engine_only(item))  # stable: file order otherwise


def _engine_only(item: pytest.Item) -> bool:
    uses = set(getattr(item, "fixturenames", ()))
    return "engine_service" in uses and not uses & {"vllm", "ray_cluster"}


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The worker of the other tests yields the CPU to the shared worker's, the run's longest
    chain: niced (NICE, and so are the processes its tests start) at its first test. The shared
    worker is never niced before its group: loadgroup hands out the largest group first, and a
    worker more work only when it has nearly run out."""
    in_worker = "PYTEST_XDIST_WORKER" in os.environ
    if in_worker and not item.get_closest_marker("xdist_group") and os.getpriority(os.PRIO_PROCESS, 0) < NICE:
        os.setpriority(os.PRIO_PROCESS, 0, NICE)


@pytest.fixture(scope="session", autouse=True)
def _litellm() -> None:
    """litellm imported once per test process, as the proxy's start-up did before: the proxy
    now imports it on its first Messages or Responses call, and that call would wait seconds for
    it, past the 5 s client timeouts of several tests (which then passed only after another
    test had imported it). The import on the first call has a test of its own (test_faults.py)."""
    from proxy.litellm_bridge import litellm

    litellm()


@pytest.fixture(scope="session")
def _vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer | None]:
    """The shared vLLM's process, launched and not waited for (`vllm` waits); None where
    RLP_TEST_UPSTREAM names one already running."""
    if os.environ.get("RLP_TEST_UPSTREAM"):
        yield None
        return
    from proxy.model import resolve_model

    path, name = resolve_model("default")
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    # --enforce-eager: 45 s to start instead of 120 s (this CPU build recompiles at every start,
    # its compile cache fails to load); token ids, logprobs and the API are the same. 8192 tokens
    # of context (SmolLM2's own): Claude Code's prompt alone is about 7,600.
    # --trust-request-chat-template: the token-in test renders with a template of its own.
    extra = ["--enforce-eager", "--trust-request-chat-template"]
    server = VllmServer(path, name, log_file=log, max_model_len=8192, extra_args=extra)
    with mock.patch.dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=SHARED_VLLM_BIND):
        server.launch()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _vllm_ahead(request: pytest.FixtureRequest) -> None:
    """The shared vLLM starts (45-90 s on 2 cores) at the shared worker's first test, in the
    background, where a collected test needs it: the tests before the first that does (the
    container tests on stub upstreams, sorted first) run meanwhile."""
    if request.node.get_closest_marker("xdist_group") and collected_use(request.session, "vllm"):
        request.getfixturevalue("_vllm_server")


@pytest.fixture(scope="session")
def vllm(_vllm_server: VllmServer | None) -> Upstream:
    """The real vLLM server with SmolLM2-135M-Instruct, shared by every test that needs it."""
    if _vllm_server is None:
        given = os.environ["RLP_TEST_UPSTREAM"]
        served = httpx.get(f"{given}/models").json()["data"][0]
        return Upstream(given, served["id"], served["max_model_len"])
    _vllm_server.wait_ready(900)
    return Upstream(_vllm_server.base_url, _vllm_server.served_name, 8192, _vllm_server.log_file)


# The Debian packages of the system tools tests need; `make test` installs them (Makefile).
SYSTEM_PACKAGES = {
    "bwrap": "bubblewrap",
    "chromium": "chromium",
    "initdb": "postgresql",
    "nginx": "nginx",
    "podman": "podman",
    "runc": "runc",
    "debootstrap": "debootstrap",
}


def system_tool(name: str) -> str:
    """The path of a system tool a test needs. Missing, the test is skipped with the same message
    everywhere, or fails where the tools are required (RLP_REQUIRE_SYSTEM=1: `make test`, CI)."""
    found = {"initdb": postgres_bin, "nginx": nginx_bin}.get(name, lambda: shutil.which(name))()
    if found is None:
        why = f"needs {name}: apt-get install {SYSTEM_PACKAGES[name]} (`make test` installs it)"
        if os.environ.get("RLP_REQUIRE_SYSTEM"):
            pytest.fail(f"{why}; RLP_REQUIRE_SYSTEM is set")
        pytest.skip(why)
    return str(found)


@pytest.fixture
def bwrap() -> str:
    """bubblewrap: the shell example's sandbox, in which every harness that runs its commands runs."""
    return system_tool("bwrap")


@pytest.fixture
def chromium() -> str:
    return system_tool("chromium")


@pytest.fixture
def nginx() -> str:
    """The load balancer in front of several proxies (the scale soak)."""
    return system_tool("nginx")


@pytest.fixture(scope="session")
def engine_service() -> Iterator[str]:
    """The DOCKER_HOST of a container engine with the tasks' base image built: the one set, else
    Podman's Docker-compatible service started here (tests/podman.conf), once per test run. The
    base image is built from Debian's packages if the engine lacks it."""
    if not os.environ.get("DOCKER_HOST"):
        system_tool("runc")
    with engine_at(lambda: system_tool("podman")) as url:
        with_base_image(url, lambda: system_tool("debootstrap"))
        yield url


@pytest.fixture
def container_engine(engine_service: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A client of engine_service's engine, at DOCKER_HOST for this test only (a harness of a
    later test, Claude Code or Codex, sees no container engine in its environment). A container
    that a test left fails that test (each asserts `left()`), not every one after it: what was
    made since the test began is removed after it."""
    from harness_adapters.environments.containers import OWNER, engine

    monkeypatch.setenv("DOCKER_HOST", engine_service)
    client = engine()
    began = int(time.time())
    yield client
    for found in client.api.containers(all=True, filters={"label": OWNER}):
        if found["Created"] >= began:
            with contextlib.suppress(Exception):  # gone meanwhile
                client.api.remove_container(found["Id"], force=True)
    client.close()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A Ray cluster of three nodes on this machine: a head and two worker nodes of 2 CPUs each
    (benchmarks/support/ray_cluster.py)."""
    with local_cluster(workers=2, cpus=2) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def postgres() -> Iterator[str]:
    """A PostgreSQL server's URL; skipped where PostgreSQL is not installed, unless required."""
    if not os.environ.get("RLP_TEST_POSTGRES"):
        system_tool("initdb")
    with temp_postgres() as server:
        yield server.url


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh store URL: a SQLite file, then a PostgreSQL database (the same test runs on both)."""
    if request.param == "sqlite":
        return str(tmp_path / "store.db")
    return new_database(request.getfixturevalue("postgres"))


@pytest.fixture
def make_proxy(tmp_path: Path) -> Iterator[Any]:
    """Start proxies on free ports, each with a fresh SQLite file unless given `db`; stopped
    after the test."""
    running: list[AppThread] = []

    def start(upstream: str, **overrides: Any) -> RunningProxy:
        db = overrides.pop("db", None) or str(tmp_path / f"calls-{len(running)}.db")
        settings = Settings(upstream=upstream, db=db, **overrides)
        thread = AppThread(create_app(settings)).__enter__()
        running.append(thread)
        return RunningProxy(thread.url, db, settings)

    yield start
    for thread in running:
        thread.__exit__(None, None, None)


@pytest.fixture
def stub() -> Iterator[str]:
    """The base URL of a stub upstream (NOT vLLM), for tests of the proxy that need no model."""
    with AppThread(stub_app()) as server:
        yield f"{server.url}/v1"


@pytest.fixture
def proxy(make_proxy: Any, vllm: Upstream) -> RunningProxy:
    """A proxy in front of the shared real vLLM server."""
    return make_proxy(vllm.url)  # type: ignore[no-any-return]
