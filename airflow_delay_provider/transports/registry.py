"""Every transport kind in one place: its class, the Airflow hook that opens it, the options it takes.

Operators, triggers, the Spark sweep and the CLI all read this table. Adding a broker is one module
(a `Transport` with `from_spec`, and a hook with `for_transport`) and one entry here. Classes are
named, not imported, so a Spark executor or a triggerer loads only the broker it uses, and this
module needs no Airflow.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow_delay_provider.core.errors import InvalidInputError

if TYPE_CHECKING:
    from airflow_delay_provider.core.ports import Transport


@dataclass(frozen=True)
class TransportKind:
    #: The `transport=` value DAG authors write.
    name: str
    #: "module:Class" of the Transport; the class builds itself from plain data with `from_spec`.
    transport: str
    #: "module:Class" of the Airflow hook; `Hook.for_transport(conn_id, db_schema)` opens it.
    hook: str
    #: The connection used when none is given; None: the store's own database.
    default_conn_id: str | None
    #: Keys DAG authors may set in `transport_options`.
    transport_options: tuple[str, ...] = ()
    #: Keys of `endpoint_options` at provisioning (`queue_delay_seconds` is kept in the store).
    endpoint_options: tuple[str, ...] = ("queue_delay_seconds",)
    #: The longest queue-level delay the broker's queues take as an attribute of their own (None: none).
    queue_attribute_delay: int | None = None


_PACKAGE = "airflow_delay_provider"

TRANSPORTS: dict[str, TransportKind] = {
    kind.name: kind
    for kind in (
        TransportKind("sql", f"{_PACKAGE}.transports.sql:SqlTableTransport",
                      f"{_PACKAGE}.hooks.delay_store:DelayStoreHook", None),
        TransportKind("rabbitmq", f"{_PACKAGE}.transports.rabbitmq:RabbitMQTransport",
                      f"{_PACKAGE}.hooks.rabbitmq:RabbitMQDelayHook", "rabbitmq_default"),
        TransportKind("sqs", f"{_PACKAGE}.transports.sqs:SqsTransport", f"{_PACKAGE}.hooks.sqs:SqsDelayHook",
                      "aws_default",
                      transport_options=("body_expiration_days", "large_body_bucket", "max_body_bytes",
                                         "max_relay_downtime", "prefix", "queue_delay", "unrestricted"),
                      endpoint_options=("queue_delay_seconds", "unrestricted"), queue_attribute_delay=900),
    )
}


def transport_kind(name: object) -> TransportKind:
    """The registry entry of `name`, or an error listing the transports there are."""
    if not isinstance(name, str) or name not in TRANSPORTS:
        raise InvalidInputError(f"transport {name!r} is not supported; choose one of {list(TRANSPORTS)}")
    return TRANSPORTS[name]


def check_transport(name: object) -> str:
    return transport_kind(name).name


def load(path: str) -> Any:
    """The object a "module:attribute" path names."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def transport_class(name: object) -> type[Transport]:
    """The `Transport` subclass of the transport `name` (imported now)."""
    cls: type[Transport] = load(transport_kind(name).transport)
    return cls


def from_spec(spec: dict[str, Any]) -> Transport:
    """A transport from the plain data a hook's `transport_spec()` gives (holds secrets)."""
    return transport_class(spec.get("kind")).from_spec(spec)


def check_options(name: str, options: dict[str, Any], field: str = "transport_options") -> dict[str, Any]:
    """`options` if every key is one the transport takes (`field`: transport_options or endpoint_options).
    A transport that takes no transport_options refuses any: ignored, they would hide a mistake (options
    meant for another transport, or the wrong transport)."""
    kind = transport_kind(name)
    allowed = kind.transport_options if field == "transport_options" else kind.endpoint_options
    if field == "transport_options" and options and not allowed:
        takers = [k.name for k in TRANSPORTS.values() if k.transport_options]
        raise InvalidInputError(f"transport={name!r} takes no transport_options, got {sorted(options)}; only "
                                f"{takers} take any")
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise InvalidInputError(f"{field} {unknown} are not known for transport={name!r}; allowed: {sorted(allowed)}")
    return dict(options)
