"""A throwaway PostgreSQL cluster with the installed server's shipped settings, for benchmarks.

The machines' own server is tuned (autovacuum off, among others), and users' servers are not: `--pg default`
runs a bench on a cluster `initdb` makes in a temporary directory (trust auth, a free loopback port, nothing
changed in postgresql.conf), stopped and removed at the end; `--pg-url` names any server instead. Every table
header reads the server's non-default settings at run time (machine.describe), so neither is assumed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

DEFAULT_URL = os.environ.get("DELAY_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--pg-url", default=None,
                       help=f"the PostgreSQL server to measure on (default {DEFAULT_URL}, or $DELAY_BENCH_PG_URL)")
    group.add_argument("--pg", choices=("default",), default=None,
                       help="'default': a throwaway cluster of the installed PostgreSQL with its shipped settings "
                            "(initdb in a temporary directory, removed at the end)")


@contextlib.contextmanager
def server(args: argparse.Namespace) -> Iterator[str]:
    """The URL to measure on, for as long as the bench runs: sets args.pg_url too."""
    if getattr(args, "pg", None) == "default":
        with throwaway_cluster() as url:
            args.pg_url = url
            yield url
    else:
        args.pg_url = args.pg_url or DEFAULT_URL
        yield args.pg_url


def _bindir() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    if found:
        return found[-1].parent
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    raise SystemExit("--pg default needs PostgreSQL's server binaries (initdb, pg_ctl): "
                     "apt-get install postgresql, or name a server with --pg-url")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def throwaway_cluster() -> Iterator[str]:
    """initdb, start, yield the URL of its `test` database, stop and remove. As root the cluster runs as the
    `postgres` user (PostgreSQL refuses to run as root)."""
    bindir = _bindir()
    as_root = os.geteuid() == 0
    run_as: list[str] = ["runuser", "-u", "postgres", "--"] if as_root else []
    user = "postgres" if as_root else pwd.getpwuid(os.geteuid()).pw_name
    home = Path(tempfile.mkdtemp(prefix="bench-pg-"))
    data, sockets, log = home / "data", home / "sockets", home / "server.log"
    sockets.mkdir()
    if as_root:
        entry = pwd.getpwnam("postgres")
        for path in (home, sockets):
            os.chown(path, entry.pw_uid, entry.pw_gid)
    port = _free_port()
    pg_ctl = [*run_as, str(bindir / "pg_ctl"), "-D", str(data)]
    try:
        subprocess.run([*run_as, str(bindir / "initdb"), "-D", str(data), "-U", user, "--auth=trust",
                        "--encoding=UTF8", "--no-sync"], check=True, capture_output=True, text=True)
        subprocess.run([*pg_ctl, "-l", str(log), "-w", "-t", "60", "-o",
                        f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1", "start"],
                       check=True, capture_output=True, text=True)
        subprocess.run([*run_as, str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", user, "test"],
                       check=True, capture_output=True, text=True)
        yield f"postgresql+psycopg://{user}@127.0.0.1:{port}/test"
    except subprocess.CalledProcessError as exc:
        tail = log.read_text()[-2000:] if log.exists() else ""
        raise SystemExit(f"the throwaway PostgreSQL cluster did not start: {exc.cmd[len(run_as)]} exited "
                         f"{exc.returncode}: {exc.stderr.strip()[-2000:]}\n{tail}") from exc
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run([*pg_ctl, "-m", "fast", "-w", "stop"], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    """`python bench/pgserver.py [--pg-url URL] -- COMMAND ...`: runs COMMAND with DELAY_BENCH_PG_URL (and
    DELAY_TEST_PG_URL, which the deployment bench reads) naming a throwaway cluster with the shipped settings, or
    the server --pg-url names; the cluster is removed when COMMAND ends."""
    import sys

    argv = sys.argv[1:]
    if "--" not in argv:
        raise SystemExit("usage: pgserver.py [--pg-url URL] -- COMMAND [ARG ...]")
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="pgserver.py")
    parser.add_argument("--pg-url", help="a server to use instead of a throwaway cluster")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if not args.pg_url:
        args.pg = "default"
    with server(args) as url:
        env = {**os.environ, "DELAY_BENCH_PG_URL": url, "DELAY_TEST_PG_URL": url}
        print(f"benchmarks run on {url}", file=sys.stderr, flush=True)
        code = subprocess.run(command, env=env).returncode
    raise SystemExit(code)


if __name__ == "__main__":
    main()
