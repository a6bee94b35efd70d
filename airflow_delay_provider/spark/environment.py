"""The executors' Python environment for a sweep on a cluster, packed as an archive Spark ships.

A partition of the sweep runs in a Python worker on an executor, on a node that may have nothing of
this project: it needs the sweep's code and its drivers (SQLAlchemy, psycopg, pika, boto3), not
Airflow. `build_archive` copies those distributions out of this Python's environment (the Airflow
worker's, so the executors run exactly the versions the driver runs) into a tar.gz whose
`bin/python` is a launcher: it runs the node's own Python of the same minor version with the
archive's packages first on its path. This is Spark's documented way of shipping a Python
environment (`spark.archives=<archive>#environment`, `spark.pyspark.python=./environment/bin/python`),
with a launcher instead of a venv's interpreter symlink, so nodes need not have Python at the same path.

Compiled packages (psycopg's binary, SQLAlchemy's and greenlet's extensions, pyarrow) are built for this
machine's platform and Python: the nodes need the same OS family and CPU architecture, and a Python of
the same minor version. Build on a machine like the nodes when they differ from the Airflow worker.

    python -m airflow_delay_provider.spark.environment -o sweep-env.tar.gz [--arrow]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as metadata
import importlib.util
import io
import json
import logging
import os
import platform
import py_compile
import re
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: The name Spark unpacks the archive under, in each executor's working directory.
ALIAS = "environment"
#: What executors import: the drivers of the store and of each transport.
EXECUTOR_REQUIREMENTS = ("sqlalchemy", "psycopg[binary]", "pika", "boto3")
#: The "jdbc" and "python" readers hand rows to partitions as Arrow batches (mapInArrow); 170 MB.
ARROW_REQUIREMENTS = ("pyarrow",)
#: A node's Python, chosen before the launcher looks on PATH.
PYTHON_ENV = "AIRFLOW_DELAY_EXECUTOR_PYTHON"
#: Set (to the setting's name) when the task's own settings chose PYTHON_ENV: then that Python or none.
PYTHON_FROM_ENV = "AIRFLOW_DELAY_EXECUTOR_PYTHON_FROM"
#: Where archives built for sweeps are kept, keyed by what they hold (default ~/.cache/airflow-delay-provider).
CACHE_ENV = "AIRFLOW_DELAY_EXECUTOR_ENV_CACHE"
PACKAGE = "airflow_delay_provider"

_LAUNCHER = """#!/bin/sh
# Runs a Python {version} of this node with the packages of this archive first on its path
# (built by airflow-delay-provider for the executors of a Spark sweep).
here=$(CDPATH= cd -- "$(dirname -- "$0")/.." && pwd)
if [ -n "${{{python_from}:-}}" ]; then
    # The executors' Python a setting of the task chose (PYSPARK_PYTHON, spark.pyspark.python): that one, with
    # this archive's packages, or none: another Python would not be what the task's log says runs.
    chosen_version=
    found=$(command -v "${{{python_env}:-}}" 2>/dev/null) &&
        chosen_version=$("$found" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) &&
        [ "$chosen_version" = "{version}" ] &&
        PYTHONPATH="$here/site-packages${{PYTHONPATH:+:$PYTHONPATH}}" exec "$found" "$@"
    echo "airflow-delay-provider executor environment: ${python_from} names ${python_env}, which is" \\
         "${{chosen_version:+Python $chosen_version}}${{chosen_version:-not runnable on this node}}, and the" \\
         "archive's packages are built for Python {version}: point it at a Python {version}, or unset it" >&2
    exit 127
