"""A throwaway PostgreSQL cluster with the installed server's shipped settings, for tests and benchmarks.

The machines' own server is tuned (autovacuum off, among others), and users' servers are not: this runs
`initdb` into a temporary directory (trust auth, a free loopback port, nothing changed in postgresql.conf but
what the caller names), and stops and removes it at the end. Nothing is downloaded: it needs the installed
server's binaries.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path


class ClusterError(RuntimeError):
    """The throwaway cluster could not be made or started; the message says why and what to install."""


def bindir() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    if found:
        return found[-1].parent
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    raise ClusterError("a throwaway PostgreSQL cluster needs the server's binaries (initdb, pg_ctl): "
                       "apt-get install postgresql")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def throwaway_cluster(settings: Mapping[str, str] | None = None) -> Iterator[str]:
    """initdb, start, yield the URL of its `test` database, stop and remove. As root the cluster runs as the
    `postgres` user (PostgreSQL refuses to run as root).

    :param settings: server settings to start it with (`-c name=value`), beside the shipped ones."""
    binaries = bindir()
    as_root = os.geteuid() == 0
    run_as: list[str] = ["runuser", "-u", "postgres", "--"] if as_root else []
    user = "postgres" if as_root else pwd.getpwuid(os.geteuid()).pw_name
    home = Path(tempfile.mkdtemp(prefix="throwaway-pg-"))
    data, sockets, log = home / "data", home / "sockets", home / "server.log"
    sockets.mkdir()
    if as_root:
        entry = pwd.getpwnam("postgres")
        for path in (home, sockets):
            os.chown(path, entry.pw_uid, entry.pw_gid)
    port = _free_port()
    pg_ctl = [*run_as, str(binaries / "pg_ctl"), "-D", str(data)]
    options = " ".join([f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1",
                        *(f"-c {name}={value}" for name, value in (settings or {}).items())])
    try:
        subprocess.run([*run_as, str(binaries / "initdb"), "-D", str(data), "-U", user, "--auth=trust",
                        "--encoding=UTF8", "--no-sync"], check=True, capture_output=True, text=True)
        subprocess.run([*pg_ctl, "-l", str(log), "-w", "-t", "60", "-o", options, "start"],
                       check=True, capture_output=True, text=True)
        subprocess.run([*run_as, str(binaries / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", user, "test"],
                       check=True, capture_output=True, text=True)
        yield f"postgresql+psycopg://{user}@127.0.0.1:{port}/test"
    except subprocess.CalledProcessError as exc:
        tail = log.read_text()[-2000:] if log.exists() else ""
        raise ClusterError(f"the throwaway PostgreSQL cluster did not start: {exc.cmd[len(run_as)]} exited "
                           f"{exc.returncode}: {exc.stderr.strip()[-2000:]}\n{tail}") from exc
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run([*pg_ctl, "-m", "fast", "-w", "stop"], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)
