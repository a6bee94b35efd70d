"""Where the sweep's driver reads the store's and transport's connections, which hold their secrets.

In client mode the driver runs in the Airflow task's own process tree: it reads a file of mode 0600 in a private
directory, which the task deletes when it ends (`SecretFile`). In cluster mode the driver runs on a node, and
the file would have to go with the application (`spark-submit --files`), which no cluster manager deletes
when the task ends:

- Kubernetes uploads every local file to `spark.kubernetes.file.upload.path` (a bucket or shared file system
  that other applications' files share, under a random directory nothing removes). So on Kubernetes the
  connections come from a Kubernetes Secret the user made (`python -m airflow_delay_provider.spark.secret`
  writes its content) and names with `connections_secret`; the operator mounts it in the driver's pod
  (`spark.kubernetes.driver.secrets.<name>`), Kubernetes' own way of handing a pod credentials.
- YARN copies it to the application's staging directory (deleted at the end), but its NodeManagers then keep
  a copy in each node's private file cache (`usercache/<user>/filecache`, PRIVATE visibility) across
  applications, until the cache outgrows `yarn.nodemanager.localizer.cache.target-size-mb`. Refused.
- A standalone master does not run Python applications in cluster mode at all, and other cluster managers are
  not known to delete what they are given. Refused.

Refused means the task fails before anything is claimed, saying to run the driver in client mode: it only
plans id ranges and sums counts, and the partitions run on the executors either way.

The Secret, made from the same connections::

    python -m airflow_delay_provider.spark.secret -o connections.json --delay-store-conn-id delay_store_default \\
        --transport rabbitmq
    kubectl create secret generic sweep-connections --from-file=connections.json && rm connections.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field

from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.spark.setup import SparkSetupError, SparkTarget

#: Where the operator mounts the Secret named by `connections_secret` in the driver's pod (unless conf does).
MOUNT = "/opt/airflow-delay/connections"
#: The Secret's key holding the connections: the file's name in the mount.
KEY = "connections.json"
_SECRET_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # a DNS subdomain, as Kubernetes wants


class SecretFile:
    """The store's and transport's specs in a file only its owner can read, deleted by `remove()`. The sweep
    gets its path as an argument (a path is no secret)."""

    def __init__(self, secret: dict, claim_id: str) -> None:
        self.directory = tempfile.mkdtemp(prefix="adp-sweep-")  # 0700
        self.path = os.path.join(self.directory, f"sweep-{claim_id}.json")
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(secret, f)

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


@dataclass(frozen=True)
class DriverSecret:
    """`path`: what `--secret-file` names in the driver's pod, or None for a SecretFile of this task's own;
    `conf`: what spark-submit needs to put it there."""

    path: str | None
    conf: dict[str, str] = field(default_factory=dict)
    description: str = "the driver reads the connections from a file of its owner's here, deleted when the task ends"


def driver_secret(target: SparkTarget, conf: dict, connections_secret: str | None) -> DriverSecret:
    """Where the driver on `target` reads the connections; fails (SparkSetupError) where they could only reach
    it through a file spark-submit ships, which would outlive the task (see the module's docstring)."""
    if not target.cluster_mode:
        return DriverSecret(None)
    client = ("run the driver here instead: set the Spark connection's extra deploy-mode to 'client' (the driver "
              "only plans id ranges and sums counts; the partitions run on the executors either way)")
    if target.kind == "kubernetes":
        if connections_secret is None:
            raise SparkSetupError(
                f"on Kubernetes in cluster mode the connections file would be uploaded to "
                f"spark.kubernetes.file.upload.path, where nothing deletes it: make a Kubernetes Secret of them "
                f"(python -m airflow_delay_provider.spark.secret -o {KEY} ...; kubectl create secret generic "
                f"<name> --from-file={KEY}) and pass connections_secret='<name>', or {client}")
        if not _SECRET_NAME.fullmatch(connections_secret):
            raise InvalidInputError(f"connections_secret {connections_secret!r} is not a Kubernetes Secret's name "
                                    f"(lower-case letters, digits, '-' and '.')")
        key = f"spark.kubernetes.driver.secrets.{connections_secret}"
        mount = conf.get(key)
        return DriverSecret(f"{(mount or MOUNT).rstrip('/')}/{KEY}", {} if mount else {key: MOUNT},
                            f"the driver reads the connections from the Kubernetes Secret {connections_secret!r} "
                            f"mounted in its pod")
    if target.kind == "yarn":
        raise SparkSetupError(
            "in YARN cluster mode the connections file would go with the application, and YARN's NodeManagers keep "
            "such files in their nodes' file caches after it ends (until the cache outgrows "
            f"yarn.nodemanager.localizer.cache.target-size-mb): {client}")
    what = "a standalone master runs no Python application in cluster mode" if target.kind == "standalone" else \
        f"the connections file cannot go to a driver on {target.master} without a copy that outlives the task"
    raise SparkSetupError(f"{what}: {client}")


def main(argv: list[str] | None = None) -> int:
    """Write the connections a sweep's driver reads, as BulkSweepOperator would with the same arguments: the
    content of the Kubernetes Secret named by `connections_secret`. Make it again when the connections change."""
    from airflow_delay_provider.hooks.delay_store import DelayStoreHook
    from airflow_delay_provider.hooks.transport import check_transport, transport_hook, transport_options

    parser = argparse.ArgumentParser(prog="python -m airflow_delay_provider.spark.secret", description=main.__doc__)
    parser.add_argument("-o", "--output", required=True, help="the file to write (mode 0600; never overwritten)")
    parser.add_argument("--delay-store-conn-id", default="delay_store_default")
    parser.add_argument("--table", default=None)
    parser.add_argument("--db-schema", default=None)
    parser.add_argument("--transport", default="sql")
    parser.add_argument("--transport-conn-id", default=None)
    parser.add_argument("--transport-options", default="{}", help="JSON, as the operator's transport_options")
    args = parser.parse_args(argv)
    store = DelayStoreHook(args.delay_store_conn_id, table=args.table, db_schema=args.db_schema)
    kind = check_transport(args.transport)
    options = transport_options(kind, json.loads(args.transport_options))
    specs = {"store": store.store_spec(),
             "transport": transport_hook(kind, args.transport_conn_id, store, args.db_schema).transport_spec(**options)}
    fd = os.open(args.output, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(specs, f)
    print(f"wrote {args.output}: the connections of {args.delay_store_conn_id!r} and the {kind} transport "
          f"(holds their secrets: delete it once the Kubernetes Secret is made)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
