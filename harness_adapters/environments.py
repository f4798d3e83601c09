"""Where an episode's harness runs, named by a config's `environment:`.

- `host`: as a process on this machine, in the episode's work directory.
- `bubblewrap`: the same, inside bubblewrap (Debian's bubblewrap): every path read-only but the
  work directory; the network is shared, so the proxy on loopback is reachable.
- `container`: a fresh container per episode, through the Docker Engine API (Docker, or Podman's
  Docker-compatible service; local, or wherever DOCKER_HOST points). The image is the config's
  `image`, else the task's `environment/Dockerfile` (a Harbor task; built once and cached by the
  content of that folder), else the task's `docker_image`, else BASE_IMAGE. The harness runs
  *inside* the container (`docker exec` of the command harness's argv, in the image's working
  directory), so the model's commands act on the task's files, toolchain and tests; a harness
  installed on the host gets in by `mounts` (read-only), or is installed into the image. The
  container has no network but its own loopback, where the episode's gateway
  (harness_adapters/gateway.py) serves the proxy's model routes under the episode's key and
  nothing else: the agent cannot reach the admin API, vLLM or any other service of the host
  (`network: host` gives it the host's network instead: for an engine on another machine only).
  CPU and memory limits come from the config, else from the task (Harbor's defaults: 1 CPU,
  2048 MB). When the harness ends, however it ends (its exit, an error, its timeout), every
  process it left in the container is killed; then a Harbor task's `tests/` are copied in (the
  agent never saw them) and `tests/test.sh` runs with an empty /logs/verifier, so the reward is
  what the tests wrote and nothing the agent planted. The container is removed after every
  episode, and `close()` removes whatever a cancelled run left (SIGTERM, Ctrl-C, a crash).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, BinaryIO, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from harness_adapters.gateway import GatewayError, container_pid, gateway
from harness_adapters.rewards import RewardError
from harness_adapters.tasks import Task

if TYPE_CHECKING:
    from docker import DockerClient
    from docker.models.containers import Container

T = TypeVar("T")

BASE_IMAGE = "rl-proxy/debian:bookworm"  # built from Debian's packages: `rl-proxy tasks base-image`
OWNER = "rl-proxy.owner"  # the label on every container a run starts: what `close()` removes
BUBBLEWRAP = [
    *("bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"),
    *("--bind", "{workdir}", "{workdir}", "--die-with-parent", "--chdir", "{workdir}", "--"),
]
LOGS = "/logs"  # the container's /logs/agent and /logs/verifier are copied into the episode's work directory


class ContainerError(RuntimeError):
    """No container engine, an image that cannot be built, a container that cannot start."""


class BuildError(ContainerError):
    """A task's image that does not build (cached for the run: not tried again)."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HostEnvironment(Strict):
    """The harness as a process on this machine."""

    type: Literal["host"] = "host"

    def wrap(self, argv: list[str]) -> list[str]:
        return argv

    @contextlib.asynccontextmanager
    async def episode(
        self, task: Task, workdir: Path, proxy_url: str | None = None, key: str = ""
    ) -> AsyncIterator[Box | None]:
        yield None

    def close(self) -> None:
        pass


class BubblewrapEnvironment(HostEnvironment):
    """The harness in bubblewrap: every path read-only but the episode's work directory."""

    type: Literal["bubblewrap"] = "bubblewrap"  # type: ignore[assignment]

    def wrap(self, argv: list[str]) -> list[str]:
        return [*BUBBLEWRAP, *argv]


