"""Where episodes run: in this process (`rollouts: {engine: local}`, the default) or as Ray
tasks on a Ray cluster (`rollouts: {engine: ray, address: ...}`).

With Ray, the driver (`collect`, or the trainer) opens each episode's session through the
proxy's admin API, then runs the rest of the episode (its environment, harness, rewards and the
end of its session: `EpisodeRunner.play`) as a Ray task on whichever node has the resources it
asks for. The proxies and the store stay where they are: the task talks to the proxy's URL,
which its node must reach. A Harbor task's folder (its image's build context, its tests and
oracle) travels with it: packed once on the driver, put in Ray's object store, unpacked once per
node (into the node's temporary directory, by content), so no node needs the dataset on disk.

A task that Ray could not finish (its node or worker lost, killed for memory, an object lost, an
error that escaped the episode) is not retried by Ray (its session is the driver's): the driver
ends the lost attempt's session as `ended` with the error "lost: ..." (never trained: an episode
trains only when its runner ended it `ok`, or `failed`/`timeout` by its harness) and the runner
runs the episode again under a new session in the same group (metadata `replaces`), up to
`attempts` times. A task's episode removes its own container only; at the end of the run every
live node removes whatever of the run's containers is left there (a lost attempt's). When the
driver is cancelled (Ctrl-C, SIGTERM), it cancels its tasks: each task's episode is cancelled as
it would be here (its harness's process group killed, its container removed), then the worker
is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import logging
import os
import shutil
import signal
import sys
import tarfile
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from harness_adapters.environments import ContainerEnvironment, Environment
from harness_adapters.harnesses import FROM_FILES, Outcome
from harness_adapters.runner import LOST, EpisodeResult, EpisodeRunner
from harness_adapters.tasks import Task
from proxy.admin_client import AdminClient
from recorder import SessionInfo

log = logging.getLogger("rl_proxy.engines")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LocalRollouts(Strict):
    """Every episode in this process, at most `concurrency` at once."""

    engine: Literal["local"] = "local"
    attempts: int = Field(3, ge=1, description="runs of an episode that infrastructure faults ended, the first too")


class RayRollouts(LocalRollouts):
    """Every episode a Ray task on a Ray cluster."""

    engine: Literal["ray"] = "ray"  # type: ignore[assignment]
    address: str | None = Field(None, description='the cluster ("auto", host:port, ray://...); none: a new local one')
    num_cpus: float = Field(1.0, ge=0, description="CPUs an episode asks of its node")
    memory_mb: int | None = Field(None, gt=0, description="memory an episode asks of its node (Ray's logical memory)")
    resources: dict[str, float] = Field(default_factory=dict, description="custom resources, e.g. {container: 1}")
    env_vars: dict[str, str] = Field(
        default_factory=dict, description="variables an episode's task runs with on its node, e.g. {DOCKER_HOST: ...}"
    )


# The engines a config's `rollouts:` may name, told apart by `engine`.
RolloutsConfig = Annotated[LocalRollouts | RayRollouts, Field(discriminator="engine")]


@contextlib.contextmanager
def engine_for(
    config: LocalRollouts | RayRollouts, environment: Environment | None = None
) -> Iterator[RayEngine | None]:
    """The engine for a run (None: the local one), connected for the run's length; at its end,
    every live node removes the run's containers left there (`environment`'s)."""
    if not isinstance(config, RayRollouts):
        yield None
        return
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = not ray.is_initialized()
    if started:
        ours = signal.getsignal(signal.SIGTERM)
        ray.init(address=config.address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        if threading.current_thread() is threading.main_thread():  # Ray's own handler exits at once
            signal.signal(signal.SIGTERM, ours)
    try:
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        placement = ray.remote(Placement).options(num_cpus=0, scheduling_strategy=here).remote()
        yield RayEngine(config, placement, ray.remote(max_retries=0)(_play))
    finally:
        if isinstance(environment, ContainerEnvironment):
            try:
                reap_everywhere(config, environment)
            except Exception:  # the cluster went first: what its nodes hold is theirs to clean up
                log.warning("could not remove the run's containers on every Ray node", exc_info=True)
        if started:
            ray.shutdown()


def reap_everywhere(settings: RayRollouts, environment: ContainerEnvironment) -> None:
    """Remove the run's containers left on every live node of the cluster (a lost attempt's)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    reap = ray.remote(num_cpus=0, max_retries=0)(_reap)
    env = {"runtime_env": {"env_vars": settings.env_vars}} if settings.env_vars else {}
    refs = [
        reap.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False), **env).remote(environment)
        for node in nodes
    ]
    ray.wait(refs, num_returns=len(refs), timeout=60)


def _reap(environment: Environment) -> None:
    environment.close()


class Placement:
    """Which node runs which session, as the tasks report it (a Ray actor on the driver's node)."""

    def __init__(self) -> None:
        self.running: dict[str, str] = {}

    def start(self, session_id: str, node: str) -> None:
        self.running[session_id] = node

    def end(self, session_id: str) -> None:
        self.running.pop(session_id, None)

    def counts(self) -> dict[str, int]:
        return dict(Counter(self.running.values()))


