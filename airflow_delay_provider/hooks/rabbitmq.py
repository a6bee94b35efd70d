"""RabbitMQDelayHook: a RabbitMQ broker (native delays through the 28 TTL levels) behind an Airflow connection."""

from __future__ import annotations

import ssl
from typing import Any

import pika
from airflow.sdk import BaseHook

from airflow_delay_provider.core.errors import InvalidInputError
from airflow_delay_provider.transports.rabbitmq import LEVELS, RabbitMQTransport


def _flag(value: Any) -> bool:
    """Extras from URI-style connections arrive as strings."""
    return value is True or str(value).lower() in ("true", "1", "yes")


def parameters_from_connection(conn: Any) -> tuple[pika.ConnectionParameters, dict]:
    """pika parameters from a `rabbitmq` connection: host, port, login, password, schema = virtual host.

    Extras: heartbeat (s, default 60), tls (bool), tls_verify (bool, default true), prefix (default
    "delay"), levels (default 28), confirm_window (default 1000).
    """
    extra = conn.extra_dejson or {}
    try:
        heartbeat = int(extra.get("heartbeat", 60))
        levels = int(extra.get("levels", LEVELS))
        window = int(extra.get("confirm_window", 1000))
    except ValueError as exc:
        raise InvalidInputError(f"rabbitmq connection extras heartbeat, levels and confirm_window must be integers: {exc}") from None
    tls = None
    if _flag(extra.get("tls", False)):
        context = ssl.create_default_context()
        if not _flag(extra.get("tls_verify", True)):
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        tls = pika.SSLOptions(context, conn.host)
    params = pika.ConnectionParameters(
        host=conn.host or "127.0.0.1",
        port=int(conn.port or (5671 if tls else 5672)),
        virtual_host=conn.schema or "/",
        credentials=pika.PlainCredentials(conn.login or "guest", conn.password or "guest"),
        heartbeat=heartbeat,
        ssl_options=tls,
        connection_attempts=1,
        blocked_connection_timeout=30,
    )
    return params, {"prefix": extra.get("prefix") or "delay", "levels": levels, "confirm_window": window}


class RabbitMQDelayHook(BaseHook):
    """Opens the RabbitMQ transport named by a `rabbitmq` connection."""

    conn_name_attr = "rabbitmq_conn_id"
    default_conn_name = "rabbitmq_default"
    conn_type = "rabbitmq"
    hook_name = "RabbitMQ (delayed delivery)"

    def __init__(self, rabbitmq_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rabbitmq_conn_id = rabbitmq_conn_id

    def get_transport(self) -> RabbitMQTransport:
        params, options = parameters_from_connection(self.get_connection(self.rabbitmq_conn_id))
        return RabbitMQTransport(params, **options)

    def get_conn(self) -> RabbitMQTransport:
        return self.get_transport()

    def test_connection(self) -> tuple[bool, str]:
        try:
            transport = self.get_transport()
            report = transport.verify()
            transport.close()
        except Exception as exc:  # shown in the UI; pika's errors carry no password
            return False, f"{type(exc).__name__}: {exc}"
        if report["complete"]:
            return True, f"Reached {transport.where}; the delay topology is complete ({report['unroutable_depth']} unroutable)"
        return True, f"Reached {transport.where}; delay topology incomplete: missing {report['missing']}, different {report['different']}"