fi
for candidate in "${{{python_env}:-}}" python{version} python3 python; do
    [ -n "$candidate" ] || continue
    found=$(command -v "$candidate" 2>/dev/null) || continue
    if [ "$("$found" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "{version}" ]; then
        PYTHONPATH="$here/site-packages${{PYTHONPATH:+:$PYTHONPATH}}" exec "$found" "$@"
    fi
done
echo "airflow-delay-provider executor environment: no Python {version} on this node (tried \\${python_env}," \\
     "python{version}, python3 and python on PATH=$PATH); install Python {version} or set {python_env}" >&2
exit 127
"""


@dataclass(frozen=True)
class Archive:
    """A built archive: its path, size, how long it took (0 when it came from the cache) and what it holds."""

    path: Path
    size_bytes: int
    build_seconds: float
    python: str
    distributions: tuple[str, ...]

    def describe(self) -> str:
        return (f"{self.path} ({self.size_bytes / 2**20:.1f} MiB, Python {self.python}, "
                f"{len(self.distributions)} distributions)")


def _name(requirement: str) -> tuple[str, set[str]]:
    match = re.match(r"\s*([A-Za-z0-9._-]+)\s*(?:\[([^\]]*)\])?", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    extras = {e.strip() for e in (match.group(2) or "").split(",") if e.strip()}
    return re.sub(r"[-_.]+", "-", match.group(1)).lower(), extras


def distributions(requirements: Iterable[str]) -> list[metadata.Distribution]:
    """The installed distributions `requirements` need, their dependencies included (markers evaluated
    for this Python, extras followed)."""
    from packaging.requirements import Requirement

    found: dict[str, metadata.Distribution] = {}
    pending = [(_name(r)) for r in requirements]
    while pending:
        name, extras = pending.pop()
        if name not in found:
            try:
                found[name] = metadata.distribution(name)
            except metadata.PackageNotFoundError:
                raise RuntimeError(f"{name} is not installed in {sys.prefix}: the executors need it; "
                                   f"pip install {name}") from None
        for line in found[name].requires or ():
            requirement = Requirement(line)
            if requirement.marker is None or any(requirement.marker.evaluate({"extra": e}) for e in extras | {""}):
                pending.append((_name(str(requirement.name))[0], set(requirement.extras)))
    return sorted(found.values(), key=lambda d: d.metadata["Name"].lower())


#: botocore's models of the services the SQS transport uses; the other 400-odd are most of the archive.
AWS_SERVICES = ("sqs", "s3", "sts")
#: Sources of compiled extensions: the built modules are what is imported.
_SOURCES = (".c", ".cpp", ".h", ".pyx", ".pxd", ".pyc")


def _needed(parts: tuple[str, ...], suffix: str) -> bool:
    if not parts or parts[0] == ".." or "__pycache__" in parts or suffix in _SOURCES:
        return False
    return not (parts[:2] == ("botocore", "data") and len(parts) > 3 and parts[2] not in AWS_SERVICES)


def _distribution_files(dist: metadata.Distribution) -> Iterator[tuple[Path, str]]:
    """(file, path in site-packages) of an installed distribution, without scripts, bytecode, extension
    sources or the AWS service models no transport uses."""
    for entry in dist.files or ():
        if not _needed(Path(entry).parts, entry.suffix):
            continue
        source = Path(dist.locate_file(entry))
        if source.is_file():
            yield source, str(entry)


def _package_files() -> Iterator[tuple[Path, str]]:
    """This package's own files, from where it is imported (an editable install lists none)."""
    root = Path(__file__).resolve().parent.parent
    for source in sorted(root.rglob("*")):
        relative = source.relative_to(root.parent)
        if source.is_file() and "__pycache__" not in relative.parts and source.suffix != ".pyc":
            yield source, str(relative)


@dataclass(frozen=True)
class _Contents:
    files: list[tuple[Path, str]]
    names: list[str]
    key: str


def _contents(with_arrow: bool) -> _Contents:
    """What an archive holds: (file, path in site-packages), the distributions, and a key of both."""
    requirements = EXECUTOR_REQUIREMENTS + (ARROW_REQUIREMENTS if with_arrow else ())
    dists = distributions(requirements)
    package = list(_package_files())
    names = [f"{d.metadata['Name']}=={d.version}" for d in dists]
    digest = hashlib.sha256()
    digest.update(json.dumps([python_version(), platform.machine(), sys.platform, names]).encode())
    for source, _ in package:  # the distributions are named by version; this package may be a checkout
        digest.update(source.read_bytes())
    files = package + [entry for dist in dists for entry in _distribution_files(dist)]
    return _Contents(files, names, digest.hexdigest()[:16])


def python_version() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def build_archive(output: str | Path, with_arrow: bool = False, compresslevel: int = 1,
                  contents: _Contents | None = None) -> Archive:
    """Write the executors' environment to `output` (a .tar.gz): site-packages/ with this package and
    EXECUTOR_REQUIREMENTS (and pyarrow `with_arrow`), and bin/python, the launcher. Written to a
    temporary file first and renamed, so a reader never sees half an archive."""
    started = time.monotonic()
    contents = contents or _contents(with_arrow)
    files, names = contents.files, contents.names
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=output.name + ".", suffix=".partial", dir=output.parent)
    try:
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz", compresslevel=compresslevel) as tar:
            launcher = _LAUNCHER.format(version=python_version(), python_env=PYTHON_ENV,
                                        python_from=PYTHON_FROM_ENV).encode()
            info = tarfile.TarInfo("bin/python")
            info.size, info.mode, info.mtime = len(launcher), 0o755, int(time.time())
            tar.addfile(info, io.BytesIO(launcher))
            manifest = json.dumps({"python": python_version(), "platform": f"{sys.platform}-{platform.machine()}",
                                   "distributions": names}, indent=1).encode()
            info = tarfile.TarInfo("manifest.json")
            info.size, info.mtime = len(manifest), int(time.time())
            tar.addfile(info, io.BytesIO(manifest))
            with tempfile.TemporaryDirectory() as scratch:
                for source, relative in files:
                    tar.add(source, arcname=f"site-packages/{relative}", recursive=False)
                    if source.suffix == ".py":
                        _add_bytecode(tar, source, relative, scratch)
        os.replace(partial, output)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    return Archive(output, output.stat().st_size, time.monotonic() - started, python_version(), tuple(names))