def pack_folder(folder: Path) -> bytes:
    """A task folder as a tar (modes kept: tests/test.sh runs as written)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(folder, arcname=folder.name)
    return buffer.getvalue()


def unpack_folder(packed: bytes) -> Path:
    """A packed task folder on this node, unpacked once per content: into a fresh folder renamed
    into place, so that episodes unpacking the same task at once each find it whole."""
    cache = Path(tempfile.gettempdir()) / "rl-proxy-tasks"
    home = cache / hashlib.sha256(packed).hexdigest()[:16]
    if not home.exists():
        cache.mkdir(exist_ok=True)
        fresh = Path(tempfile.mkdtemp(dir=cache))
        with tarfile.open(fileobj=io.BytesIO(packed)) as tar:
            tar.extractall(fresh, filter="data")
        try:
            fresh.rename(home)
        except OSError:  # another episode's copy got there first
            shutil.rmtree(fresh, ignore_errors=True)
    [folder] = home.iterdir()
    return folder


def _play(
    runner: EpisodeRunner, session: SessionInfo, task: Task, n: int, placement: Any, folder: bytes | None
) -> EpisodeResult:
    """A Ray task: one episode of an open session, on this node (a Harbor task's folder, packed,
    unpacked here)."""
    import ray

    if folder is not None and task.harbor is not None:
        task = replace(task, harbor=replace(task.harbor, dir=unpack_folder(folder)))
    node = ray.get_runtime_context().get_node_id()
    placement.start.remote(session.id, node)

    async def main() -> EpisodeResult:
        async with runner.admin() as admin:
            try:
                return await runner.play(admin, session, task, n)
            finally:  # its own container is gone already; the others on this node are not its own
                disconnect = getattr(runner.environment, "disconnect", None)
                if disconnect is not None:
                    disconnect()

    try:
        result = asyncio.run(main())
    finally:
        placement.end.remote(session.id)
    result.node = node
    return result


PLACEMENT_WAIT = 5  # s: the longest a progress line holds the run's event loop


@dataclass
class RayEngine:
    settings: RayRollouts
    placement: Any  # the Placement actor
    play_remote: Any  # _play as a Ray task
    submitted: int = 0
    finished: int = 0
    folders: dict[Path, Any] = field(default_factory=dict)  # task folder: its packed copy in the object store

    async def play(
        self, runner: EpisodeRunner, admin: AdminClient, session: SessionInfo, task: Task, n: int
    ) -> EpisodeResult:
        """One attempt of an episode on the cluster; one that Ray lost is ended "lost: ..."."""
        import ray

        for module in FROM_FILES:  # an agent loaded from a file is no module the workers can import
            ray.cloudpickle.register_pickle_by_value(sys.modules[module])
        # SPREAD: an episode goes to the node with the fewest of them (Ray's default fills one node first).
        options: dict[str, Any] = {
            "num_cpus": self.settings.num_cpus,
            "resources": self.settings.resources,
            "scheduling_strategy": "SPREAD",
        }
        if self.settings.memory_mb:
            options["memory"] = self.settings.memory_mb * 2**20
        if self.settings.env_vars:
            options["runtime_env"] = {"env_vars": self.settings.env_vars}
        portable = replace(runner, engine=None)  # what the task needs of it; the engine stays here
        folder = None
        if task.harbor is not None:
            if task.harbor.dir not in self.folders:
                self.folders[task.harbor.dir] = ray.put(pack_folder(task.harbor.dir))
            folder = self.folders[task.harbor.dir]
        ref = self.play_remote.options(**options).remote(portable, session, task, n, self.placement, folder)
        self.submitted += 1
        try:
            result: EpisodeResult = await ref
            return result
        except asyncio.CancelledError:
            await self._cancel(ref)
            raise
        except ray.exceptions.RayError as exc:  # node or worker lost, out of memory, object lost, escaped error
            self.placement.end.remote(session.id)  # a task that died never said so itself
            cause = getattr(exc, "cause", None) or exc
            error = f"{LOST}{type(exc).__name__}: {str(cause)[:500]}"
            return await runner.end_infra(admin, session, task, n, Outcome("failed", error=error), error)
        finally:
            self.finished += 1

    async def _cancel(self, ref: Any) -> None:
        """Cancel a running task as Ctrl-C would: its episode unwinds (its harness's process group
        is killed, its container removed); a task still running after 15 s is killed outright."""
        import ray

        ray.cancel(ref)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not ray.wait([ref], timeout=0)[0]:
            await asyncio.sleep(0.2)
        ray.cancel(ref, force=True)

    def describe(self) -> str:
        """Episodes running per node and queued, for a progress line, which is written on the
        run's event loop: it waits PLACEMENT_WAIT s at most for the placement actor, and a placement
        that does not answer or is gone is said so rather than holding up or ending the run."""
        import ray

        try:
            counts = ray.get(self.placement.counts.remote(), timeout=PLACEMENT_WAIT)
        except ray.exceptions.GetTimeoutError:
            return f"episodes per node: the placement actor did not answer in {PLACEMENT_WAIT} s"
        except ray.exceptions.RayError as exc:
            return f"episodes per node: unknown ({type(exc).__name__})"
        running = sum(counts.values())
        nodes = ", ".join(f"{node[:8]} {k}" for node, k in sorted(counts.items()))
        queued = max(self.submitted - self.finished - running, 0)
        return f"running {running} ({nodes or 'none'}), queued {queued}"
