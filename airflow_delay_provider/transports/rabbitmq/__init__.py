"""RabbitMQ native delays: the levels of TTL queues, quorum queues driven by a binary routing key.

One module per concern: `routing` (the delay as routing-key bits, and the names a key can carry),
`topology` (what to declare: levels, delivery exchange, safety-net queues, endpoint queues),
`publisher` (confirmed publishing with a window in flight), `holding` (taking back what the levels
hold, for a migration to the store) and `transport` (the `Transport` over them).
"""

from airflow_delay_provider.transports.rabbitmq.holding import HeldReceipt, LevelHolder
from airflow_delay_provider.transports.rabbitmq.publisher import (
    DELAY_HEADER,
    STRIPPED_HEADERS,
    ConfirmingPublisher,
    Publication,
    PublishNacked,
    body_frames,
    header_frame,
)
from airflow_delay_provider.transports.rabbitmq.routing import (
    LEVELS,
    MAX_DELAY_SECONDS,
    MAX_ROUTING_KEY_BYTES,
    check_endpoint,
    first_level,
    max_delay,
    naming_rule,
    routing_key,
)
from airflow_delay_provider.transports.rabbitmq.topology import (
    DELIVERY_LIMIT,
    QUORUM,
    Binding,
    Exchange,
    Names,
    Queue,
    Topology,
    delay_topology,
    delivery_limit_policy,
    endpoint_arguments,
    endpoint_binding_key,
    endpoint_topology,
)
from airflow_delay_provider.transports.rabbitmq.transport import RabbitMQTransport, parameters_from_spec

__all__ = [
    "DELAY_HEADER",
    "DELIVERY_LIMIT",
    "LEVELS",
    "MAX_DELAY_SECONDS",
    "MAX_ROUTING_KEY_BYTES",
    "QUORUM",
    "STRIPPED_HEADERS",
    "Binding",
    "ConfirmingPublisher",
    "Exchange",
    "HeldReceipt",
    "LevelHolder",
    "Names",
    "Publication",
    "PublishNacked",
    "Queue",
    "RabbitMQTransport",
    "Topology",
    "body_frames",
    "check_endpoint",
    "delay_topology",
    "delivery_limit_policy",
    "endpoint_arguments",
    "endpoint_binding_key",
    "endpoint_topology",
    "first_level",
    "header_frame",
    "max_delay",
    "naming_rule",
    "parameters_from_spec",
    "routing_key",
]