class ContainerEnvironment(HostEnvironment):
    """A fresh container per episode (see the module's docstring)."""

    type: Literal["container"] = "container"  # type: ignore[assignment]
    image: str | None = Field(None, description="this image for every task, instead of the task's own")
    cpus: float | None = Field(None, gt=0, description="CPU limit [default: the task's, else none]")
    memory_mb: int | None = Field(None, gt=0, description="memory limit [default: the task's, else none]")
    mounts: dict[str, str] = Field(default_factory=dict, description="host path -> container path, read-only")
    network: Literal["gateway", "host"] = Field(
        "gateway",
        description="gateway: only the proxy's model routes, on the container's loopback (needs the engine on this "
        "machine, as root); host: the host's whole network, loopback services included (an engine elsewhere)",
    )
    _client: DockerClient | None = PrivateAttr(None)
    _owner: str = PrivateAttr(default_factory=lambda: uuid.uuid4().hex)
    _builds: dict[str, asyncio.Lock] = PrivateAttr(default_factory=dict)
    _images: dict[str, str | BuildError] = PrivateAttr(default_factory=dict)  # by task folder

    def __getstate__(self) -> dict[Any, Any]:
        """Pickled (a Ray task's copy): the same owner label, no engine connection or builds."""
        state = super().__getstate__()
        return {**state, "__pydantic_private__": {"_client": None, "_owner": self._owner, "_builds": {}, "_images": {}}}

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
            return str(spec.docker_image)
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

    @contextlib.asynccontextmanager
    async def episode(
        self, task: Task, workdir: Path, proxy_url: str | None = None, key: str = ""
    ) -> AsyncIterator[Box]:
        """A container for one episode, removed when the episode is over, whatever ends it. With
        `proxy_url` (and the episode's `key`), the box's `proxy_url` is where the harness inside
        reaches the proxy."""
        image = await self.image_for(task)
        spec = task.harbor
        cpus = self.cpus or (spec.cpus if spec else None)
        memory = self.memory_mb or (spec.memory_mb if spec else None)
        volumes = {str(Path(host).resolve()): {"bind": inside, "mode": "ro"} for host, inside in self.mounts.items()}
        labels = {OWNER: self._owner, "rl-proxy.task": task.id}
        options: dict[str, Any] = {"nano_cpus": int(cpus * 1e9)} if cpus else {}
        if memory:
            options["mem_limit"] = f"{memory}m"
        network = "host" if self.network == "host" else "none"
        create = self.client().containers.run
        try:
            # `sleep` is the container's PID 1, so that `kill -9 -1` in it ends everything else (the
            # image's own ENTRYPOINT, an init or a script, would make it PID 2, and the kill its end).
            container = await asyncio.to_thread(
                create, image, None, entrypoint=["sleep", "infinity"], detach=True, network_mode=network,
                labels=labels, volumes=volumes, **options,
            )  # fmt: skip
        except Exception as exc:  # the engine's own errors: a missing image, a bad limit
            raise ContainerError(f"task {task.id}: cannot start a container of {image}: {exc}") from exc
        try:
            async with contextlib.AsyncExitStack() as stack:
                inside = proxy_url
                if proxy_url is not None and network == "none":
                    pid = await _engine(container_pid, container)
                    try:
                        inside = await stack.enter_async_context(gateway(pid, proxy_url, key))
                    except GatewayError as exc:
                        raise ContainerError(f"task {task.id}: {exc}") from exc
                info = await _engine(lambda: container.image.attrs["Config"])
                box = Box(container, info.get("WorkingDir") or "/", workdir, inside)
                await box.shell(f"mkdir -p {LOGS}/agent {LOGS}/verifier", 60)
                yield box
                with contextlib.suppress(Exception):  # what the harness left there (a killed one, too)
                    await asyncio.to_thread(box.fetch, "agent")
        finally:  # shielded: a cancelled episode (SIGTERM) still removes its container
            await asyncio.shield(asyncio.to_thread(self._remove, container.id))

    def _remove(self, container_id: str) -> None:
        with contextlib.suppress(Exception):  # already gone (`close()` got there first)
            self.client().containers.get(container_id).remove(force=True)

    def close(self) -> None:
        """Remove every container of this run still there (a run cut short, an attempt whose
        Ray worker died), then disconnect. The run's end only: an episode removes its own."""
        with contextlib.suppress(ContainerError):  # no engine here: none of the run's containers either
            self.reap()
        self.disconnect()

    def reap(self) -> int:
        """Remove every container of this run on this machine's engine; how many there were."""
        client = self.client()
        left = client.containers.list(all=True, filters={"label": f"{OWNER}={self._owner}"})
        for container in left:
            with contextlib.suppress(Exception):
                container.remove(force=True)
        return len(left)

    def disconnect(self) -> None:
        """Close the engine connection (a Ray task's copy, when its episode is over)."""
        if self._client is not None:
            self._client.close()
            self._client = None


# The kinds a config's `environment:` may name, told apart by `type`.
Environment = Annotated[HostEnvironment | BubblewrapEnvironment | ContainerEnvironment, Field(discriminator="type")]


