"""A toy transport, to prove the adding-a-transport promise: one module (this one: the `Transport` and its hook)
plus one registry entry make a broker every operator, trigger and the contract tests accept.

Each destination is a directory; each message a JSON file in it. Receiving renames a file to `<name>.taken`
(atomic, so two receivers never take one file); acknowledging deletes it; a taken file older than its
visibility timeout is visible again.
"""

from __future__ import annotations

import base64
import json
import os
import re
import time
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from airflow.sdk import BaseHook

from airflow_delay_provider.core.errors import DestinationNotFoundError, InvalidNameError
from airflow_delay_provider.core.message import DelayedMessage, check_destination
from airflow_delay_provider.core.ports import ReceivedMessage, Transport

_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")
_TAKEN = ".taken"


class DirectoryTransport(Transport):
    """Destinations are directories under `root`; messages are files."""

    name = "directory"

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> DirectoryTransport:
        return cls(spec["path"])

    def __repr__(self) -> str:
        return f"DirectoryTransport({str(self.root)!r})"

    def check_endpoint(self, endpoint: str, **options: Any) -> str:
        name = check_destination(endpoint)
        if not _NAME.fullmatch(name) or name.endswith(_TAKEN):
            raise InvalidNameError(f"a directory destination is 1-100 letters, digits, '.', '_' or '-', not starting "
                                   f"with '.' nor ending in {_TAKEN!r}; got {endpoint!r}")
        return name

    def _dir(self, endpoint: str) -> Path:
        path = self.root / self.check_endpoint(endpoint)
        if not path.is_dir():
            raise DestinationNotFoundError(f"queue {endpoint!r} does not exist in {self.root}")
        return path

    def provision(self, endpoint: str, **options: Any) -> dict[str, Any]:
        path = self.root / self.check_endpoint(endpoint)
        created = not path.is_dir()
        path.mkdir(parents=True, exist_ok=True)
        return {"transport": self.name, "endpoint": endpoint, "created": created}

    def verify(self, endpoints: Iterable[str] = ()) -> dict[str, Any]:
        missing = [e for e in endpoints if not (self.root / self.check_endpoint(e)).is_dir()]
        return {"complete": not missing, "missing": missing, "different": []}

    def send(self, messages: Sequence[DelayedMessage], connection: Any = None) -> dict[str, Exception]:
        failures: dict[str, Exception] = {}
        for m in messages:
            try:
                path = self._dir(m.destination)
            except (DestinationNotFoundError, InvalidNameError) as exc:
                failures[m.message_id] = exc
                continue
            record = {"message_id": m.message_id, "body": base64.b64encode(m.body).decode(), "headers": m.headers,
                      "due_at": m.due_at.isoformat(), "sent_at": self.clock().isoformat()}
            partial = path / f".{uuid.uuid4().hex}.part"  # written whole, then renamed in: never read half-written
            partial.write_text(json.dumps(record))
            partial.rename(path / f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.json")
        return failures

    def receive(self, endpoint: str, max_messages: int = 10, visibility_timeout: float = 30.0) -> list[ReceivedMessage]:
        path = self._dir(endpoint)
        for taken in path.glob(f"*{_TAKEN}"):  # not acknowledged in time: visible again
            try:
                if time.time() - taken.stat().st_mtime > visibility_timeout:
                    taken.rename(taken.with_name(taken.name[:-len(_TAKEN)]))
            except FileNotFoundError:
                pass  # acknowledged or returned meanwhile
        received = []
        for file in sorted(path.glob("*.json")):
            if len(received) >= max_messages:
                break
            receipt = file.with_name(file.name + _TAKEN)
            try:
                file.rename(receipt)
            except FileNotFoundError:
                continue  # another receiver took it first
            os.utime(receipt)  # the visibility timeout counts from now
            record = json.loads(receipt.read_text())
            received.append(ReceivedMessage(
                message_id=record["message_id"], destination=endpoint, body=base64.b64decode(record["body"]),
                headers=record["headers"], receipt=str(receipt), enqueued_at=datetime.fromisoformat(record["sent_at"]),
                due_at=datetime.fromisoformat(record["due_at"])))
        return received

    def ack(self, endpoint: str, receipts: Iterable[Any]) -> int:
        count = 0
        for receipt in receipts:
            try:
                Path(receipt).unlink()
                count += 1
            except FileNotFoundError:
                pass  # its visibility timeout ran out and someone else has it
        return count

    def depth(self, endpoint: str) -> dict[str, int]:
        path = self._dir(endpoint)
        return {"visible": len(list(path.glob("*.json"))), "in_flight": len(list(path.glob(f"*{_TAKEN}")))}


class DirectoryHook(BaseHook):
    """Opens a DirectoryTransport from a connection whose extra `path` (or host) is the root directory."""

    conn_name_attr = "directory_conn_id"
    default_conn_name = "directory_default"
    conn_type = "generic"
    hook_name = "Directory (toy transport)"

    def __init__(self, directory_conn_id: str = default_conn_name) -> None:
        super().__init__()
        self.directory_conn_id = directory_conn_id

    @classmethod
    def for_transport(cls, conn_id: str, db_schema: str | None = None) -> DirectoryHook:
        return cls(conn_id)

    def transport_spec(self) -> dict[str, Any]:
        conn = self.get_connection(self.directory_conn_id)
        return {"kind": "directory", "path": conn.extra_dejson.get("path") or conn.host}

    def get_transport(self) -> DirectoryTransport:
        return DirectoryTransport.from_spec(self.transport_spec())
