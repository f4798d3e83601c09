"""A container engine for the tests and benchmarks: the one at DOCKER_HOST, else Podman's
Docker-compatible service started here with tests/podman.conf's settings (runc, ulimits that a
sandboxed machine allows); and the tasks' base image, built from Debian's packages if missing."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

PODMAN_CONF = Path(__file__).resolve().parents[2] / "tests" / "podman.conf"


@contextmanager
def engine_at(podman: Callable[[], str] = lambda: "podman") -> Iterator[str]:
    """DOCKER_HOST, else the URL of Podman's service (`podman()` names its binary) started here
    and stopped on the way out. DOCKER_HOST itself is left as it was."""
    given = os.environ.get("DOCKER_HOST")
    if given:
        yield given
        return
    socket = Path(tempfile.mkdtemp(prefix="rlp-podman-")) / "podman.sock"
    env = {**os.environ, "CONTAINERS_CONF": str(PODMAN_CONF)}
    service = subprocess.Popen([podman(), "system", "service", "--time=0", f"unix://{socket}"], env=env)
    try:
        deadline = time.monotonic() + 60
        while not socket.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        yield f"unix://{socket}"
    finally:
        service.terminate()
        service.wait(30)


def with_base_image(url: str, before_building: Callable[[], object] = lambda: None) -> None:
    """The engine at `url` has the tasks' base image: built now (`before_building` first) if not."""
    from harness_adapters.environments.containers import BASE_IMAGE, _exists, base_image, engine

    with mock.patch.dict(os.environ, DOCKER_HOST=url):
        client = engine()
        if not _exists(client, BASE_IMAGE):
            before_building()
            base_image()
        client.close()