def _add_bytecode(tar: tarfile.TarFile, source: Path, relative: str, scratch: str) -> None:
    """The module's bytecode beside it, valid whatever the unpacked files' times: each executor's Python
    workers would otherwise compile every module they import (seconds of CPU on each executor's first
    task). Modules that do not compile on this Python (a vendored file for another version) are left out."""
    compiled = os.path.join(scratch, "module.pyc")
    try:
        py_compile.compile(str(source), cfile=compiled, dfile=relative, doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    except py_compile.PyCompileError:
        return
    tar.add(compiled, arcname=f"site-packages/{importlib.util.cache_from_source(relative)}", recursive=False)


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "airflow-delay-provider"


def cached_archive(with_arrow: bool = False, directory: str | Path | None = None) -> Archive:
    """The archive of this environment, built once per content (this package's files, the distributions'
    versions, the Python and platform) and kept in `directory` (default: cache_dir())."""
    contents = _contents(with_arrow)
    path = Path(directory or cache_dir()) / f"sweep-executor-env-py{python_version()}-{contents.key}.tar.gz"
    if path.is_file():
        return Archive(path, path.stat().st_size, 0.0, python_version(), tuple(contents.names))
    log.info("Building the executors' environment %s (%d distributions)", path, len(contents.names))
    return build_archive(path, with_arrow=with_arrow, contents=contents)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m airflow_delay_provider.spark.environment",
        description="Build the archive a sweep's executors run in: pass it as BulkSweepOperator(executor_env=...) "
                    "or spark-submit --archives <archive>#environment --conf "
                    "spark.pyspark.python=./environment/bin/python.")
    parser.add_argument("-o", "--output", required=True, help="the .tar.gz to write")
    parser.add_argument("--arrow", action="store_true",
                        help="include pyarrow, which the 'jdbc' and 'python' readers need (the default does not)")
    args = parser.parse_args(argv)
    archive = build_archive(args.output, with_arrow=args.arrow)
    print(f"built {archive.describe()} in {archive.build_seconds:.1f} s")
    print("executors need Java, and Python", archive.python, f"on PATH (or in ${PYTHON_ENV}), on {sys.platform}-"
          f"{platform.machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
