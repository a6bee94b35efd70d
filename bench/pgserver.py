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
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests import pg_cluster  # noqa: E402

DEFAULT_URL = os.environ.get("DELAY_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--pg-url", default=None,
                       help=f"the PostgreSQL server to measure on (default {DEFAULT_URL}, or $DELAY_BENCH_PG_URL)")
    group.add_argument("--pg", choices=("default",), default=None,
                       help="'default': a throwaway cluster of the installed PostgreSQL with its shipped settings "
                            "(initdb in a temporary directory, removed at the end)")
    parser.add_argument("--pg-set", action="append", default=[], metavar="NAME=VALUE",
                        help="with --pg default: a server setting changed from the shipped one (repeatable), as "
                             "autovacuum=off for a run beside one with it on; the header reads it back")


@contextlib.contextmanager
def server(args: argparse.Namespace) -> Iterator[str]:
    """The URL to measure on, for as long as the bench runs: sets args.pg_url too."""
    if getattr(args, "pg", None) == "default":
        with throwaway_cluster(_settings(getattr(args, "pg_set", []))) as url:
            args.pg_url = url
            yield url
    else:
        if getattr(args, "pg_set", []):
            raise SystemExit("--pg-set changes a throwaway cluster's settings: give it with --pg default")
        args.pg_url = args.pg_url or DEFAULT_URL
        yield args.pg_url


def _settings(pairs: list[str]) -> dict[str, str]:
    settings = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not re.fullmatch(r"[a-z_]+", name) or not re.fullmatch(r"[A-Za-z0-9_.]+", value):
            raise SystemExit(f"--pg-set takes NAME=VALUE (a setting's name and a plain value), got {pair!r}")
        settings[name] = value
    return settings


@contextlib.contextmanager
def throwaway_cluster(settings: dict[str, str] | None = None) -> Iterator[str]:
    """A cluster with the shipped settings (and `settings`) for as long as the bench runs (tests/pg_cluster.py)."""
    try:
        with pg_cluster.throwaway_cluster(settings) as url:
            yield url
    except pg_cluster.ClusterError as exc:
        raise SystemExit(f"--pg default: {exc}; or name a server with --pg-url") from exc


def main() -> None:
    """`python bench/pgserver.py [--pg-url URL] -- COMMAND ...`: runs COMMAND with DELAY_BENCH_PG_URL (and
    DELAY_TEST_PG_URL, which the deployment bench reads) naming a throwaway cluster with the shipped settings, or
    the server --pg-url names; the cluster is removed when COMMAND ends."""
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
