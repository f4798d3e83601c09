"""A throwaway PostgreSQL server for tests and benchmarks: Debian's binaries, a fresh cluster in
a temporary directory, loopback only, stopped and deleted afterwards.

Set RLP_TEST_POSTGRES=postgresql://... to use a server that is already running instead. Where
the binaries are missing the PostgreSQL tests are skipped, unless RLP_REQUIRE_POSTGRES=1 (CI),
which makes that a failure.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def postgres_bin() -> Path | None:
    """The directory of initdb and pg_ctl (Debian keeps them out of PATH)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    if found:
        return found[-1].parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def temp_postgres() -> Iterator[str]:
    """Yield the SQLAlchemy URL of a new, empty database on a server of its own."""
    given = os.environ.get("RLP_TEST_POSTGRES")
    if given:
        yield given
        return
    bin_dir = postgres_bin()
    if bin_dir is None:
        raise FileNotFoundError("PostgreSQL is not installed (apt-get install postgresql)")
    # PostgreSQL refuses to run as root: as root, the cluster belongs to Debian's postgres user.
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    home = Path(tempfile.mkdtemp(prefix="rlp-pg-"))
    data, port = home / "data", _free_port()
    if as_user:
        shutil.chown(home, "postgres")
    quiet = {"check": True, "stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE}
    try:
        subprocess.run([*as_user, bin_dir / "initdb", "-D", data, "-U", "rlp", "--auth=trust", "-E", "UTF8"], **quiet)
        options = f"-p {port} -k {home} -c listen_addresses=127.0.0.1 -c max_connections=200 -c fsync=on"
        subprocess.run(
            [*as_user, bin_dir / "pg_ctl", "-D", data, "-o", options, "-l", home / "log", "-w", "start"], **quiet
        )
        try:
            yield f"postgresql://rlp@127.0.0.1:{port}/postgres"
        finally:
            subprocess.run([*as_user, bin_dir / "pg_ctl", "-D", data, "-m", "immediate", "stop"], **quiet)
    finally:
        shutil.rmtree(home, ignore_errors=True)
