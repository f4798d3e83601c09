"""A fresh container per episode (`environment: {type: container}`), through the Docker Engine
API (Docker, or Podman's Docker-compatible service; local, or wherever DOCKER_HOST points).

The image is the config's `image`, else the task's `environment/Dockerfile` (a Harbor task;
built once and cached by the content of that folder), else the task's `docker_image`, else
BASE_IMAGE. The harness runs *inside* the container (`docker exec` of the command harness's
argv, in the image's working directory), so the model's commands act on the task's files,
toolchain and tests; a harness installed on the host gets in by `mounts` (read-only), or is
installed into the image. The container has no network but its own loopback, where the
episode's gateway (environments/gateway.py) serves the proxy's model routes under the episode's
key and nothing else: the agent cannot reach the admin API, vLLM or any other service of the
host (`network: host` gives it the host's network instead: for an engine on another machine
only). CPU and memory limits come from the config, else from the task (Harbor's defaults: 1
CPU, 2048 MB). When the harness ends, however it ends (its exit, an error, its timeout), every
process it left in the container is killed; then a Harbor task's `tests/` are copied in (the
agent never saw them) and `tests/test.sh` runs with an empty /logs/verifier, so the reward is
what the tests wrote and nothing the agent planted (environments/box.py). The container is
removed after every episode, and `close()` removes whatever a cancelled run left (SIGTERM,
Ctrl-C, a crash).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, PrivateAttr

from harness_adapters.environments.box import LOGS, Box, BuildError, ContainerError, engine_call, on_engine_thread
from harness_adapters.environments.gateway import GatewayError, container_pid, gateway
from harness_adapters.environments.host import HostEnvironment
from harness_adapters.tasks import Task

if TYPE_CHECKING:
    from docker import DockerClient

BASE_IMAGE = "rl-proxy/debian:bookworm"  # built from Debian's packages: `rl-proxy tasks base-image`
OWNER = "rl-proxy.owner"  # the label on every container a run starts: what `close()` removes


class ContainerEnvironment(HostEnvironment):
    """A fresh container per episode (see the module's docstring)."""

    type: Literal["container"] = "container"  # type: ignore[assignment]
    image: str | None = Field(None, description="this image for every task, instead of the task's own")
    cpus: float | None = Field(None, gt=0, description="CPU limit [default: the task's, else none]")
    memory_mb: int | None = Field(None, gt=0, description="memory limit [default: the task's, else none]")
    mounts: dict[str, str] = Field(default_factory=dict, description="host path -> container path, read-only")
    warm: int = Field(
        0,
        ge=0,
        description="containers created and started ahead, for the next episodes to come (those waiting for "
        "their turn); the unused ones are removed at the run's end",
    )
    network: Literal["gateway", "host"] = Field(
        "gateway",
        description="gateway: only the proxy's model routes, on the container's loopback (needs the engine on this "
        "machine, as root); host: the host's whole network, loopback services included (an engine elsewhere)",
    )
    _client: DockerClient | None = PrivateAttr(None)
    _owner: str = PrivateAttr(default_factory=lambda: uuid.uuid4().hex)
    _builds: dict[str, asyncio.Lock] = PrivateAttr(default_factory=dict)
    _images: dict[str, str | BuildError] = PrivateAttr(default_factory=dict)  # by task folder
    _ahead: list[Task] = PrivateAttr(default_factory=list)  # episodes announced (expect), not yet begun
    _pool: dict[str, list[Any]] = PrivateAttr(default_factory=dict)  # started containers, by their settings
    _filling: asyncio.Task[None] | None = PrivateAttr(None)
    _taken: int = PrivateAttr(0)
    _closed: bool = PrivateAttr(False)

    def __getstate__(self) -> dict[Any, Any]:
        """Pickled (a Ray task's copy): the same owner label, no engine connection or builds."""
        state = super().__getstate__()
        empty: dict[str, Any] = {
            "_builds": {},
            "_images": {},
            "_ahead": [],
            "_pool": {},
            "_filling": None,
            "_taken": 0,
            "_closed": False,
        }
        return {**state, "__pydantic_private__": {"_client": None, "_owner": self._owner, **empty}}

    def client(self) -> DockerClient:
        if self._client is None:
            self._client = engine()
        return self._client

    async def image_for(self, task: Task) -> str:
        """The task's image, built first if it is not yet (one build at a time per image)."""
        if self.image:
            return self.image
        spec = task.harbor
        if spec is None:
            return BASE_IMAGE
        if not (spec.dir / "environment" / "Dockerfile").is_file():
            if spec.docker_image is None:  # its folder is gone since the task was read
                raise ContainerError(f"task {task.id}: no {spec.dir}/environment/Dockerfile and no docker_image")
            return spec.docker_image
        key = str(spec.dir)  # hashed, looked up and built once a run: not at every episode
        async with self._builds.setdefault(key, asyncio.Lock()):
            if key not in self._images:
                context = spec.dir / "environment"
                tag = f"rl-proxy-task/{_slug(task.id)}:{content_hash(context)}"
                try:
                    if not _exists(self.client(), tag):
                        await asyncio.to_thread(build_image, self.client(), context, tag, spec.build_timeout)
                    self._images[key] = tag
                # A build that fails is not tried again this run; an engine that did not answer
                # (any other ContainerError) is, at the next attempt: that is no fault of the task's.
                except BuildError as exc:
                    self._images[key] = exc
        found = self._images[key]
        if isinstance(found, BuildError):
            raise found
        return found

    async def settings(self, task: Task) -> dict[str, Any]:
        """What a container of `task`'s episodes is created with (its image built first)."""
        spec = task.harbor
        cpus = self.cpus or (spec.cpus if spec else None)
        memory = self.memory_mb or (spec.memory_mb if spec else None)
        options: dict[str, Any] = {"nano_cpus": int(cpus * 1e9)} if cpus else {}
        if memory:
            options["mem_limit"] = f"{memory}m"
        volumes = {str(Path(host).resolve()): {"bind": inside, "mode": "ro"} for host, inside in self.mounts.items()}
        network = "host" if self.network == "host" else "none"
        # `sleep` is the container's PID 1, so that `kill -9 -1` in it ends everything else (the
        # image's own ENTRYPOINT, an init or a script, would make it PID 2, and the kill its end).
        return dict(
            image=await self.image_for(task), entrypoint=["sleep", "infinity"], detach=True, network_mode=network,
            labels={OWNER: self._owner, "rl-proxy.task": task.id}, volumes=volumes, **options,
        )  # fmt: skip

    async def start(self, task: Task, settings: dict[str, Any]) -> Any:
        try:
            return await on_engine_thread(self._run, self.client(), settings)
        except ContainerError:
            raise
        except Exception as exc:  # the engine's own errors: a missing image, a bad limit
            raise ContainerError(f"task {task.id}: cannot start a container of {settings['image']}: {exc}") from exc

    def _run(self, client: DockerClient, settings: dict[str, Any]) -> Any:
        container = client.containers.run(**settings)
        # A start that outlived the run's sweep (asyncio.run cut short does not join this
        # thread): the container, made after the sweep, is removed here. It exists before this
        # check, so a sweep that set `_closed` after the check lists it.
        if self._closed:
            _remove(container)
            raise ContainerError("the run ended while this container started: removed")
        return container

    @property
    def warm_taken(self) -> int:
        """Episodes that began in a container started ahead."""
        return self._taken

    def expect(self, tasks: list[Task]) -> None:
        """With `warm`, the containers of the next `warm` of these episodes are started ahead (in
        the order given, one at a time), and each episode takes one of its settings if there is
        one. Only where the episodes run on this engine (not a Ray task's copy)."""
        self._ahead += tasks
        self._fill()

    def _fill(self) -> None:
        if self.warm and self._ahead and (self._filling is None or self._filling.done()):
            self._filling = asyncio.ensure_future(self._top_up())

    async def _top_up(self) -> None:
        """Start containers, one at a time, until each of the next `warm` episodes has one."""
        while True:
            wanted: Counter[str] = Counter()
            first: dict[str, tuple[Task, dict[str, Any]]] = {}
            for task in self._ahead[: self.warm]:
                try:
                    settings = await self.settings(task)
                except ContainerError:  # its image: the episode itself says so
                    continue
                wanted[_key(settings)] += 1
                first.setdefault(_key(settings), (task, settings))
            short = next((key for key, n in wanted.items() if len(self._pool.get(key, [])) < n), None)
            if short is None:
                return
            try:
                container = await self.start(*first[short])
            except ContainerError:
                return  # the episode starts its own, and says what failed
            self._pool.setdefault(short, []).append(container)  # removed by close() if no episode takes it

    @contextlib.asynccontextmanager
    async def episode(
        self, task: Task, workdir: Path, proxy_url: str | None = None, key: str = ""
    ) -> AsyncIterator[Box]:
        """A container for one episode (a warm one, if one was started ahead for it), removed
        when the episode is over, whatever ends it. With `proxy_url` (and the episode's `key`),
        the box's `proxy_url` is where the harness inside reaches the proxy."""
        settings = await self.settings(task)
        found = next((i for i, t in enumerate(self._ahead) if t.id == task.id), None)
        if found is not None:
            del self._ahead[found]
        warm = self._pool.get(_key(settings))
        container = warm.pop(0) if warm else await self.start(task, settings)
        self._taken += bool(warm)
        self._fill()
        network = settings["network_mode"]
        try:
            async with contextlib.AsyncExitStack() as stack:
                inside = proxy_url
                if proxy_url is not None and network == "none":
                    pid = await engine_call(container_pid, container)
                    try:
                        inside = await stack.enter_async_context(gateway(pid, proxy_url, key))
                    except GatewayError as exc:
                        raise ContainerError(f"task {task.id}: {exc}") from exc
                info = await engine_call(lambda: container.image.attrs["Config"])
                box = Box(container, info.get("WorkingDir") or "/", workdir, inside)
                await box.shell(f"mkdir -p {LOGS}/agent {LOGS}/verifier", 60)
                yield box
                with contextlib.suppress(Exception):  # what the harness left there (a killed one, too)
                    await on_engine_thread(box.fetch, "agent")
        finally:  # begun now and shielded: a cancelled episode (SIGTERM) still removes its container
            await asyncio.shield(on_engine_thread(_remove, container))

    def close(self) -> None:
        """Remove every container of this run still there (a run cut short, an attempt whose
        Ray worker died), then disconnect. The run's end only: an episode removes its own, and a
        container started after this is removed at once."""
        self._closed = True
        with contextlib.suppress(ContainerError):  # no engine here: none of the run's containers either
            self.reap()
        self.disconnect()

    def reap(self) -> int:
        """Remove every container of this run on this machine's engine; how many there were."""
        api = self.client().api
        # The engine's list as it is, not docker-py's `containers.list`, which inspects each one
        # it found: one that its cancelled episode removed meanwhile failed the whole sweep.
        left = api.containers(all=True, filters={"label": f"{OWNER}={self._owner}"})
        for found in left:
            with contextlib.suppress(Exception):  # gone meanwhile
                api.remove_container(found["Id"], force=True)
        return len(left)

    def disconnect(self) -> None:
        """Close the engine connection (a Ray task's copy, when its episode is over)."""
        if self._client is not None:
            self._client.close()
            self._client = None


def engine() -> DockerClient:
    """A client of the container engine at DOCKER_HOST (else the default socket)."""
    import docker

    try:
        client = docker.from_env(max_pool_size=256)  # an exec streams on a connection of its own per episode
        client.ping()
    except Exception as exc:
        where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        raise ContainerError(
            f"no container engine answers at {where} ({type(exc).__name__}): start Docker, or Podman's "
            "Docker-compatible service (`podman system service --time=0 unix:///run/podman/podman.sock &` "
            "and `export DOCKER_HOST=unix:///run/podman/podman.sock`); see docs/environments.md"
        ) from exc
    return client


def _remove(container: Any) -> None:
    """Remove a container through the client that made it (docker-py opens its connections again
    after a close()), if it is still there (`close()` may have got there first)."""
    with contextlib.suppress(Exception):
        container.remove(force=True)


def _key(settings: dict[str, Any]) -> str:
    """Containers made with equal settings are interchangeable: the warm pool's key."""
    return repr(sorted(settings.items()))


def content_hash(folder: Path) -> str:
    """A short hash of a folder's files (names, modes and contents): an image's cache key."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(folder)}\0{path.stat().st_mode & 0o777}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in name.lower()).strip("-.") or "task"


def _exists(client: DockerClient, image: str) -> bool:
    import docker

    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        return False
    return True


_say = threading.Lock()


def say(line: str) -> None:
    """A progress line on stderr (above a progress bar, which takes stderr over)."""
    with _say:
        print(line, file=sys.stderr, flush=True)


def build_image(client: DockerClient, context: Path, tag: str, timeout: float) -> None:
    """Build `context` (its Dockerfile) as `tag`, saying when it starts and how long it took."""
    import docker

    say(f"building image {tag} from {context}")
    start = time.monotonic()
    try:
        client.images.build(path=str(context), tag=tag, rm=True, forcerm=True, pull=False, timeout=timeout)
    except docker.errors.BuildError as exc:
        lines = [str(step.get("stream") or step.get("error") or "").strip() for step in exc.build_log]
        raise BuildError(f"building {context} failed: {exc.msg}\n" + "\n".join(lines[-15:])) from exc
    except docker.errors.APIError as exc:
        raise BuildError(f"building {context} failed: {exc}") from exc
    say(f"built image {tag} in {time.monotonic() - start:.1f} s")


def base_image(name: str = BASE_IMAGE, suite: str = "bookworm", mirror: str = "http://deb.debian.org/debian") -> None:
    """Build the base image from Debian's packages, with no registry: debootstrap a minimal
    Debian with bash, python3 and git into a folder (as root), then build it `FROM scratch`."""
    client = engine()
    if shutil.which("debootstrap") is None:
        raise ContainerError("the base image is built with debootstrap: apt-get install debootstrap")
    if os.geteuid() != 0:
        raise ContainerError("debootstrap needs root: run `rl-proxy tasks base-image` as root (sudo)")
    with tempfile.TemporaryDirectory(prefix="rl-proxy-base-") as work:
        root, context = Path(work) / "root", Path(work) / "context"
        context.mkdir()
        say(f"debootstrap {suite} from {mirror} (about a minute)")
        start = time.monotonic()
        packages = "--include=bash,python3,git,ca-certificates"
        done = subprocess.run(
            ["debootstrap", "--variant=minbase", packages, suite, str(root), mirror], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise ContainerError(
                f"debootstrap failed ({done.returncode}): {done.stderr[-1500:] or done.stdout[-1500:]}"
            )
        subprocess.run(["tar", "-C", str(root), "-cf", str(context / "root.tar"), "."], check=True)
        (context / "Dockerfile").write_text(
            "FROM scratch\nADD root.tar /\n"
            "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8\n"
            'CMD ["bash"]\n'
        )
        say(f"debootstrap took {time.monotonic() - start:.1f} s")
        build_image(client, context, name, 600)
