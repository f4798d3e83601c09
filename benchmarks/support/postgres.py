"""A throwaway PostgreSQL server for tests and benchmarks: Debian's binaries, a fresh cluster in
a temporary directory, loopback only, stopped and deleted afterwards.

Set RLP_TEST_POSTGRES=postgresql://... to use a server that is already running instead. Where
the binaries are missing the PostgreSQL tests are skipped, unless RLP_REQUIRE_SYSTEM=1 (make test),
which makes that a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from proxy.vllm import free_port


def postgres_bin() -> Path | None:
    """The directory of initdb and pg_ctl (Debian keeps them out of PATH)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    if found:
        return found[-1].parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


@dataclass
class Server:
    """A running throwaway server: its URL, and pg_ctl for the tests that stop and start it."""

    url: str
    ctl: Callable[[str], None]


@contextmanager
def temp_postgres(home: Path | None = None) -> Iterator[Server]:
    """A server of its own with a new, empty cluster (in `home`, or a temporary directory);
    `url` is its `postgres` database."""
    given = os.environ.get("RLP_TEST_POSTGRES")
    if given:
        yield Server(given, lambda action: None)
        return
    bin_dir = postgres_bin()
    if bin_dir is None:
        raise FileNotFoundError("PostgreSQL is not installed (apt-get install postgresql)")
    # PostgreSQL refuses to run as root: as root, the cluster belongs to Debian's postgres user.
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    home = home or Path(tempfile.mkdtemp(prefix="rlp-pg-"))
    data, port = home / "data", free_port()
    if as_user:
        shutil.chown(home, "postgres")
    quiet = {"check": True, "stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE}
    options = f"-p {port} -k {home} -c listen_addresses=127.0.0.1 -c max_connections=200 -c fsync=on"

    def ctl(action: str) -> None:
        """`start` (waits until it accepts connections) or `stop` (immediate, like a crash)."""
        extra = ["-o", options, "-l", home / "log", "-w"] if action == "start" else ["-m", "immediate"]
        subprocess.run([*as_user, bin_dir / "pg_ctl", "-D", data, *extra, action], **quiet)

    try:
        subprocess.run([*as_user, bin_dir / "initdb", "-D", data, "-U", "rlp", "--auth=trust", "-E", "UTF8"], **quiet)
        ctl("start")
        try:
            yield Server(f"postgresql://rlp@127.0.0.1:{port}/postgres", ctl)
        finally:
            ctl("stop")
    finally:
        shutil.rmtree(home, ignore_errors=True)
