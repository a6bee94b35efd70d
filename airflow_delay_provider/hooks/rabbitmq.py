"""RabbitMQDelayHook: a RabbitMQ broker (native delays through the 28 TTL levels) behind an Airflow connection."""

from __future__ import annotations

import logging
from typing import Any

from airflow.sdk import BaseHook

from airflow_delay_provider.transports.rabbitmq import RabbitMQTransport

# pika logs every connection and channel it opens at INFO: noise in task logs, not news.
logging.getLogger("pika").setLevel(logging.WARNING)


def connection_spec(conn: Any) -> dict:
    """A `rabbitmq` connection as plain data (host, port, login, password, schema = virtual host).

    Extras: heartbeat (s, default 60), tls (bool), tls_verify (bool, default true), prefix (default
    "delay"), levels (default 28), confirm_window (default 1000), delivery_limit (redeliveries an
    endpoint queue allows before a message goes to `<prefix>.poison`, default 20; applies to queues
    declared from then on).
    """
    extra = conn.extra_dejson or {}
    options = ("heartbeat", "tls", "tls_verify", "prefix", "levels", "confirm_window", "delivery_limit")
    return {
        **{k: extra[k] for k in options if k in extra},
        "host": conn.host, "port": conn.port, "virtual_host": conn.schema,
        "login": conn.login, "password": conn.password,
    }


class RabbitMQDelayHook(BaseHook):
    """Opens the RabbitMQ transport named by a `rabbitmq` connection (default `rabbitmq_default`).

    The connection: Host (default 127.0.0.1), Port (default 5672, 5671 with TLS), Login and Password
    (default guest/guest), Schema as the virtual host (default `/`), and the extras of
    `connection_spec`: heartbeat, tls, tls_verify, prefix (of the delay exchanges and queues), levels,
    confirm_window and delivery_limit.

    :param rabbitmq_conn_id: the `rabbitmq` connection.
    """

    conn_name_attr = "rabbitmq_conn_id"
    default_conn_name = "rabbitmq_default"
    conn_type = "rabbitmq"
    hook_name = "RabbitMQ (delayed delivery)"

    def __init__(self, rabbitmq_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rabbitmq_conn_id = rabbitmq_conn_id

    @classmethod
    def for_transport(cls, conn_id: str, db_schema: str | None = None) -> RabbitMQDelayHook:
        """The hook of a `transport="rabbitmq"` connection (see the transport registry); no db_schema."""
        return cls(conn_id)

    def get_transport(self) -> RabbitMQTransport:
        """The transport: sends through the delay levels and delivery exchange, provisions and verifies
        the topology; it connects to the broker when first used."""
        return RabbitMQTransport.from_spec(self.transport_spec())

    def transport_spec(self) -> dict:
        """The connection as plain data, for a process without Airflow (a Spark sweep); holds the password."""
        return {"kind": "rabbitmq", **connection_spec(self.get_connection(self.rabbitmq_conn_id))}

    def get_conn(self) -> RabbitMQTransport:
        """The transport (Airflow's generic name for get_transport)."""
        return self.get_transport()

    def test_connection(self) -> tuple[bool, str]:
        """Reach the broker and report whether the delay topology is complete (the UI's Test button)."""
        try:
            transport = self.get_transport()
            report = transport.verify()
            transport.close()
        except Exception as exc:  # shown in the UI; pika's errors carry no password
            return False, f"{type(exc).__name__}: {exc}"
        if report["complete"]:
            return True, (f"Reached {transport.where}; the delay topology is complete "
                          f"({report['unroutable_depth']} unroutable)")
        return True, (f"Reached {transport.where}; delay topology incomplete: missing {report['missing']}, "
                      f"different {report['different']}")