@dataclass
class Box:
    """One episode's running container: run commands in it, put files in it, verify it. The
    engine's own failures (a container gone, a connection lost) raise ContainerError: they are
    the infrastructure's, never the agent's."""

    container: Container
    workdir: str  # the image's working directory: where the harness runs
    logs: Path  # the episode's work directory on the host: /logs/agent and /logs/verifier are copied there
    proxy_url: str | None = None  # the proxy as the harness inside reaches it

    async def run(
        self, argv: list[str], env: dict[str, str], out: BinaryIO, err: BinaryIO, timeout: float, stop: bool = True
    ) -> int:
        """Run `argv` in the container; its exit code. At the timeout every process in the
        container is killed (the container stays, for the tests) and TimeoutError raised; with
        `stop` False (the kill itself), ContainerError: the container no longer answers."""
        api = self.container.client.api

        def execute() -> int:
            created = api.exec_create(self.container.id, argv, environment=env, workdir=self.workdir)
            for stdout, stderr in api.exec_start(created["Id"], stream=True, demux=True):
                out.write(stdout or b"")
                err.write(stderr or b"")
            return int(api.exec_inspect(created["Id"])["ExitCode"] or 0)

        running = asyncio.ensure_future(_engine(execute))
        done, _ = await asyncio.wait({running}, timeout=timeout)
        if not done and not stop:
            raise ContainerError(f"the container did not run {argv[0]!r} in {timeout:g} s")
        if not done:
            await self.stop_agent()
            with contextlib.suppress(Exception):  # its stream ends with its processes
                await asyncio.wait_for(asyncio.shield(running), 30)
            raise TimeoutError
        return running.result()

    async def stop_agent(self) -> None:
        """Kill every process in the container but its PID 1: what the harness left running (a
        background job that would rewrite the reward after the tests) ends before they run."""
        with open(os.devnull, "wb") as out:
            await self.run(["sh", "-c", "kill -9 -1 2>/dev/null; true"], {}, out, out, 60, stop=False)

    async def put(self, files: dict[str, bytes], at: str | None = None) -> None:
        """Write files (relative path -> content) under `at` (default: the working directory)."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            for name, content in files.items():
                entry = tarfile.TarInfo(name)
                entry.size, entry.mode, entry.mtime = len(content), 0o755, int(time.time())
                archive.addfile(entry, io.BytesIO(content))
        target = at or self.workdir
        await self.shell(f"mkdir -p {shlex.quote(target)}", 60)
        if not await _engine(self.container.put_archive, target, buffer.getvalue()):
            raise ContainerError(f"cannot copy files into {target}")

    async def put_folder(self, folder: Path, at: str) -> None:
        files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        await self.put(files, at)

    def fetch(self, part: str) -> None:
        """Copy the container's /logs/<part> into the episode's work directory as <part>, over
        the API (so a remote engine works too)."""
        stream, _ = self.container.get_archive(f"{LOGS}/{part}")
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as archive:
            archive.extractall(self.logs, filter="data")  # the archive holds the folder by its name

    async def shell(self, script: str, timeout: float, env: dict[str, str] | None = None, log: str = "") -> int:
        """`sh -c script`, its output appended to `log` (a file under the episode's work
        directory) when given."""
        target = self.logs / log if log else Path(os.devnull)
        if log:
            target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "ab") as out:
            return await self.run(["sh", "-c", script], env or {}, out, out, timeout)

    async def verify(self, task: Task) -> dict[str, float]:
        """Run the task's tests (Harbor: tests/test.sh, copied to /tests) after the agent, on a
        clean slate: the agent's processes killed, /tests and /logs/verifier emptied (whatever the
        agent put there); the named rewards the tests wrote to /logs/verifier/reward.json, or
        {"reward": value} from reward.txt; RewardError when they wrote neither, or did not finish."""
        spec = task.harbor
        if spec is None:
            return {}
        await self.stop_agent()
        shutil.rmtree(self.logs / "verifier", ignore_errors=True)
        await self.shell(f"rm -rf /tests {LOGS}/verifier; mkdir -p /tests {LOGS}/verifier", 60)
        await self.put_folder(spec.dir / "tests", "/tests")
        try:
            await self.shell(
                "bash /tests/test.sh", spec.verifier_timeout, spec.verifier_env, "verifier/test-stdout.txt"
            )
        except TimeoutError:
            raise RewardError(f"the tests did not finish in {spec.verifier_timeout:g} s") from None
        await _engine(self.fetch, "verifier")
        return read_reward(self.logs / "verifier")


async def _engine(work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` in a thread, the engine's failures raised as ContainerError."""
    import docker
    import requests

    try:
        return await asyncio.to_thread(work, *args)
    except (docker.errors.DockerException, requests.RequestException, OSError) as exc:
        raise ContainerError(f"the container engine failed: {type(exc).__name__}: {exc}") from exc


def read_reward(folder: Path) -> dict[str, float]:
    """The rewards the tests wrote: reward.json (name -> number) or reward.txt (one number)."""
    as_json, as_text = folder / "reward.json", folder / "reward.txt"
    try:
        if as_json.is_file():
            named = json.loads(as_json.read_text())
            if not isinstance(named, dict) or not named:
                raise RewardError("reward.json must be an object of named numbers")
            rewards = {str(k): float(v) for k, v in named.items()}
        elif as_text.is_file():
            rewards = {"reward": float(as_text.read_text().strip())}
        else:
            out = folder / "test-stdout.txt"
            tail = out.read_text(errors="replace")[-500:] if out.is_file() else ""
            raise RewardError(
                f"the tests wrote no reward ({LOGS}/verifier/reward.txt or reward.json); end of their output: {tail!r}"
            )
    except (TypeError, ValueError) as exc:  # JSONDecodeError is a ValueError; float("x") too
        raise RewardError(f"the tests wrote an unreadable reward: {exc}") from exc
    bad = [name for name, value in rewards.items() if not math.isfinite(value)]
    if bad:
        raise RewardError(f"the tests wrote rewards that are not finite numbers: {', '.join(bad)}")
    return rewards


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
